"""GSPMD's overlap on a machine with 2 or more GPUs:
`python -m jaxtp.bench --gpu-overlap` (bench/gpu.sh runs it where it finds
them). Unverified until run there: this project has not been lent more than
one GPU.

It reads the windowed-einsum iteration cap XLA's GPU compiler logs on this
client (its NVLink domain; 0 in a deviceless compile), compiles the SP train
step with `--overlap collective_matmul` under gspmd, counts the loops XLA
formed per region and pass (`jaxtp.hlo.windowed_loops`), and times that step
against the same step without the overlap, alternately.
"""

from __future__ import annotations

import time

import jax

from .. import hlo
from ..analysis import windowed
from ..config import apply_overrides, load_config, validate
from .gpu import COLUMNS, GPU_PRESET_OVERRIDES, _row
from .report import machine_info, section
from .timing import build, paired_ratio, time_alternating


def overlap_tp(devices: int, n_heads: int) -> int:
    """The largest power of two up to 8 that the devices hold and divides the heads."""
    tp = 1
    while tp * 2 <= min(devices, 8) and n_heads % (tp * 2) == 0:
        tp *= 2
    return tp


def gpu_overlap(preset: str = "llama-1b", steps: int = 20, warmup: int = 3, overrides=(),
                log=print) -> dict:
    """The section: the logged cap, the loops per region and pass, and the
    step time with the overlap over the step without it."""
    t0 = time.perf_counter()
    cap = windowed.logged_cap("local")  # before this process takes the devices
    n = jax.device_count()
    base = load_config(preset)
    tp = overlap_tp(n, base.model.n_heads)
    if tp < 2:
        raise ValueError(f"--gpu-overlap needs 2 or more devices, this machine has {n}")
    cut = [*GPU_PRESET_OVERRIDES.get(preset, ()), *overrides, f"parallel.tp={tp}",
           "parallel.dp=1", "parallel.sp=true", "parallel.impl=gspmd"]
    cfg = {o: validate(apply_overrides(base, [*cut, f"parallel.overlap={o}"]))
           for o in ("none", "collective_matmul")}
    runs = [build(o, c) for o, c in cfg.items()]
    loops = hlo.windowed_loops(runs[1].step.as_text())
    t = time_alternating(runs, warmup, steps)
    ratio, lo, hi = paired_ratio(t, "collective_matmul", "none")
    m = cfg["none"].model
    case = f"{preset} tp={tp} sp gspmd {m.dtype} B={cfg['none'].train.batch_size} T={m.seq_len}"
    rows = [_row(case, "windowed-einsum iteration cap (logged by this client's compile)", cap,
                 "steps", "" if cap is not None else "no log line from a 2-device compile"),
            _row(case, "windowed loops formed", sum(loops.values()), "loops",
                 ", ".join(f"{sc} {ps} {n} {k}" for (k, ps, sc), n in sorted(loops.items()))),
            _row(case, "step time, collective_matmul / none (paired median)", ratio, "ratio",
                 f"rounds {lo:.3f} to {hi:.3f}, {steps} after {warmup} warm-up")]
    sec = section("gpu_overlap", f"GSPMD's overlap on {n} x {jax.devices()[0].device_kind}",
                  COLUMNS, rows, [
                      "unverified until run on a multi-GPU machine: the loops form only at run "
                      "time on a GPU client (a deviceless compile's cap is 0)",
                      "the budget of those loops: python -m jaxtp.bench --only windowed (the "
                      "same dot handler on CPU, past its threshold)"])
    log("\n".join(f"{r['measured']}: {r['value']} {r['unit']} {r['detail']}" for r in rows))
    return {"meta": machine_info("gpu-overlap", time.perf_counter() - t0) | {"preset": preset},
            "sections": [sec]}
