"""The training loop: data onto the mesh, jitted steps, faults, checkpoints, logs.

Every run writes into its output directory (a new run refuses a directory
that already holds one; `resume=True` continues the run in it, or starts it):
- `config.json`, `launch.json`, `resumes.jsonl`: the run's config as it
  started, its data and HF paths, each resume's changes; `writer.lock`,
  held while the run is written: a second writer is refused
  (`jaxtp.train.rundir`);
- `metrics.jsonl`: one JSON object per logged step (step 1, then every
  `log_every`): `step`, `loss` (mean train loss of the applied steps since the
  previous row), `grad_norm` (pre-clip, this step), `lr` (this step's),
  `skipped` (steps skipped since the previous row), `step_time_s`,
  `tokens_per_sec`, `model_tflops_per_device` and `mfu` (null for step 1,
  which includes compilation; mfu null where the peak is unknown), and
  `eval_loss` on evaluation steps;
- `run.json`: the TP record (`jaxtp.train.record.run_record`);
- `checkpoints/<step>/`: orbax checkpoints (`jaxtp.train.checkpoint`) every
  `train.checkpoint_every` steps and `train.checkpoint_minutes`, at the end,
  at `until`, and on SIGTERM/SIGINT. A save that fails (a full disk) stops
  the run with `SaveFailed`; the checkpoints before it stay.

The device stays busy: the step's key, lr, spike limit and skip counts are
computed inside the jitted step (`jaxtp.train.loopstep`), and the host reads
anything back only on logged rows, evaluations and checkpoints, so it
dispatches step n+1 while step n runs (README, "A busy device"). The median
host time per step outside the step call is kept in run.json.

Faults: a step whose loss or gradient norm is not finite (or, with
`train.spike_factor`, whose loss exceeds that factor times the mean of the
last 20 applied losses) leaves parameters and optimizer state unchanged and
is logged at the next row with its step; `train.max_skipped_steps` of them
in a row stop the run with `TrainingStopped`, saving the last good state
(later steps the host had already dispatched change nothing).

Multi-process: every process runs this loop over the same global batches
(each transfers only its own rows); process 0 alone logs and writes files;
all take part in checkpoints and agree on a stop signal at rows and
checkpoints (one host allgather there, none per step).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from ..config import Config
from ..model.build import abstract_model
from ..parallel import Schedule, batch_shape, batch_sharding, wide
from ..parallel.distributed import any_process
from .checkpoint import Checkpointer, SaveFailed, nbytes
from .data import to_mesh
from .evaluation import evaluate, router_row
from .loopstep import LoopState, is_row_step, make_loop_step
from ..hardware import model_flops_per_token, peak_flops
from .metrics import MetricsLog, losses_said, metrics_row, progress_line, skip_line, speed
from .optim import lr_schedule
from .options import Notice, RunOptions
from .record import run_record
from .rundir import RunDir, write_atomic
from .runstate import RunState
from .sampler import LoopSampler
from .start import (Signals, check_memory, check_options, claim, config_warnings,
                    count_params, describe, idle_summary, load_data, process0,
                    restore_or_init)
from .state import decide
from .step import ReplayCheck, make_eval_step, make_router_stats


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps in a row)."""


def train(cfg: Config, out_dir: str | Path, opts: RunOptions = RunOptions()) -> dict:
    """Train `cfg` and return a summary; see the module docstring for the
    files and `RunOptions` for the options. `cfg` may differ from a resumed
    run's config only where `jaxtp.train.rundir.RESUMABLE` allows; the
    changes are appended to `resumes.jsonl` (with `opts.argv`).

    The run directory is locked for the call (`RunDir.lock`: another live
    writer is refused with `RunInUse`). After a `SaveFailed` whose save died
    at its directory (read-only, no inodes), orbax's threads of that save
    wait out orbax's timeout (~300 s) before the interpreter can exit;
    train.py leaves with `os._exit` instead.
    """
    o = opts
    check_options(o.check, o.resume, o.until, o.inject_nan_at, o.peak_tflops)
    if jax.process_index() != 0:
        o = dataclasses.replace(o, log=lambda _: None)
    data, data_id, tokenizer = load_data(o.data_path, cfg, o.init_from_hf)
    asked = cfg  # as given: the run records "auto", not the kernel this machine picks
    cfg, layout, mesh = decide(cfg)  # a KernelError before writing
    check_memory(cfg, mesh)  # a model this machine cannot hold: before allocating any of it
    out = Path(out_dir)
    rerun = o.resume and RunDir(out).has_run()
    changes, lock = claim(RunDir(out), o.resume, o.tensorboard, asked, o.data_path,
                          o.init_from_hf, tokenizer, o.log)
    try:
        ckpt = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints, log=o.log,
                            layer_order=Schedule.of(cfg, layout).layer_order())
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        return _run(cfg, mesh, out, ckpt, RunState.of(cfg, data_id), data, changes, rerun, o)
    finally:
        ckpt.close()
        if lock is not None:
            lock.release()


def _run(cfg, mesh, out: Path, ckpt, run: RunState, data, changes: dict, rerun: bool,
         o: RunOptions) -> dict:
    """The run from its restored (or new) state to `o.until` or the end."""
    state, run = restore_or_init(run, ckpt, cfg, mesh, o.init_params, rerun, o.log)
    last = min(cfg.train.steps, o.until or cfg.train.steps)
    if last <= run.step:
        o.log(f"the run in {out} is already at step {run.step}"
              + (f" (--until {o.until})" if o.until and o.until < cfg.train.steps else
                 f" of {cfg.train.steps}: finished; raise --steps to train further")
              + ": nothing to do")
        return idle_summary(run.step, cfg, out, state.params)
    # a disk too small for one checkpoint: refused now, not at the first save
    ckpt.check_space(nbytes(jax.tree.leaves((state.params, state.opt_state))), "start the run")
    # a resume's changes become the run's once a step ran with them (not
    # when the resume dies in compile, e.g. out of memory at another tp)
    started = functools.partial(process0, lambda: RunDir(out).resumed(
        changes, run.step, list(o.argv)), "record the resume in resumes.jsonl")
    loop = _Loop(cfg, mesh, out, ckpt, run, state, data, o, started)
    loop.run(last)
    return loop.summary()


class _Loop:
    """One run's loop: the compiled step, the arrays it carries from step to
    step, and the host's bookkeeping (rows, rates, host time, saves)."""

    def __init__(self, cfg, mesh, out, ckpt, run, state, data, o: RunOptions, started):
        m, t, log = cfg.model, cfg.train, o.log
        self.cfg, self.mesh, self.out, self.ckpt, self.run_state, self.log = (
            cfg, mesh, out, ckpt, run, log)
        self.until, self.started = o.until, started
        # before compiling: a damaged log is repaired or refused first
        self.metrics_log = process0(
            lambda: MetricsLog(out, run.step, o.tensorboard, log, saved_row=run.row),
            "open metrics.jsonl")
        self.n_params = count_params(state.params)
        for line in describe(cfg, self.n_params, data) + config_warnings(cfg, o.warn_warmup):
            log(line)
        self.loop = LoopState.start(t.seed, mesh, run.loop, wide(m.dtype))
        self.step_fn, self.record = self._compile(state, o.inject_nan_at)
        self.eval_step = make_eval_step(state)
        self.router_stats = make_router_stats(state) if m.n_experts else None
        self.eval_set = data.eval_batches(t.batch_size, t.eval_batches)
        self.batches = data.train_batches(t.batch_size, t.seed, skip=run.step)
        peak = o.peak_tflops * 1e12 if o.peak_tflops else peak_flops(mesh.devices.flat[0])
        self.speed = functools.partial(speed, tokens_per_step=t.batch_size * m.seq_len,
                                       flops_per_token=model_flops_per_token(cfg, self.n_params),
                                       devices=mesh.size, peak=peak)
        self.params, self.opt_state = state.params, state.opt_state
        self.check = (ReplayCheck(cfg, self.params, lr_schedule(t, wide(m.dtype)))
                      if o.check else None)
        self.sampler = LoopSampler(cfg, mesh, list(map(int, self.eval_set[0][0][:16])),
                                   out) if t.sample_every else None
        self.history, self.rates, self.host_s = [], [], []
        self.eval_loss, self.interrupted, self.step, self.saved_step = None, None, run.step, None
        self.t_start = self.t_last = self.t_saved = time.perf_counter()
        self.last_logged = run.step

    def _compile(self, state, inject_nan_at):
        """The loop's step compiled ahead of time, and the run record read from its HLO."""
        cfg, mesh, t0 = self.cfg, self.mesh, time.perf_counter()
        tokens = jax.ShapeDtypeStruct(batch_shape(cfg.train.batch_size, cfg.model.seq_len, mesh), np.int32,
                                      sharding=batch_sharding(mesh))
        with jax.set_mesh(mesh):
            step = make_loop_step(state, cfg, inject_nan_at).lower(
                state.params, state.opt_state, self.loop, tokens).compile()
        self.log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
        # no buffers: step 1 donates them
        structure = nnx.merge(*abstract_model(cfg, mesh, state.layout))
        return step, run_record(cfg, mesh, structure, step.as_text())

    def run(self, last: int) -> None:
        """Steps run_state.step + 1 .. last, stopping early on a signal (saved)."""
        try:
            with jax.set_mesh(self.mesh), Signals() as signals:
                for step in range(self.run_state.step + 1, last + 1):
                    self.step = step
                    stop = self.one_step(step, signals)
                    if step == self.run_state.step + 1:
                        self.started()
                    if stop:
                        break
                self.ckpt.finish()
        except SaveFailed as e:
            raise SaveFailed(f"{e}; the run stopped after step {self.step}: fix the cause "
                             f"(e.g. free space) and continue with --resume --out "
                             f"{self.out}") from None
        finally:
            if self.metrics_log is not None:
                self.metrics_log.close()

    def one_step(self, step: int, signals: "Signals") -> bool:
        """Run `step`; log, evaluate, check and save where due. True: stop here."""
        t = self.cfg.train
        t_iter = time.perf_counter()
        host_tokens = next(self.batches)
        tokens = to_mesh(host_tokens, self.mesh, self.cfg.parallel.cp_balance)
        t_call = time.perf_counter()
        self.params, self.opt_state, self.loop, metrics = self.step_fn(
            self.params, self.opt_state, self.loop, tokens)
        t_back = time.perf_counter()
        row_step = bool(is_row_step(step, t))
        ckpt_step = (t.checkpoint_every and step % t.checkpoint_every == 0) \
            or step == t.steps or step == self.until or (row_step and self._save_due())
        if self.check is not None:
            self.check.after(step, np.asarray(host_tokens), metrics, self.params, self.record,
                             self.log)
        # the host waits for the device only on rows and checkpoints
        loop = self.loop.to_json() if row_step or ckpt_step else None
        if row_step and loop["row_skipped"]:
            self.log(skip_line(loop, t.max_skipped_steps))
        if loop and loop["stop_at"]:
            self._stop_skipping(loop)
        if row_step:
            self.log_row(step, metrics, loop)
        if ckpt_step:
            self.save(step, loop)
        self._check_saves(row_step or ckpt_step)
        if self._signalled(signals, row_step or ckpt_step):
            self.interrupted = signal.Signals(signals.received or signal.SIGTERM).name
            self.save(step, self.loop.to_json())
            self.ckpt.finish()
            self.log(Notice(f"{self.interrupted} received: saved a checkpoint at step {step} "
                            f"in {self.out}/checkpoints; continue with --resume --out "
                            f"{self.out}"))
            return True
        if not (row_step or ckpt_step or self.check):
            self.host_s.append((t_call - t_iter) + (time.perf_counter() - t_back))
        return False

    def log_row(self, step: int, metrics, loop: dict) -> None:
        """A metrics.jsonl row (and an evaluation when due), and the progress line."""
        t = self.cfg.train
        host = jax.device_get(metrics)
        is_eval = step % t.eval_every == 0 or step == t.steps
        timed = step > 1 and step - 1 != self.run_state.step  # not the first step run
        dt = (time.perf_counter() - self.t_last) / (step - self.last_logged) if timed else None
        row = metrics_row(step, host, loop, self.speed(dt))
        if is_eval:
            self.eval_loss = row["eval_loss"] = evaluate(self.eval_step, self.params,
                                                         self.eval_set, self.mesh,
                                                         self.cfg.parallel.cp_balance)
        if self.router_stats is not None:  # (every row, on the evaluation batches)
            row.update(router_row(self.router_stats, self.params, self.eval_set, self.mesh,
                                  self.cfg.parallel.cp_balance, self.cfg.model.n_moe_layers))
        if self.metrics_log is not None:
            self.metrics_log.write(row)
        self.history.append(row)
        if row["tokens_per_sec"]:
            self.rates.append(row["tokens_per_sec"])
        self.log(progress_line(row, t.steps, dt, self.eval_loss if is_eval else None,
                               time.perf_counter() - self.t_start,
                               (self.until or t.steps) - step))
        if self.sampler is not None and step % t.sample_every == 0:
            self.log(f"sample at step {step}: {self.sampler(self.params)!r}")
        self.last_logged = step
        self.t_last = time.perf_counter()  # eval time is not counted in tok/s

    def save(self, step: int, loop: dict) -> None:
        if self.saved_step == step:
            return  # e.g. a signal during the last step, already saved
        self.saved_step, self.t_saved = step, time.perf_counter()
        row = self.history[-1] if self.history and self.history[-1]["step"] == step else None
        self.run_state.save(self.ckpt, step, loop, self.params, self.opt_state, row)

    def _save_due(self) -> bool:
        """train.checkpoint_minutes since the last save (checked at rows; the
        processes save together when any one's clock says so)."""
        minutes = self.cfg.train.checkpoint_minutes
        return any_process(bool(minutes) and time.perf_counter() - self.t_saved >= 60 * minutes)

    def _check_saves(self, synced: bool) -> None:
        """Stop (SaveFailed) once a background save has failed: after this step
        in one process; at the next row or checkpoint with several."""
        if jax.process_count() > 1 and not synced:
            return
        why = self.ckpt.failed_save() or (self.metrics_log and self.metrics_log.error)
        if any_process(why is not None):
            raise SaveFailed(why or "a checkpoint save failed in another process")

    def _signalled(self, signals: "Signals", synced: bool) -> bool:
        """Whether to stop for a signal: processes agree at rows and checkpoints
        (one host allgather there), never between them."""
        if jax.process_count() == 1:
            return signals.received is not None
        return synced and any_process(signals.received is not None)

    def _stop_skipping(self, loop: dict) -> None:
        """train.max_skipped_steps in a row: save the state of the step that
        reached it (the steps dispatched after it changed nothing) and stop."""
        at, limit = loop["stop_at"], self.cfg.train.max_skipped_steps
        self.save(at, loop)
        self.ckpt.finish()
        raise TrainingStopped(
            f"stopping at step {at}: {limit} steps in a row had a non-finite or "
            f"spiking loss/gradient (train.max_skipped_steps={limit}); the last "
            f"good state is checkpointed in {self.out}/checkpoints as step {at}")

    def summary(self) -> dict:
        """Write run.json; the run's summary (and its final parameters and rows)."""
        host_ms = float(np.median(self.host_s)) * 1e3 if self.host_s else None
        self.record["host_ms_per_step"] = host_ms
        if jax.process_index() == 0:
            try:
                write_atomic(self.out / "run.json", json.dumps(self.record, indent=2) + "\n")
            except OSError as e:
                raise SaveFailed(f"cannot write {self.out}/run.json ({e.strerror}); the run "
                                 "itself finished and is checkpointed") from None
        h, steps = self.history, self.cfg.train.steps
        # the first and last rows with an applied step (a row whose steps
        # were all skipped has no loss)
        losses = [r["loss"] for r in h if r["loss"] is not None]
        summary = {
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "final_eval_loss": self.eval_loss,
            "tokens_per_sec": float(np.median(self.rates)) if self.rates else None,
            "host_ms_per_step": host_ms,
            "wall_s": time.perf_counter() - self.t_start,
            "last_step": self.step,
            "interrupted": self.interrupted,
            "finished": self.step == steps,
            "out_dir": str(self.out),
        }
        if self.interrupted is None and h and self.step == steps:
            self.log(f"done: {losses_said(losses, h)}, eval_loss {self.eval_loss:.4f}, median "
                     f"{summary['tokens_per_sec'] or 0:,.0f} tok/s, "
                     + (f"host {host_ms:.2f} ms/step outside the step call, " if host_ms else "")
                     + f"{summary['wall_s']:.0f}s; wrote {self.out}")
        return summary | {"params": self.params, "history": h}
