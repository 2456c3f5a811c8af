"""The `pp` section of the benchmark suite: each pipeline schedule's train
step against the same model without a pipeline, and its pp bytes against
the pp ledger (`jaxtp.analysis.pp`)."""

from __future__ import annotations

from .. import hlo
from ..analysis.pp import bubble, expected_pp
from ..analysis.rows import per_step, schedule_of
from ..parallel import PP_AXIS
from .cases import PAIRED, _case, _paired, preset
from .report import section
from .timing import build

# (schedule, repeats) at pp=2 x tp=4, M = 4, against tp=8 unpipelined
# (zb over 2 chunks, as it beats circular's FLOPs; at one, 1F1B's table: docs/scale.md)
SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved", 2), ("zb", 2))


def bench_pp(plan: dict, log=print) -> dict:
    """Tiny (4 layers) at pp=2 x tp=4, M = 4, under each schedule, timed
    alternately against tp=8 without a pipeline (the whole batch in one
    step, the strongest plain layout on these devices), with each compiled
    step's pp bytes against the pp ledger."""
    small = [o for o in plan["small"] if not o.startswith("model.n_layers")]
    base_cfg, cut = preset("tiny", "parallel.tp=8", "model.n_layers=4", *small)
    base = build("tiny tp=8", base_cfg)
    rows = []
    for i, (schedule, v) in enumerate(SCHEDULES, 1):
        log(f"pp {i}/{len(SCHEDULES)}: tiny pp=2 tp=4 {schedule} against tp=8")
        cfg, _ = preset("tiny", "parallel.tp=4", "parallel.pp=2", "train.microbatches=4",
                        f"parallel.pp_schedule={schedule}", f"parallel.pp_repeats={v}",
                        "model.n_layers=4", *small)
        run = build(f"tiny pp=2 tp=4 {schedule}", cfg)
        sizes = dict(run.mesh.shape)
        colls = hlo.collectives(run.step.as_text())
        got = sum(c.count * c.bytes for c in colls
                  if c.kind == "collective-permute" and c.axes(sizes) == (PP_AXIS,))
        want = sum(r.bytes * r.count for r in per_step(expected_pp(cfg), schedule_of(cfg)))
        ticks = schedule_of(cfg).ticks
        rows.append(_paired(plan, base, run, "tp8_ms", "pp_ms",
                            case=_case(f"tiny pp=2 tp=4 {schedule}" + (f" v={v}" if v > 1 else ""),
                                       cfg, cut),
                            measured="train step time, pipelined / tp=8", ticks=ticks,
                            bubble=bubble(2, 4, v), pp_bytes=got, ledger_bytes=want,
                            temps=run.step.memory_analysis().temp_size_in_bytes))
    notes = ["pp=2 x tp=4 at M = 4 against tp=8 with the whole batch in one step, compiled in "
             "one process and timed alternately; > 1: the pipeline is slower",
             "on CPU the fake devices share the cores and a bubble tick computes on dropped "
             "data rather than idling: the ratio prices the schedule's compiled work (GPipe "
             "and 1F1B (M+p-1)/M, circular and interleaved (vM+p-1)/(vM) of the blocks' "
             "FLOPs; zb's weight gradients vM/(vM), its forwards and input gradients "
             "(vM+p-1)/(vM)), not a GPU's idle time",
             "temps: the compiled step's temporaries (memory_analysis): GPipe's and "
             "circular's autodiff keep every tick's residuals, 1F1B's stash 2p - 1 "
             "microbatches', interleaved's v*p + p - 1 chunks'; zb's those and, between "
             "B and W, p chunks' weight-matmul cotangents",
             "pp bytes: the step's collective-permutes over pp (shifts every tick, entry and "
             "exit once), against the pp ledger"]
    columns = [*PAIRED, ("tp8_ms", "tp=8 ms"),
               ("pp_ms", "pp ms"), ("ticks", "ticks"), ("bubble", "bubble"),
               ("pp_bytes", "pp B"), ("ledger_bytes", "ledger B"), ("temps", "temps B")]
    return section("pp", "Pipeline schedules against tp=8 (CPU)", columns, rows, notes)
