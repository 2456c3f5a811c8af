"""Collective microbenchmark over the tp axis, and collective time read from a profile.

In the spirit of nccl-tests: each collective runs `reps` times back to back
inside one jitted `jax.shard_map` (a loop, so launch overhead is amortised as
nccl-tests amortises its iterations), timed `samples` times. Payloads are
activation-sized, `b*s*h` elements, the buffer Megatron's all-reduces carry.

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md in
github.com/NVIDIA/nccl-tests): `size` is the full buffer (all-reduce: each
rank's input = output; all-gather: the gathered output; reduce-scatter: each
rank's input before scattering), algbw = size / time, and the bus bandwidth
normalises by the bytes a ring really moves per rank, so it is comparable
across rank counts and with the hardware link bandwidth:

    all-reduce:                    busbw = algbw * 2(n-1)/n
    all-gather, reduce-scatter:    busbw = algbw * (n-1)/n
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from .. import hlo
from ..config import load_config
from ..parallel import Layout, f, f_sp, g, g_sp, spec
from .report import section

OPS = ("all-reduce", "reduce-scatter", "all-gather")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for a collective over n ranks."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; known: {OPS}")


def bandwidths(op: str, size_bytes: float, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for `size_bytes` (nccl-tests' size) moved in `seconds`."""
    algbw = size_bytes / seconds
    return algbw, algbw * bus_factor(op, n)


def summary(samples) -> dict:
    """mean, median and 95th percentile of a list of seconds."""
    a = np.asarray(samples, np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p95": float(np.percentile(a, 95)), "n": int(a.size)}


def _looped(op: str, reps: int):
    """Per-shard body: `reps` dependent collectives over tp on a 1-D buffer
    (as a [1, E] row: the SP collectives act on dim 1)."""

    def one(_, x):
        if op == "all-reduce":  # f after g: the loop carry must stay varying
            return f(g(x))
        if op == "reduce-scatter":  # [E] -> [E/n], written back so the next one depends on it
            y = g_sp(x[None])[0]
            return lax.dynamic_update_slice(x, y, (0,))
        y = f_sp(x[None])[0]  # [E/n] -> [E]
        return y[: x.shape[0]]

    return lambda x: lax.fori_loop(0, reps, one, x)


def time_collective(op: str, n: int, elements: int, dtype, samples: int = 10,
                    reps: int | None = None) -> dict:
    """Time one collective of a full buffer of `elements` over n devices.

    The mesh is (dp=1, tp=n) and the shard_map manual over all of it: XLA's
    CPU compiler aborts on a bf16 psum in a shard_map manual over only some
    axes.
    """
    dtype = jnp.dtype(dtype)
    if elements % n:
        raise ValueError(f"{elements} elements do not split over {n} ranks")
    size = elements * dtype.itemsize
    reps = reps or int(min(50, max(1, math.ceil(32 * 2**20 / size))))
    mesh = Layout.make(tp=n, impl="explicit").mesh()
    split = spec("vocab")  # a 1-D buffer split over tp, as the vocabulary is
    local = elements // n if op == "all-gather" else elements  # per rank input
    fn = jax.jit(jax.shard_map(_looped(op, reps), mesh=mesh, in_specs=split,
                               out_specs=split), donate_argnums=0)
    x = jnp.zeros((n * local,), dtype, device=NamedSharding(mesh, split))
    compiled = fn.lower(x).compile()
    wire = sorted({c.dtype for c in hlo.collectives(compiled.as_text())})
    x = compiled(x).block_until_ready()  # warm-up
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        x = compiled(x).block_until_ready()
        times.append((time.perf_counter() - t0) / reps)
    s = summary(times)
    algbw, busbw = bandwidths(op, size, s["median"], n)
    return {"op": op, "dtype": dtype.name, "ranks": n, "elements": elements, "bytes": size,
            "wire_dtype": "/".join(wire), "reps": reps, "samples": samples,
            "mean_us": s["mean"] * 1e6, "median_us": s["median"] * 1e6,
            "p95_us": s["p95"] * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9}


# --- share of a step's time spent in collectives, from a jax.profiler trace ---

_KIND = "|".join(hlo.KINDS)
_COLLECTIVE_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%%?([\w.\-]+)\s*=.*?\s(?:%s)(?:-start|-done)?\("
                               % _KIND, re.M)
_COLLECTIVE_NAME = re.compile(r"^(?:%s)(?:-start|-done)?(?:\.\d+)?$" % _KIND)


def collective_names(hlo_text: str) -> set[str]:
    """Names of the collective instructions in compiled HLO text. A trace
    names ops by instruction, and JAX names those after its primitives (a
    shard_map psum is `psum_invariant.3`), so the opcode must come from here."""
    return set(_COLLECTIVE_INSTR.findall(hlo_text))


def trace(run_step, steps: int):
    """The `jax.profiler` trace (ProfileData) of `steps` calls of `run_step()`,
    or None where the profiler wrote nothing."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(steps):
                run_step()
        finally:
            jax.profiler.stop_trace()
        files = sorted(Path(d).rglob("*.xplane.pb"))
        return jax.profiler.ProfileData.from_file(str(files[-1])) if files else None


def op_events(data):
    """(plane, line, event, stats) of every executed XLA op in a trace: the
    events carrying `hlo_op` (and `hlo_module`; on CPU `device_ordinal`)."""
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                st = dict(e.stats)
                if "hlo_op" in st:
                    yield plane, line, e, st


def collective_share(run_step, hlo_text: str | None = None, steps: int = 2) -> dict:
    """Trace `steps` calls of `run_step()` and split the time of XLA's ops.

    Reads the XSpace with `jax.profiler.ProfileData`: every executed HLO op
    is an event carrying `hlo_op` (and, on CPU, `device_ordinal`/`run_id`);
    an op is a collective if `hlo_text` (the compiled step) says so, else if
    its name starts with a collective's opcode.
    Per device and step of the longest-running module (the step), the span is
    first op start to last op end;
    collective time is the sum of the collective ops' durations. Returns the
    mean share, or share None with the reason when the trace has no such events.
    """
    names = collective_names(hlo_text) if hlo_text else None
    data = trace(run_step, steps)
    if data is None:
        return {"share": None, "reason": "the profiler wrote no .xplane.pb"}
    spans = defaultdict(lambda: [math.inf, -math.inf, 0.0])  # start, end, collective ns
    for plane, line, e, st in op_events(data):
        key = (st.get("hlo_module"), plane.name, st.get("device_ordinal", line.name),
               st.get("run_id"))
        span = spans[key]
        span[0], span[1] = min(span[0], e.start_ns), max(span[1], e.end_ns)
        op = str(st["hlo_op"])
        if op in names if names else _COLLECTIVE_NAME.match(op):
            span[2] += e.duration_ns
    if not spans:
        return {"share": None, "reason": "no events with an hlo_op in the trace "
                "(this platform's profiler does not record XLA ops)"}
    # an accelerator's trace has its kernels on /device:* planes (and launches on the
    # host's): keep the device side where there is one
    if any(plane.startswith("/device:") for _, plane, *_ in spans):
        spans = {k: v for k, v in spans.items() if k[1].startswith("/device:")}
    # the step is the module that ran longest (small jits may run in the window too)
    busy = defaultdict(float)
    for (module, *_), (start, end, _) in spans.items():
        busy[module] += end - start
    step = max(busy, key=busy.get)
    spans = {k: v for k, v in spans.items() if k[0] == step and v[1] > v[0]}
    shares = [c / (end - start) for start, end, c in spans.values()]
    return {"share": float(np.mean(shares)), "share_min": float(np.min(shares)),
            "share_max": float(np.max(shares)), "traces": len(shares),
            "step_ms": float(np.mean([(e - s) / 1e6 for s, e, _ in spans.values()])),
            "collective_ms": float(np.mean([c / 1e6 for *_, c in spans.values()])),
            "module": step, "reason": None}


def bench_collectives(plan: dict, log=print) -> dict:
    """The suite's `collectives` section: each op and dtype at each payload of the plan."""
    rows, n = [], min(8, jax.device_count())
    cases = [(name, dtype, op) for name in plan["payloads"] for dtype in ("float32", "bfloat16")
             for op in OPS]
    for i, (name, dtype, op) in enumerate(cases, 1):
        log(f"collectives {i}/{len(cases)}: {op} {dtype}, {name} b*s*h")
        cfg = load_config(name)
        elements = cfg.train.batch_size * cfg.model.seq_len * cfg.model.d_model
        r = time_collective(op, n, elements, dtype, samples=plan["samples"])
        rows.append({"payload": f"{name} b*s*h", **r, "MiB": r["bytes"] / 2**20})
    cols = [("payload", "payload"), ("op", "op"), ("dtype", "dtype"), ("wire_dtype", "HLO dtype"),
            ("ranks", "ranks"), ("MiB", "size MiB"), ("mean_us", "mean us"),
            ("median_us", "median us"), ("p95_us", "p95 us"),
            ("algbw_GBps", "algbw GB/s"), ("busbw_GBps", "busbw GB/s"), ("reps", "reps")]
    notes = ["each sample: `reps` back-to-back collectives in one jitted shard_map loop, "
             "divided; bandwidths from the median; size and busbw as nccl-tests define them "
             "(all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n)",
             "HLO dtype: what the compiled collective carries (XLA's CPU backend converts bf16 "
             "to f32 around every collective, all-gather included, so bf16 is slower there)"]
    return section("collectives", f"Collectives over the tp axis ({n} ranks)", cols, rows, notes)
