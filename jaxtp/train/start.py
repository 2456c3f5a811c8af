"""What happens before a run's first step: its options checked, its directory
claimed (or its config's changes accepted), its state restored or made.

`jaxtp.train.loop.train` calls these in order; each refuses with one clear
error before anything is compiled, and nothing here leaves a directory that
`--resume` cannot continue.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from .. import data as token_files
from ..config import Config
from ..data.tokenizer import hf_eos
from ..parallel import known_bugs, xla_overlap
from ..axes import mesh_words
from ..parallel.distributed import any_process
from ..sizes import check_fits
from .checkpoint import SaveFailed
from .data import Dataset, data_identity, load_tokens
from .metrics import MetricsLog
from .rundir import RunDir, RunLock
from .runstate import RunState
from .options import Notice
from .state import TrainState, init_train_state


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def config_warnings(cfg: Config, warmup: bool = True) -> list[Notice]:
    """What a legal config does that its user may not expect, a line each
    (`warmup`: including a warmup as long as the run)."""
    t = cfg.train
    said = []
    if warmup and t.warmup_steps >= t.steps:
        said.append(f"warning: train.warmup_steps={t.warmup_steps} is not below train.steps="
                    f"{t.steps}: the learning rate only warms up (to {t.lr:.2e} x "
                    f"{min(t.steps, t.warmup_steps)}/{t.warmup_steps} at the last step) and "
                    "never decays; lower train.warmup_steps for a full schedule")
    # a feature asked for that the installed jaxlib is known to break (and
    # the workaround jaxtp applies: `jaxtp.parallel.compiler_options`)
    said += [bug.line() for bug in known_bugs(cfg, jax.default_backend())]
    return [Notice(line) for line in said]


def check_memory(cfg: Config, mesh) -> None:
    """Refuse (ValueError) a run whose weights, gradients and Adam state alone
    outgrow the memory of this process's devices (`jaxtp.sizes.check_fits`):
    on CPU the host's, which its fake devices share; on an accelerator each
    device's allocator limit."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        memory = host_memory()
        where = f"this machine's memory (its {len(local)} CPU devices share it)"
    else:
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
        if not all(limits):
            return  # a platform that does not say: the allocator will
        memory, where = sum(limits), f"the {len(local)} {local[0].device_kind} devices here"
    check_fits(cfg, len(local), memory, where)


def host_memory() -> int:
    """The bytes this process may use: the machine's, or its container's
    limit where a cgroup sets a lower one (v2 memory.max, v1 limit_in_bytes)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit).read().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def check_options(check: bool, resume: bool, until, inject_nan_at, peak_tflops) -> None:
    if until is not None and until < 1:
        raise ValueError(f"--until {until}: the step to stop after must be >= 1")
    if any(s < 1 for s in inject_nan_at):
        raise ValueError(f"--inject-nan-at {sorted(inject_nan_at)}: steps start at 1")
    if peak_tflops is not None and not 0 < peak_tflops < float("inf"):
        raise ValueError(f"--peak-tflops {peak_tflops}: a device's peak must be positive")
    if check and (jax.process_count() > 1 or resume):
        raise ValueError("--check replays the first steps on one device: run it "
                         "single-process and not with --resume")


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create `out_dir`, refusing one that already holds a run, or that cannot
    be a writable directory (with the cause)."""
    out = Path(out_dir)
    taken = [n for n in ("metrics.jsonl", "config.json", "run.json", "checkpoints")
             if (out / n).exists()]
    if taken:
        raise FileExistsError(f"--out {out} already holds a run ({', '.join(taken)}); "
                              "choose a new directory, or --resume to continue it")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".jaxtp-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(f"--out {out}: cannot write a run there ({e.strerror or e})") from None
    return out


def claim(run_dir: RunDir, resume: bool, tensorboard: bool, cfg: Config,
          data_path: str | None, init_from_hf: str | None,
          tokenizer: tuple[Path | None, list[int]],
          log: Callable[[str], None]) -> tuple[dict, RunLock | None]:
    """Take the run directory's writer lock (process 0, for the whole job),
    check that it can take this run, and record a new run there before
    anything else (so that a run killed from here on is resumable). Returns
    the changes a resume makes to the run's config (said in the log) and the
    lock, for the caller to release. A refusal stops every process, not only
    process 0 while the others wait in a barrier."""
    if resume and not run_dir.has_run():
        log(f"--resume: {run_dir.path} holds no run yet: starting it")
    refused, changes, lock = None, {}, None
    try:
        if tensorboard and jax.process_index() == 0:
            MetricsLog.check_tensorboard()
        if jax.process_index() == 0:
            if resume and run_dir.has_run():
                lock = _lock(run_dir, existing=True)
                changes = run_dir.changes(cfg)  # or a ConfigError naming the key
            else:
                prepare_out_dir(run_dir.path)  # its refusals first, with their reasons
                lock = _lock(run_dir, existing=False)
                prepare_out_dir(run_dir.path)  # again: a run may have started meanwhile
                run_dir.start(cfg, data_path, init_from_hf, *tokenizer)
    except (OSError, ImportError, ValueError, SaveFailed) as e:
        refused = e
        if lock is not None:
            lock.release()
    if any_process(refused is not None):
        raise refused or FileExistsError(f"process 0 refused --out {run_dir.path}: see its log")
    if changes:
        log("--resume with changes: " + ", ".join(f"{k} {a!r} -> {b!r}"
                                                 for k, (a, b) in changes.items()))
    if "train.steps" in changes:
        log(Notice(f"warning: the lr schedule now spans {cfg.train.steps} steps: the steps "
                   "left run at other learning rates than the run first planned"))
    return changes, lock


def _lock(run_dir: RunDir, existing: bool) -> RunLock:
    """The writer lock; a directory it cannot be written in is, for a run
    that exists, a file system fault (SaveFailed: nothing of the run was
    changed), and for a new one a bad --out."""
    try:
        return run_dir.lock()
    except OSError as e:
        if existing:
            raise SaveFailed(f"cannot write in the run directory {run_dir.path} "
                             f"({e.strerror or e}): nothing of the run was changed and its "
                             "checkpoints are intact; make it writable and --resume "
                             "again") from None
        raise OSError(f"--out {run_dir.path}: cannot write a run there "
                      f"({e.strerror or e})") from None


def load_data(data_path: str | None, cfg: Config, init_from_hf: str | None):
    """(Dataset, the data's identity for RunState, (tokenizer.json, EOS ids)):
    the tokens read (a token file memory-mapped) and checked (`check_data`)."""
    tokens = load_tokens(data_path)
    header = token_files.read_header(data_path) if data_path and \
        token_files.is_token_file(data_path) else {}
    data = Dataset(tokens, cfg.model.seq_len, cfg.model.vocab_size,
                   max_id=header.get("max_id"), vocab_of=init_from_hf)
    tokenizer = check_data(data_path, data, cfg, init_from_hf)
    # the evaluation batches are read (and their ids checked) before the run
    # directory is claimed: a file whose header understates its ids is
    # refused there, not after writing a run that cannot go on
    data.eval_batches(cfg.train.batch_size, cfg.train.eval_batches)
    return data, data_identity(tokens, data_path and os.path.abspath(data_path)), tokenizer


def check_data(data_path: str | None, data: Dataset, cfg: Config,
               init_from_hf: str | None) -> tuple[Path | None, list[int]]:
    """Refuse data this model cannot train on: a tokenizer whose vocabulary
    exceeds the model's, one that is not the HF checkpoint's, or a train split
    shorter than one batch. Returns the tokenizer.json the run should keep
    (for generate.py), if there is one, and its end-of-text id(s)."""
    m, t = cfg.model, cfg.train
    if len(data.train) < t.batch_size * (m.seq_len + 1):
        raise ValueError(f"the data's train split has {len(data.train):,} tokens, fewer than "
                         f"one batch (train.batch_size * (model.seq_len + 1) = "
                         f"{t.batch_size * (m.seq_len + 1):,}): use more data")
    hf_tok = Path(init_from_hf) / "tokenizer.json" if init_from_hf else None
    hf_tok = hf_tok if hf_tok is not None and hf_tok.is_file() else None
    eos = hf_eos(hf_tok.parent) if hf_tok is not None else []
    if not (data_path and token_files.is_token_file(data_path)):
        return hf_tok, eos
    info = token_files.read_header(data_path)
    if info["vocab_size"] > m.vocab_size:
        raise ValueError(f"--data {data_path} was tokenized with a {info['vocab_size']:,}-id "
                         f"vocabulary ({info['tokenizer']}), larger than model.vocab_size="
                         f"{m.vocab_size:,}: use the model's tokenizer, or raise the vocabulary")
    if hf_tok is not None and hashlib.sha256(hf_tok.read_bytes()).hexdigest() != \
            info["tokenizer_sha256"]:
        raise ValueError(f"--data {data_path} was tokenized with another tokenizer than "
                         f"{hf_tok}: prepare it with --tokenizer {init_from_hf}")
    sidecar = Path(f"{data_path}.tokenizer.json")
    return (sidecar if sidecar.is_file() else hf_tok), [info["eos_id"]]


def process0(fn: Callable, what: str):
    """fn() in process 0 (None in the others); a failure there (OSError,
    ValueError) raises in every process, so none is left waiting in a
    collective for process 0."""
    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except (OSError, ValueError) as e:
            error = e
    if any_process(error is not None):
        raise error or RuntimeError(f"process 0 could not {what}: see its log")
    return result


def restore_or_init(run: RunState, ckpt, cfg: Config, mesh, init_params, rerun: bool,
                    log: Callable[[str], None]) -> tuple[TrainState, RunState]:
    """The state a run starts from: its latest usable checkpoint when `rerun`
    (a resume of a run that was started before) finds any, else a fresh
    initialisation (or `init_params`: values, or a function that reads them,
    called only when nothing is restored)."""
    if rerun and ckpt.steps():
        return run.resume(ckpt, cfg, mesh, log)
    if rerun:
        log(f"--resume: {ckpt.directory.parent} holds no complete checkpoint yet (stopped "
            "before its first save): starting the run from step 0 with its config")
    params = init_params() if callable(init_params) else init_params
    return init_train_state(cfg, mesh, params=params), run


def describe(cfg: Config, n_params: int, data: Dataset) -> list[str]:
    """The lines a run starts with: the model and mesh, the kernels, and (a
    mixture of experts) the experts."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    return [
        f"model: {m.style}, {n_params:,} params, {m.n_layers} layers"
        f"{' (scanned)' if m.scan_layers else ''}, d_model={m.d_model}, heads={m.n_heads}/"
        f"{m.kv_heads} kv, d_ff={m.d_ff}, seq={m.seq_len}, {m.dtype} compute / "
        f"{m.param_dtype} params | mesh {mesh_words(p.degrees, cfg)}, impl={p.impl}"
        f"{', fsdp' if p.fsdp else ''}{', sp' if p.sequence_parallel else ''} | batch "
        f"{t.batch_size}{f' in {t.microbatches} microbatches' if t.microbatches > 1 else ''}"
        f" | data: {len(data.train):,} train / {len(data.val):,} val tokens",
        f"attention: {m.attention}"
        + (f" (block {m.attention_block})" if m.attention == "blockwise" else "")
        + f", remat: {m.remat}"
        + (f", loss in chunks of {m.loss_chunk} tokens" if m.loss_chunk else "")
        + _overlap(cfg)] + ([
        f"experts: {m.n_experts} per MoE layer (top-{m.moe_top_k}, d_ff "
        f"{m.moe_d_ff or m.d_ff}), "
        + (f"capacity factor {m.capacity_factor}" if m.capacity_factor else "dropless")
        + f", {m.n_experts // p.ep} per ep rank"
        + (f", a shared expert of d_ff {m.moe_shared_d_ff}" if m.moe_shared_d_ff else "")]
        if m.n_experts else [])


def _overlap(cfg: Config) -> str:
    """How SP's collectives meet their matmuls in this run (`parallel.overlap`)."""
    p = cfg.parallel
    if p.overlap == "none" or not p.sequence_parallel:
        return ""
    if p.impl == "shard_map":
        return ", overlap: collective-matmul rings of ppermutes"
    forms = xla_overlap.forms(cfg, jax.default_backend())
    if forms.all_gather or forms.reduce_scatter:
        return f", overlap: XLA's windowed einsum, loops: {forms.why}"
    return f", overlap: XLA's windowed einsum asked for, no loop here: {forms.why}"


class Signals:
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


def idle_summary(step: int, cfg: Config, out: Path, params) -> dict:
    """The summary of a call that had no step to run."""
    return {"first_loss": None, "final_loss": None, "final_eval_loss": None,
            "tokens_per_sec": None, "host_ms_per_step": None, "wall_s": 0.0,
            "last_step": step, "interrupted": None, "finished": step >= cfg.train.steps,
            "out_dir": str(out), "params": params, "history": []}
