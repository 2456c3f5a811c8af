"""The training loop: data onto the mesh, jitted steps, faults, checkpoints, logs.

Every run writes into its output directory (a new run refuses a directory
that already holds one; `resume=True` continues the run in it):
- `config.json`: the resolved config;
- `metrics.jsonl`: one JSON object per logged step (step 1, then every
  `log_every`): `step`, `loss` (mean train loss of the applied steps since the
  previous row), `grad_norm` (pre-clip, this step), `lr` (this step's),
  `skipped` (steps skipped since the previous row), `step_time_s`,
  `tokens_per_sec`, `model_tflops_per_device` and `mfu` (null for step 1,
  which includes compilation; mfu null where the peak is unknown), and
  `eval_loss` on evaluation steps;
- `run.json`: the TP record (`jaxtp.record.run_record`);
- `checkpoints/<step>/`: orbax checkpoints (`jaxtp.checkpoint`) every
  `train.checkpoint_every` steps, at the end, and on SIGTERM/SIGINT.

Faults: a step whose loss or gradient norm is not finite (or, with
`train.spike_factor`, whose loss exceeds that factor times the mean of the
last 20 applied losses) leaves parameters and optimizer state unchanged, is
logged with its step, and `train.max_skipped_steps` of them in a row stop the
run with `TrainingStopped` (after saving the last good state).

Multi-process: every process runs this loop over the same global batches
(each transfers only its own rows); only process 0 logs and writes files;
all processes take part in checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from .checkpoint import Checkpointer
from .config import Config
from .data import Dataset, load_tokens, to_mesh
from .distributed import any_process
from .metrics import MetricsLog, finite, peak_flops, speed
from .plan import model_flops_per_token
from .record import run_record
from .sharding import make_mesh
from .train_lib import (abstract_model, abstract_train_state, compile_train_step,
                        init_train_state, lr_schedule, make_eval_step, single_device_check,
                        step_controls)

SPIKE_WINDOW = 20  # applied losses the spike guard averages over


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps in a row)."""


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def evaluate(eval_step, params, batches, mesh) -> float:
    losses = [eval_step(params, to_mesh(b, mesh)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create `out_dir`, refusing one that already holds a run."""
    out = Path(out_dir)
    taken = [n for n in ("metrics.jsonl", "config.json", "run.json", "checkpoints")
             if (out / n).exists()]
    if taken:
        raise FileExistsError(f"--out {out} already holds a run ({', '.join(taken)}); "
                              "choose a new directory, or --resume to continue it")
    out.mkdir(parents=True, exist_ok=True)
    return out


class _Signals:
    """SIGTERM/SIGINT set a flag the loop checks after each step (main thread only)."""

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: Config, out_dir: str | Path, data_path: str | None = None,
          log: Callable[[str], None] = print, check: bool = False,
          init_params=None, resume: bool = False, inject_nan_at=(),
          peak_tflops: float | None = None, tensorboard: bool = False,
          until: int | None = None) -> dict:
    """Train `cfg` and return a summary; see the module docstring for the files.

    `init_params`: starting values (an nnx.State or nested dict, e.g. from
    `jaxtp.convert.read_hf`) instead of a fresh initialisation. `resume`:
    continue from the latest complete checkpoint in `out_dir` (any tp/dp).
    `inject_nan_at`: steps whose gradients are made NaN (a fault drill).
    `peak_tflops`: per-device peak for MFU, where `jaxtp.metrics.PEAK_FLOPS` lacks it.
    `until`: stop after this step with a checkpoint (the schedule still spans
    `train.steps`): a run split into jobs of fixed length.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if until is not None and until < 1:
        raise ValueError(f"--until {until}: the step to stop after must be >= 1")
    if any(s < 1 for s in inject_nan_at):
        raise ValueError(f"--inject-nan-at {sorted(inject_nan_at)}: steps start at 1")
    main = jax.process_index() == 0
    log = log if main else (lambda _: None)
    if check and (jax.process_count() > 1 or resume):
        raise ValueError("--check replays the first steps on one device: run it "
                         "single-process and not with --resume")
    data = Dataset(load_tokens(data_path), m.seq_len, m.vocab_size)  # fail before writing
    mesh = make_mesh(p.dp, p.tp)
    out = Path(out_dir)
    # a refusal must stop every process, not leave the others waiting in a barrier
    refused = None
    try:
        if resume and not (out / "checkpoints").is_dir():
            raise FileNotFoundError(f"--resume: no checkpoints under {out}/checkpoints")
        if main and not resume:
            prepare_out_dir(out)
        if tensorboard and main:
            MetricsLog.check_tensorboard()
    except (OSError, ImportError) as e:
        refused = e
    if any_process(refused is not None):
        raise refused or FileExistsError(f"process 0 refused --out {out}: see its log")
    ckpt = Checkpointer(out / "checkpoints", keep=t.keep_checkpoints, log=log)

    start, meta = 0, {}
    if resume:
        target = abstract_train_state(cfg, mesh)
        start, params, opt_state, meta = ckpt.restore(target.params, target.opt_state,
                                                      model=dataclasses.asdict(m))
        data_id = _data_id(data_path, data)
        for key, now in (("seed", t.seed), ("batch_size", t.batch_size), ("data", data_id)):
            if meta.get(key) != now:
                raise ValueError(f"--resume: the checkpoint was trained with {key}="
                                 f"{meta.get(key)!r}, this run has {now!r}; the data order "
                                 "depends on it")
        changed = {k: (meta["schedule"][k], v) for k, v in _schedule(t).items()
                   if meta.get("schedule", {}).get(k, v) != v}
        if changed:
            log(f"warning: --resume with a different schedule: {changed} (saved, now)")
        state = dataclasses.replace(target, params=params, opt_state=opt_state)
        log(f"resumed from {out}/checkpoints step {start} (saved at dp={meta['dp']} x "
            f"tp={meta['tp']}; now dp={p.dp} x tp={p.tp})")
    else:
        state = init_train_state(cfg, mesh, params=init_params)
    if main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    n_params = count_params(state.params)
    log(f"model: {m.style}, {n_params:,} params, {m.n_layers} layers"
        f"{' (scanned)' if m.scan_layers else ''}, d_model={m.d_model}, heads={m.n_heads}/"
        f"{m.kv_heads} kv, d_ff={m.d_ff}, seq={m.seq_len}, {m.dtype} compute / "
        f"{m.param_dtype} params | mesh dp={p.dp} x tp={p.tp}, impl={p.impl}"
        f"{', fsdp' if p.fsdp else ''}{', sp' if p.sp else ''} | batch {t.batch_size}"
        f"{f' in {t.microbatches} microbatches' if t.microbatches > 1 else ''} | "
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens")
    t0 = time.perf_counter()
    train_step = compile_train_step(state, t.batch_size, m.seq_len, use_dropout=m.dropout > 0,
                                    microbatches=t.microbatches)
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
    structure = nnx.merge(*abstract_model(cfg, mesh))  # no buffers: step 1 donates them
    record = run_record(cfg, mesh, structure, train_step.as_text())

    eval_step = make_eval_step(state)
    eval_set = data.eval_batches(t.batch_size, t.eval_batches)
    schedule = lr_schedule(t)
    batches = data.train_batches(t.batch_size, t.seed, skip=start)
    base_key = jax.random.key(t.seed)
    tokens_per_step = t.batch_size * m.seq_len
    flops_per_token = model_flops_per_token(cfg, n_params)
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(mesh.devices.flat[0])

    params, opt_state = state.params, state.opt_state
    params0 = jax.device_get(params) if check else None
    # the check replays up to the first step that moves the parameters (step 1
    # runs at lr 0 when there is a warmup)
    check_at = next((s for s in range(1, t.steps + 1) if schedule(s - 1) > 0), t.steps)
    replay, history, rates = [], [], []
    # carried across a resume, so a resumed run logs exactly what a straight one does
    pending = [np.float32(x) for x in meta.get("pending_losses", [])]
    recent = [float(x) for x in meta.get("recent_losses", [])]
    bad_in_a_row = meta.get("skipped_in_a_row", 0)
    # optax's step count, which a skipped step does not advance: the lr it applies
    applied = meta.get("applied_steps", start)
    if until is not None and until <= start:
        log(f"--until {until}: the run is already at step {start}; nothing to do")
    skipped_since_row = meta.get("skipped_since_row", 0)
    eval_loss, interrupted, step = None, None, start
    t_start = time.perf_counter()
    t_last, last_logged = t_start, start

    saved = []

    def save(at_step: int):
        if saved and saved[-1] == at_step:
            return  # e.g. a signal during the last step, already saved
        saved.append(at_step)
        ckpt.save(at_step, params, opt_state, {
            "model": dataclasses.asdict(m), "dp": p.dp, "tp": p.tp, "seed": t.seed,
            "data_position": at_step, "pending_losses": [float(x) for x in pending],
            "recent_losses": recent, "skipped_in_a_row": bad_in_a_row,
            "skipped_since_row": skipped_since_row, "applied_steps": applied,
            "batch_size": t.batch_size, "data": _data_id(data_path, data),
            "schedule": _schedule(t)})

    metrics_log = MetricsLog(out, start, tensorboard) if main else None
    try:
        with jax.set_mesh(mesh), _Signals() as signals:
            for step in range(start + 1, min(t.steps, until or t.steps) + 1):
                tokens = to_mesh(next(batches), mesh)
                key = jax.random.fold_in(base_key, step)
                max_loss = (t.spike_factor * float(np.mean(recent[-SPIKE_WINDOW:]))
                            if t.spike_factor and len(recent) >= 5 else math.inf)
                controls = step_controls(max_loss, math.nan if step in inject_nan_at else 1.0)
                lr = float(schedule(applied))
                params, opt_state, metrics = train_step(params, opt_state, tokens, key,
                                                        controls)
                metrics = jax.device_get(metrics)  # one host sync per step
                if metrics["skipped"]:
                    bad_in_a_row += 1
                    skipped_since_row += 1
                    log(f"step {step}: skipped (loss {float(metrics['loss']):.4g}, grad_norm "
                        f"{float(metrics['grad_norm']):.4g}"
                        + (f", spike limit {max_loss:.4g}" if max_loss < math.inf else "")
                        + f"): parameters and optimizer state unchanged "
                        f"[{bad_in_a_row} in a row of max {t.max_skipped_steps}]")
                    if bad_in_a_row >= t.max_skipped_steps:
                        save(step)
                        ckpt.wait()
                        raise TrainingStopped(
                            f"stopping at step {step}: {bad_in_a_row} steps in a row had a "
                            "non-finite or spiking loss/gradient (train.max_skipped_steps="
                            f"{t.max_skipped_steps}); the last good state is checkpointed "
                            f"in {out}/checkpoints as step {step}")
                else:
                    bad_in_a_row = 0
                    applied += 1
                    pending.append(metrics["loss"])
                    recent = (recent + [float(metrics["loss"])])[-SPIKE_WINDOW:]
                if check and step <= check_at:
                    replay.append((jax.device_get(tokens), key))
                if check and step == check_at:
                    record["check"] = single_device_check(
                        cfg, params0, *zip(*replay), float(metrics["loss"]),
                        float(metrics["grad_norm"]), jax.device_get(params))
                    log(f"check against one device after step {step}: " + ", ".join(
                        f"{k} {v:.2e}" for k, v in record["check"].items()
                        if k != "after_step"))
                is_eval = step % t.eval_every == 0 or step == t.steps
                if step == 1 or step % t.log_every == 0 or is_eval:
                    timed = step > 1 and step - 1 != start  # not the first step run
                    dt = (time.perf_counter() - t_last) / (step - last_logged) if timed else None
                    row = {"step": step,
                           "loss": float(np.mean(pending)) if pending else None,
                           "grad_norm": finite(metrics["grad_norm"]),
                           "lr": lr, "skipped": skipped_since_row,
                           **speed(dt, tokens_per_step, flops_per_token, mesh.size, peak)}
                    if is_eval:
                        eval_loss = row["eval_loss"] = evaluate(eval_step, params, eval_set,
                                                                mesh)
                    if main:
                        metrics_log.write(row)
                    history.append(row)
                    if row["tokens_per_sec"]:
                        rates.append(row["tokens_per_sec"])
                    log(f"step {step:>5}/{t.steps} | loss "
                        + (f"{row['loss']:.4f}" if row["loss"] is not None else "-")
                        + f" | grad_norm {float(metrics['grad_norm']):.3f} | lr {lr:.2e} | "
                        + (f"{row['tokens_per_sec']:,.0f} tok/s, {dt * 1e3:.0f} ms/step"
                           if dt else "first step")
                        + (f", MFU {row['mfu']:.1%}" if row["mfu"] else "")
                        + (f" | {skipped_since_row} skipped" if skipped_since_row else "")
                        + (f" | eval_loss {eval_loss:.4f}" if is_eval else ""))
                    pending, skipped_since_row, last_logged = [], 0, step
                    t_last = time.perf_counter()  # eval time is not counted in tok/s
                if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps \
                        or step == until:
                    save(step)
                if any_process(signals.received is not None):
                    interrupted = signal.Signals(signals.received or signal.SIGTERM).name
                    save(step)
                    ckpt.wait()
                    log(f"{interrupted} received: saved a checkpoint at step {step} in "
                        f"{out}/checkpoints; continue with --resume --out {out}")
                    break
            ckpt.wait()
    finally:
        ckpt.close()
        if metrics_log is not None:
            metrics_log.close()

    if main:
        (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    summary = {
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "final_eval_loss": eval_loss,
        "tokens_per_sec": float(np.median(rates)) if rates else None,
        "wall_s": time.perf_counter() - t_start,
        "last_step": step,
        "interrupted": interrupted,
        "finished": step == t.steps,
        "out_dir": str(out),
    }
    if interrupted is None and history and step == t.steps:
        log(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
            f"eval_loss {eval_loss:.4f}, median {summary['tokens_per_sec'] or 0:,.0f} tok/s, "
            f"{summary['wall_s']:.0f}s; wrote {out}")
    return summary | {"params": params, "history": history}


def _data_id(path: str | None, data: Dataset) -> str:
    return f"{path or 'builtin'} ({len(data.train) + len(data.val)} tokens)"


def _schedule(t) -> dict:
    return {k: getattr(t, k) for k in ("steps", "lr", "warmup_steps", "min_lr_ratio")}
