"""The environment of the processes tests start (train.py, multi-process workers),
and what a test reads of a run they made (its metrics, its checkpoint)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def child_env(drop=()) -> dict[str, str]:
    """This environment on CPU, with conftest's compile settings and cache, but
    without the suite's fake device count (the child sets its own) or `drop`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES" and k not in drop}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    return env


ROOT = Path(__file__).resolve().parents[1]
# a model small enough for a few seconds per process; logged every step so
# that every loss is compared
SMALL = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.seq_len=32",
         "train.batch_size=8", "train.warmup_steps=2", "train.log_every=1",
         "train.eval_every=4", "train.eval_batches=1"]


def train_py(*args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a fresh process (from the repository root)."""
    return subprocess.run([sys.executable, "-u", str(ROOT / "train.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env or child_env(), **kw)


def rows(out: Path) -> list[dict]:
    """A run's metrics.jsonl rows."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged(out: Path):
    """Everything logged except timings."""
    return [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "lr",
                                                 "eval_loss", "skipped")} for r in rows(out)]


def final_params(out: Path, step: int, cfg=None) -> dict:
    """The parameters and Adam state of a run's checkpoint, on one device
    (`cfg`: the run's, default tiny's with SMALL)."""
    import dataclasses

    from jax.tree_util import keystr, tree_flatten_with_path

    from jaxtp.train.checkpoint import Checkpointer
    from jaxtp.config import apply_overrides, load_config
    from jaxtp.parallel import make_mesh
    from jaxtp.train.state import abstract_train_state

    cfg = apply_overrides(load_config("tiny"), SMALL) if cfg is None else dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, ep=1, tp=1))
    target = abstract_train_state(cfg, make_mesh(1, 1))
    ckpt = Checkpointer(out / "checkpoints", log=lambda s: None)
    try:
        got, params, opt, _ = ckpt.restore(target.params, target.opt_state,
                                           model=dataclasses.asdict(cfg.model), step=step)
    finally:
        ckpt.close()
    assert got == step
    return {keystr(k): np.asarray(v) for k, v in tree_flatten_with_path((params, opt))[0]}
