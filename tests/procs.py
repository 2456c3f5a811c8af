"""The environment of the processes tests start (train.py, multi-process workers)."""

import json
import os
import subprocess
import sys
from pathlib import Path


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
