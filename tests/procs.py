"""The environment of the processes tests start (train.py, multi-process workers)."""

import os


def child_env(drop=()) -> dict[str, str]:
    """This environment on CPU, with conftest's compile settings and cache, but
    without the suite's fake device count (the child sets its own) or `drop`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES" and k not in drop}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    return env
