"""The `cp` section of the benchmark suite: context parallelism's ring
against its all-gather, and each compiled step's cp bytes against the cp
ledger (`jaxtp.analysis.cp`)."""

from __future__ import annotations

import jax

from .. import hlo
from ..analysis.cp import expected_cp
from ..analysis.rows import per_step, schedule_of
from ..parallel import CP_AXIS
from .cases import PAIRED, _case, _get, _paired
from .report import section


def bench_cp(plan: dict, cache: dict, log=print) -> dict:
    """Context parallelism's two strategies: the ring's train step against
    the all-gather's (tiny, each pair timed alternately), and each compiled
    step's cp bytes against the cp ledger (`jaxtp.analysis.cp`)."""
    rows = []
    for i, (cp, tp) in enumerate(plan["cp_layouts"], 1):
        log(f"cp {i}/{len(plan['cp_layouts'])}: tiny cp={cp} tp={tp} ring / allgather")
        ag, cut = _get(plan, cache, "tiny", tp, cp=cp)
        ring, _ = _get(plan, cache, "tiny", tp, cp=cp, cp_attention="ring")
        ledger = {}
        for name, run in (("allgather", ag), ("ring", ring)):
            colls = hlo.collectives(run.step.as_text())
            got = sum(c.count * c.bytes for c in colls  # the core's (not the weights' sums)
                      if c.scope == "attention" and c.kind != "all-reduce"
                      and c.axes(dict(run.mesh.shape)) == (CP_AXIS,))
            want = sum(r.bytes * r.count for r in per_step(
                expected_cp(run.cfg, run.cfg.parallel.impl), schedule_of(run.cfg)))
            ledger[f"{name}_cp_bytes"], ledger[f"{name}_ledger_bytes"] = got, want
        rows.append(_paired(plan, ag, ring, "allgather_ms", "ring_ms",
                            case=_case(f"tiny cp={cp} tp={tp}", ag.cfg, cut),
                            measured="train step time, ring / allgather", cp=cp, tp=tp,
                            **ledger))
    notes = ["both compiled in one process and timed alternately; < 1: the ring is faster",
             "cp bytes: the attention's collectives over cp in the compiled step, full buffers "
             "per step, beside the cp ledger's (jaxtp.analysis.cp; equal when it holds)"]
    if jax.default_backend() == "cpu":
        notes.append("CPU: the ring's cp-1 hops run one after another with their chunk pairs "
                     "(no concurrent streams), so it pays the permutes' latency and its "
                     "per-pair kernel calls where a GPU would overlap them")
    return section("cp", "Context parallelism: ring against all-gather attention",
                   PAIRED + [("allgather_ms", "allgather ms"), ("ring_ms", "ring ms"),
                             ("allgather_cp_bytes", "allgather cp B"),
                             ("allgather_ledger_bytes", "ledger B"),
                             ("ring_cp_bytes", "ring cp B"), ("ring_ledger_bytes", "ledger B")],
                   rows, notes)
