"""The `windowed` section of the benchmark suite: GSPMD's overlap proven
without a GPU. XLA's CPU compiler runs the same SPMD dot handler as a GPU's,
with a fixed threshold of 100000 MiB; a compile-only step past it (abstract
arrays: nothing is allocated) shows which windowed-einsum loops the
partitioner forms for each region, held to the overlapped budget
(`jaxtp.analysis.windowed.prove`)."""

from __future__ import annotations

import jax

from ..analysis import windowed
from ..train.step import compiled_step
from ..parallel import make_mesh, mesh_for
from .report import section


def bench_windowed(plan: dict, log=print) -> dict:
    """Each (model, impl, remat) of the plan compiled past the CPU threshold
    at tp=8 with SP and the overlap: its loops per pass against the budget's."""
    devices = jax.devices("cpu")
    rows, notes = [], []
    if len(devices) < 8:
        notes.append(f"skipped: the proof compiles for 8 CPU devices, this process has "
                     f"{len(devices)}")
    cases = plan["windowed_cases"] if len(devices) >= 8 else ()
    for i, (model, impl, remat) in enumerate(cases, 1):
        log(f"windowed {i}/{len(cases)}: {model} {impl} remat={remat}, compile-only")
        cfg = windowed.proof_config(model, impl, remat)
        r = windowed.prove(cfg, mesh_for(make_mesh(1, 8, devices=devices[:8]), impl),
                           log=lambda _: None, compile_step=compiled_step)
        count = lambda kind, pass_: sum(n for k, n in r["loops"].items()
                                        if k.startswith(f"{kind} {pass_}"))
        want = lambda kind, pass_: sum(n for k, n in r["loops_budgeted"].items()
                                       if k.startswith(f"{kind} {pass_}"))
        rows.append({
            "case": f"{model} {impl} remat={remat}", "measured": "windowed loops, compile-only",
            "value": sum(r["loops"].values()), "unit": "loops",
            **{k + p: f"{count(kind, pass_)}/{want(kind, pass_)}"
               for kind, k in (("all-gather", "ag"), ("reduce-scatter", "rs"))
               for pass_, p in (("forward", "f"), ("backward", "b"))},
            "chunk": max(r["loop_elements_over_activation"].values(), default=0),
            "outside": len(r["activation_sized_outside_loops"]),
            "budget": r["budget"], "compile_s": r["compile_s"], "ok": r["ok"]})
    cap = windowed.logged_cap("cpu")
    notes += [
        "2 blocks, bf16, batch 8 x 2^20 tokens of d_model 8192 (128 GiB per activation, "
        "global), 64 heads, tp=8 with SP and --overlap collective_matmul, a one-chunk loss: "
        f"past XLA's CPU threshold of 100,000 MiB; the CPU compile logged an iteration cap "
        f"of {cap}",
        "agf/agb, rsf/rsb: all-gather / reduce-scatter loops forward / backward, found/"
        "budgeted; per block each entry's all-gather and exit's reduce-scatter forward; "
        "backward dX's reduce-scatter and x gathered again for dW; the LM head likewise",
        "chunk: one loop's permuted elements / the [b, s, h] activation (tp chunks of s/tp "
        "each: tp/(tp-1) of the ring bytes of the collective it replaces)",
        "outside: activation-sized collectives left outside loops (the output gradient's "
        "gather, read by two dots; the embedding lookup's sum and its gradient)",
        "a deviceless GPU compile sets the cap to 0 (no loop forms); on a GPU client the cap "
        "is its NVLink domain: bench/gpu.sh's overlap section, given 2 or more GPUs"]
    return section("windowed", "XLA's windowed einsum past the CPU threshold (compile-only)",
                   [("case", "case"), ("value", "loops"), ("agf", "agf"), ("agb", "agb"),
                    ("rsf", "rsf"), ("rsb", "rsb"), ("chunk", "chunk x activation"),
                    ("outside", "outside loops"), ("budget", "budget"),
                    ("compile_s", "compile s"), ("ok", "ok")], rows, notes)
