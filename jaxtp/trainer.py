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

The device stays busy: the step's key, lr, spike limit and skip counts are
computed inside the jitted step (`train_lib.make_loop_step`, `LoopState`),
and the host reads anything back only on logged rows, evaluations and
checkpoints, so it places batch n+1 and dispatches step n+1 while step n
runs (on an accelerator; XLA's CPU runtime waits for the donated buffers of
step n). A background thread placing the batches was slower on CPU: 2.8 ms
per step outside the call at tp=8 against 0.85 ms inline (it competes with
the step for the GIL). The median host time per step outside the step call
is logged at the end and kept in run.json (`host_ms_per_step`).

Faults: a step whose loss or gradient norm is not finite (or, with
`train.spike_factor`, whose loss exceeds that factor times the mean of the
last 20 applied losses) leaves parameters and optimizer state unchanged and
is logged at the next row with its step; `train.max_skipped_steps` of them
in a row stop the run with `TrainingStopped` (after saving the last good
state, the one at the step that reached the limit: later steps the host had
already dispatched change nothing).

Multi-process: every process runs this loop over the same global batches
(each transfers only its own rows); only process 0 logs and writes files;
all processes take part in checkpoints, and agree on a stop signal at rows
and checkpoints (one host allgather there, none per step).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from .checkpoint import CheckpointError, Checkpointer
from .config import Config
from .data import Dataset, load_tokens, to_mesh
from .distributed import any_process
from .metrics import MetricsLog, finite, peak_flops, speed
from .plan import model_flops_per_token
from .record import run_record
from .sharding import make_mesh, named
from .train_lib import (LoopState, abstract_model, abstract_train_state, init_train_state,
                        is_row_step, lr_schedule, make_eval_step, make_loop_step,
                        resolve_attention, single_device_check)


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
    cfg = resolve_attention(cfg, mesh.devices.flat[0])  # a KernelError before writing
    m = cfg.model
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
        state, start, meta = _restore(cfg, mesh, ckpt, out, data_path, data, log)
    else:
        state = init_train_state(cfg, mesh, params=init_params)
    if main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    n_params = count_params(state.params)
    log(f"model: {m.style}, {n_params:,} params, {m.n_layers} layers"
        f"{' (scanned)' if m.scan_layers else ''}, d_model={m.d_model}, heads={m.n_heads}/"
        f"{m.kv_heads} kv, d_ff={m.d_ff}, seq={m.seq_len}, {m.dtype} compute / "
        f"{m.param_dtype} params | mesh dp={p.dp} x tp={p.tp}, impl={p.impl}"
        f"{', fsdp' if p.fsdp else ''}{', sp' if p.sequence_parallel else ''} | batch {t.batch_size}"
        f"{f' in {t.microbatches} microbatches' if t.microbatches > 1 else ''} | "
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens")
    log(f"attention: {m.attention}"
        + (f" (block {m.attention_block})" if m.attention == "blockwise" else "")
        + f", remat: {m.remat}"
        + (f", loss in chunks of {m.loss_chunk} tokens" if m.loss_chunk else ""))
    loop = LoopState.start(t.seed, mesh, meta.get("loop"))
    t0 = time.perf_counter()
    tokens_spec = jax.ShapeDtypeStruct((t.batch_size, m.seq_len + 1), np.int32,
                                       sharding=named(mesh, "batch", None))
    with jax.set_mesh(mesh):
        train_step = make_loop_step(state, cfg, inject_nan_at).lower(
            state.params, state.opt_state, loop, tokens_spec).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
    structure = nnx.merge(*abstract_model(cfg, mesh))  # no buffers: step 1 donates them
    record = run_record(cfg, mesh, structure, train_step.as_text())

    eval_step = make_eval_step(state)
    eval_set = data.eval_batches(t.batch_size, t.eval_batches)
    schedule = lr_schedule(t)
    batches = data.train_batches(t.batch_size, t.seed, skip=start)
    tokens_per_step = t.batch_size * m.seq_len
    flops_per_token = model_flops_per_token(cfg, n_params)
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(mesh.devices.flat[0])
    multi = jax.process_count() > 1

    params, opt_state = state.params, state.opt_state
    params0 = jax.device_get(params) if check else None
    # the check replays up to the first step that moves the parameters (step 1
    # runs at lr 0 when there is a warmup)
    check_at = next((s for s in range(1, t.steps + 1) if schedule(s - 1) > 0), t.steps)
    replay, history, rates, host_s = [], [], [], []
    if until is not None and until <= start:
        log(f"--until {until}: the run is already at step {start}; nothing to do")
    eval_loss, interrupted, step = None, None, start
    t_start = time.perf_counter()
    t_last, last_logged = t_start, start
    saved = []

    def save(at_step: int, loop_json: dict):
        if saved and saved[-1] == at_step:
            return  # e.g. a signal during the last step, already saved
        saved.append(at_step)
        ckpt.save(at_step, params, opt_state, {
            "model": dataclasses.asdict(m), "dp": p.dp, "tp": p.tp, "seed": t.seed,
            "data_position": at_step, "loop": loop_json | {"step": at_step},
            "batch_size": t.batch_size, "data": _data_id(data_path, data),
            "schedule": _schedule(t)})

    metrics_log = MetricsLog(out, start, tensorboard) if main else None
    try:
        with jax.set_mesh(mesh), _Signals() as signals:
            for step in range(start + 1, min(t.steps, until or t.steps) + 1):
                t_iter = time.perf_counter()
                host_tokens = next(batches)
                tokens = to_mesh(host_tokens, mesh)
                t_call = time.perf_counter()
                params, opt_state, loop, metrics = train_step(params, opt_state, loop, tokens)
                t_back = time.perf_counter()
                row_step = bool(is_row_step(step, t))
                ckpt_step = (t.checkpoint_every and step % t.checkpoint_every == 0) \
                    or step == t.steps or step == until
                if check and step <= check_at:
                    replay.append((host_tokens, jax.random.fold_in(jax.random.key(t.seed), step)))
                if check and step == check_at:
                    host = jax.device_get(metrics)
                    record["check"] = single_device_check(
                        cfg, params0, *zip(*replay), float(host["loss"]),
                        float(host["grad_norm"]), jax.device_get(params))
                    log(f"check against one device after step {step}: " + ", ".join(
                        f"{k} {v:.2e}" for k, v in record["check"].items()
                        if k != "after_step"))
                # the host waits for the device only on rows and checkpoints
                state_now = loop.to_json() if row_step or ckpt_step else None
                if row_step and state_now["row_skipped"]:
                    log(f"step {state_now['skip_step']}: skipped (loss "
                        f"{state_now['skip_loss']:.4g}, grad_norm "
                        f"{state_now['skip_grad_norm']:.4g}): parameters and optimizer state "
                        f"unchanged [{state_now['row_skipped']} skipped since the last row; "
                        f"{state_now['in_a_row']} in a row of max {t.max_skipped_steps}]")
                if state_now and state_now["stop_at"]:
                    _stop(state_now, t, out, save, ckpt)
                if row_step:
                    host = jax.device_get(metrics)
                    is_eval = step % t.eval_every == 0 or step == t.steps
                    timed = step > 1 and step - 1 != start  # not the first step run
                    dt = (time.perf_counter() - t_last) / (step - last_logged) if timed else None
                    row = _row(step, host, state_now, speed(
                        dt, tokens_per_step, flops_per_token, mesh.size, peak))
                    if is_eval:
                        eval_loss = row["eval_loss"] = evaluate(eval_step, params, eval_set,
                                                                mesh)
                    if main:
                        metrics_log.write(row)
                    history.append(row)
                    if row["tokens_per_sec"]:
                        rates.append(row["tokens_per_sec"])
                    log(_progress(row, t.steps, dt, eval_loss if is_eval else None))
                    last_logged = step
                    t_last = time.perf_counter()  # eval time is not counted in tok/s
                if ckpt_step:
                    save(step, state_now)
                stop = signals.received is not None
                if multi and not (row_step or ckpt_step):
                    stop = False  # processes agree on a stop at rows: one host allgather
                elif multi:
                    stop = any_process(stop)
                if stop:
                    interrupted = signal.Signals(signals.received or signal.SIGTERM).name
                    save(step, loop.to_json())
                    ckpt.wait()
                    log(f"{interrupted} received: saved a checkpoint at step {step} in "
                        f"{out}/checkpoints; continue with --resume --out {out}")
                    break
                if not (row_step or ckpt_step or check):
                    host_s.append((t_call - t_iter) + (time.perf_counter() - t_back))
            ckpt.wait()
    finally:
        ckpt.close()
        if metrics_log is not None:
            metrics_log.close()

    host_ms = float(np.median(host_s)) * 1e3 if host_s else None
    record["host_ms_per_step"] = host_ms
    if main:
        (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    summary = {
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "final_eval_loss": eval_loss,
        "tokens_per_sec": float(np.median(rates)) if rates else None,
        "host_ms_per_step": host_ms,
        "wall_s": time.perf_counter() - t_start,
        "last_step": step,
        "interrupted": interrupted,
        "finished": step == t.steps,
        "out_dir": str(out),
    }
    if interrupted is None and history and step == t.steps:
        log(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
            f"eval_loss {eval_loss:.4f}, median {summary['tokens_per_sec'] or 0:,.0f} tok/s, "
            + (f"host {host_ms:.2f} ms/step outside the step call, " if host_ms else "")
            + f"{summary['wall_s']:.0f}s; wrote {out}")
    return summary | {"params": params, "history": history}


def _stop(loop: dict, t, out: Path, save, ckpt) -> None:
    """train.max_skipped_steps in a row: save the state of the step that
    reached it (the steps dispatched after it changed nothing) and stop."""
    at = loop["stop_at"]
    save(at, loop)
    ckpt.wait()
    raise TrainingStopped(
        f"stopping at step {at}: {t.max_skipped_steps} steps in a row had a non-finite or "
        f"spiking loss/gradient (train.max_skipped_steps={t.max_skipped_steps}); the last "
        f"good state is checkpointed in {out}/checkpoints as step {at}")


def _restore(cfg, mesh, ckpt, out, data_path, data, log):
    """(train state, step, meta) of the latest usable checkpoint, after checking
    that it belongs to this run (seed, batch size and data fix the data order)."""
    t, p = cfg.train, cfg.parallel
    target = abstract_train_state(cfg, mesh)
    start, params, opt_state, meta = ckpt.restore(target.params, target.opt_state,
                                                  model=dataclasses.asdict(cfg.model))
    data_id = _data_id(data_path, data)
    for key, now in (("seed", t.seed), ("batch_size", t.batch_size), ("data", data_id)):
        if meta.get(key) != now:
            raise ValueError(f"--resume: the checkpoint was trained with {key}="
                             f"{meta.get(key)!r}, this run has {now!r}; the data order "
                             "depends on it")
    if "loop" not in meta:
        raise CheckpointError(f"{out}/checkpoints step {start} was written by an older jaxtp "
                              "(no loop state in its meta); resume it with that version")
    changed = {k: (meta["schedule"][k], v) for k, v in _schedule(t).items()
               if meta.get("schedule", {}).get(k, v) != v}
    if changed:
        log(f"warning: --resume with a different schedule: {changed} (saved, now)")
    log(f"resumed from {out}/checkpoints step {start} (saved at dp={meta['dp']} x "
        f"tp={meta['tp']}; now dp={p.dp} x tp={p.tp})")
    return dataclasses.replace(target, params=params, opt_state=opt_state), start, meta


def _row(step: int, metrics: dict, loop: dict, speed_fields: dict) -> dict:
    """A metrics.jsonl row from the step's metrics and the loop's row totals."""
    return {"step": step,
            "loss": loop["row_loss"] / loop["row_applied"] if loop["row_applied"] else None,
            "grad_norm": finite(metrics["grad_norm"]), "lr": float(metrics["lr"]),
            "skipped": loop["row_skipped"], **speed_fields}


def _progress(row: dict, steps: int, dt: float | None, eval_loss: float | None) -> str:
    return (f"step {row['step']:>5}/{steps} | loss "
            + (f"{row['loss']:.4f}" if row["loss"] is not None else "-")
            + " | grad_norm " + (f"{row['grad_norm']:.3f}" if row["grad_norm"] is not None
                                 else "nan")
            + f" | lr {row['lr']:.2e} | "
            + (f"{row['tokens_per_sec']:,.0f} tok/s, {dt * 1e3:.0f} ms/step"
               if dt else "first step")
            + (f", MFU {row['mfu']:.1%}" if row["mfu"] else "")
            + (f" | {row['skipped']} skipped" if row["skipped"] else "")
            + (f" | eval_loss {eval_loss:.4f}" if eval_loss is not None else ""))


def _data_id(path: str | None, data: Dataset) -> str:
    return f"{path or 'builtin'} ({len(data.train) + len(data.val)} tokens)"


def _schedule(t) -> dict:
    return {k: getattr(t, k) for k in ("steps", "lr", "warmup_steps", "min_lr_ratio")}
