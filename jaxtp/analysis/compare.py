"""`--compare-hlo`: compile the train step under the three implementations and hold
each against the analytic budget of `jaxtp.analysis.budget`, side by side.

Writes the optimized HLO of each, `comm_report.json` and `collectives.svg`
(`jaxtp.analysis.picture`); the table lists every
collective (kind, pass, scope, dtype[shape], devices, bytes) with its count
per impl and in the budget, and the budget row's role (f, g, their SP forms
and rings, the loss's reductions). Under `parallel.overlap` it also says,
for GSPMD and explicit, which windowed-einsum loops XLA formed per region
and pass, or why it formed none on this target (`jaxtp.analysis.windowed`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from .. import hlo
from ..checks import check as check_config
from ..config import IMPLS, Config, ConfigError
from ..parallel import mesh_for, xla_overlap
from ..hardware import HARDWARE
from ..model.build import resolve_attention
from . import pp, roofline, windowed
from .backends import version_note
from .budget import budget_for, expected_collectives
from .picture import format_table, write
from .rows import check, decided, runs_head, schedule_of, size_text, table_rows

# XLA's GPU combiners concatenate small collectives into one flat buffer (the
# CPU ones build tuples, which jaxtp.hlo splits again): the bytes stay, the
# per-tensor labels go. The comparison compiles without them.
GPU_UNCOMBINED = {"xla_gpu_all_reduce_combine_threshold_bytes": 0,
                  "xla_gpu_all_gather_combine_threshold_bytes": 0,
                  "xla_gpu_reduce_scatter_combine_threshold_bytes": 0}


def compare_hlo(cfg: Config, out_dir: str | Path, log: Callable[[str], None] = print,
                mesh=None, *, compile_step: Callable) -> dict:
    """Compile the train step under each impl (by `compile_step`:
    `jaxtp.train.step.compiled_step`), check each against the budget.

    Writes `hlo_<impl>.txt` (optimized HLO), `comm_report.json` and
    `collectives.svg` into `out_dir`; returns the report (its `ok` is False
    on any deviation). `mesh`: the mesh to compile for, e.g. of compile-only
    devices of another platform (`jax.experimental.topologies`); default:
    this machine's. Where the compiler is not the one the budget's rules were
    measured on, one line says so (`backends.version_note`).
    """

    p = cfg.parallel
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mesh = decided(cfg)[0].mesh() if mesh is None else mesh
    impls, colls_by_impl, expected_by_impl, refused = _compile_each(cfg, mesh, out, log,
                                                                     compile_step)
    budget, sizes = budget_for(cfg), dict(mesh.shape)
    ring = {impl: sum(e.count * e.ring_bytes for e in rows)
            for impl, rows in expected_by_impl.items()}
    report = _report(cfg, mesh, budget, ring, impls, colls_by_impl, expected_by_impl)
    report["refused"] = refused
    if p.pp > 1:
        report["pipeline"] = _pipeline(cfg, colls_by_impl, dict(mesh.shape), out,
                                       _unpipelined_flops(cfg, mesh, compile_step, log, out))
        report["ok"] = report["ok"] and report["pipeline"]["agree"]
    (out / "comm_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for line in format_table(colls_by_impl, expected_by_impl, sizes):
        log(line)
    log(_analytic_line(budget, p.sequence_parallel, ring,
                       p.overlap != "none" and p.sequence_parallel))
    for impl, r in impls.items():
        log(f"{impl}: {r['verdict']}")
    for impl, why in refused.items():
        log(f"{impl}: refused before compiling: {why}")
    if p.pp > 1:
        log(report["pipeline"]["line"])
    if report["compiler_note"]:
        log(report["compiler_note"])
    for impl, r in impls.items():  # full-buffer bytes, by the mesh axes each collective spans
        log(f"{impl} by mesh axis: " + ", ".join(
            f"{axes} {size_text(v['bytes'])} in {v['collectives']}"
            for axes, v in r["by_axis"].items()))
    skipped = report["roofline"].get("skipped")
    for line in (roofline.lines(report["roofline"]) if skipped is None else
                 [f"roofline cross-check skipped: {skipped}"]):
        log(line)
    log(f"wrote {out / 'comm_report.json'} and hlo_<impl>.txt")

    write(report, out, log)
    if p.pp > 1:
        (out / "pipeline.svg").write_text(pp.picture(p.pp, cfg.train.microbatches,
                                                     p.pp_schedule, p.pp_repeats))
        log(f"drew {out / 'pipeline.svg'}")
    return report


def _compile_each(cfg: Config, mesh, out: Path, log, compile_step: Callable):
    """(report entries, collectives, budgets, refusals), each by impl: every
    impl's step compiled and checked, but where the layout is not built for
    it (`jaxtp.checks`): then the reason, and nothing compiled."""
    impls, colls_by_impl, expected_by_impl, refused = {}, {}, {}, {}
    forms = _windowed_forms(cfg, mesh)
    for impl in IMPLS:
        one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, impl=impl))
        try:
            check_config(one)
        except ConfigError as e:
            refused[impl] = str(e)
            continue
        colls_by_impl[impl], expected_by_impl[impl], impls[impl] = _compile_and_check(
            one, mesh_for(mesh, impl), out, log, forms, compile_step)
    return impls, colls_by_impl, expected_by_impl, refused


def _report(cfg: Config, mesh, budget, ring: dict, impls: dict, colls_by_impl: dict,
            expected_by_impl: dict) -> dict:
    """comm_report.json: the analytic budget, each impl's check, the table's
    rows, and the roofline's cross-check of the shard_map step."""
    p = cfg.parallel
    report = {
        "platform": mesh.devices.flat[0].platform, "device_kind": mesh.devices.flat[0].device_kind,
        **dict(p.degrees), "cp_attention": p.cp_attention if p.cp > 1 else None,
        "layers": cfg.model.n_layers, "batch": budget.batch,
        "seq": cfg.model.seq_len, "d_model": cfg.model.d_model, "dtype_bytes": budget.dtype_bytes,
        "analytic": {
            "all_reduce_per_layer_fwd": budget.all_reduce_per_layer_fwd,
            "all_reduce_per_layer_bwd": budget.all_reduce_per_layer_bwd,
            "bytes_per_all_reduce": budget.bytes_per_all_reduce,
            "ring_bytes_per_all_reduce": budget.ring_bytes_per_all_reduce,
            "ring_bytes_per_layer": budget.ring_bytes_per_layer,
            "ring_bytes_blocks_per_step": budget.ring_bytes_blocks_per_step,
            # everything in the budget, blocks and outside them, per impl
            "ring_bytes_per_rank_per_step": ring,
        },
        "impls": impls,
        "ok": all(v["matches_budget"] for v in impls.values()),
        # the compiler the budget's rules were measured on, where this is another
        "compiler_note": version_note(mesh.devices.flat[0].platform),
        # the rows of the table below, which `collectives.svg` draws
        "table": table_rows(colls_by_impl, expected_by_impl, dict(mesh.shape)),
    }
    why_not = roofline.unsupported(cfg) if p.devices > 1 else "one device: no collective"
    if why_not is None:
        report["roofline"] = roofline.crosscheck(cfg, mesh_for(mesh, "shard_map"))
        report["ok"] = report["ok"] and report["roofline"]["agree"]
    else:
        report["roofline"] = {"skipped": why_not}
    return report


def _unpipelined_flops(cfg: Config, mesh, compile_step: Callable, log,
                       out: Path) -> dict[str, int] | None:
    """The blocks' matmul FLOPs by pass of the same step without a pipeline
    (pp 1, gspmd, its layers scanned as a stage's are, in slices of a
    pipeline microbatch's rows (a MoE's dropless capacity is a slice's
    tokens), on the first devices of `mesh`), per
    device: each stage's useful share is 1/pp of them. (Its HLO:
    `hlo_unpipelined.txt`.) None on a GPU or TPU, whose matmuls are
    library calls the HLO reader does not count (`jaxtp.hlo_dots.dots`), and for
    a MoE, whose one-hot dispatch einsums XLA:CPU rewrites differently in
    and out of the pipeline (measured: moe-tiny pp 2 x ep 2 x cp 2 x tp 2,
    dots in the pipeline, none in the unpipelined step's slices)."""
    if mesh.devices.flat[0].platform != "cpu" or cfg.model.n_experts:
        return None
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, pp=1, pp_schedule="gpipe", pp_repeats=1, impl="gspmd"),
        model=dataclasses.replace(cfg.model, scan_layers=True))  # (as a stage's are)
    log("compiling the step without a pipeline, for its useful block FLOPs ...")
    one = resolve_attention(one, mesh.devices.flat[0])
    ref = decided(one)[0].mesh(list(mesh.devices.flat))
    text = compile_step(one, ref, None)[1].as_text()
    (out / "hlo_unpipelined.txt").write_text(text)
    return pp.block_flops(text)


def _pipeline(cfg: Config, colls_by_impl: dict, sizes: dict, out: Path,
              useful_all: dict[str, int] | None) -> dict:
    """The pipeline's ticks, bubble and compiled/useful block FLOPs read
    from each compiled program (the trips of the loops holding its shift;
    its dots per pass against the unpipelined step's, `useful_all`, over
    pp) beside the schedule's formulas."""
    p, M, schedule = cfg.parallel, cfg.train.microbatches, schedule_of(cfg)
    want, useful = schedule.ticks, p.pp_repeats * M
    ticks = {impl: pp.compiled_ticks(colls, sizes) for impl, colls in colls_by_impl.items()}
    flops = {impl: pp.block_flops((out / f"hlo_{impl}.txt").read_text())
             for impl in colls_by_impl}
    ratio = {impl: {k: f[k] * p.pp / useful_all[k] if useful_all and useful_all[k] else None
                    for k in ("forward", "backward")} for impl, f in flops.items()}
    # (1F1B keeping its inputs alone runs a stage's forward again in each backward)
    formula = {impl: {"forward": (2 if schedule.recomputes else 1) * want / useful,
                      "backward": _backward_formula(f, want, useful) if schedule.split
                      else want / useful} for impl, f in flops.items()}
    read = lambda k: ", ".join(f"{r[k]:.4f} ({impl})" if r[k] else f"unread ({impl})"
                               for impl, r in ratio.items())
    analytic = pp.bubble(p.pp, M, p.pp_repeats)
    whole = useful_all["forward"] + useful_all["backward"] if useful_all else 0
    line = (f"pipeline ({p.pp_schedule}, pp={p.pp}, M={M}"
            + (f", v={p.pp_repeats}" if p.pp_repeats > 1 else "") + "): forward ticks compiled "
            + ", ".join(f"{t} ({impl})" for impl, t in ticks.items())
            + f", analytic v*M + p - 1 = {want}" + (
                " (the last forward's shift, a loop of one trip, dropped by XLA: "
                f"{schedule.forward_shifts} read)" if schedule.forward_shifts < want else "")
            + (f" (in {schedule.span} ticks)" if runs_head(cfg) else "")
            + f"; bubble (p-1)/(v*M+p-1) = {analytic:.1%} analytic, " + ", ".join(
                f"{(t - p.pp_repeats * M) / t:.1%} ({impl})" if t else f"none ({impl})"
                for impl, t in ticks.items()) + " compiled; compiled/useful block FLOPs "
            f"(the dots' against pp x the unpipelined step's) forward {read('forward')}, "
            f"backward {read('backward')}; formula (v*M + p - 1)/(v*M) = {want}/{useful} = "
            f"{want / useful:.4f}"
            + (" (1F1B's fill and drain loops run one kind each)" if runs_head(cfg) else "")
            + (", the forward's twice (parallel.pp_stash=inputs: the backward runs it again)"
               if schedule.recomputes else "")
            + ("; zb's backward: B at that, W (weight gradients) at v*M/(v*M) = 1, so "
               + ", ".join(f"{formula[impl]['backward']:.4f} ({impl}; W "
                           f"{f['weights'] / max(f['backward'], 1):.1%} of it)"
                           for impl, f in flops.items()) if schedule.split else "")
            + "; the whole step " + ", ".join(
                f"{(f['forward'] + f['backward']) * p.pp / whole:.4f} ({impl})"
                for impl, f in flops.items() if whole))
    agree = all(t == schedule.forward_shifts for t in ticks.values()) and all(
        x is None or abs(x - formula[impl][k]) < 1e-9
        for impl, r in ratio.items() for k, x in r.items())
    return {"ticks": ticks, "ticks_analytic": want, "bubble": analytic, "line": line,
            "flops_ratio": ratio, "flops_ratio_analytic": want / useful, "agree": agree}


def _backward_formula(flops: dict, ticks: int, useful: int) -> float:
    """zb's compiled/useful backward FLOPs: B's share of an op's backward
    (read from the program: its B FLOPs over the `ticks` that run them, its
    W FLOPs over the `useful` ones) at ticks/useful, W's at 1. Holds the
    program to its loops: were W's trips not v*M, the ops' B + W would not
    be the unpipelined step's backward."""
    w = flops["weights"] / useful
    b = (flops["backward"] - flops["weights"]) / ticks
    return (ticks * b + useful * w) / (useful * (b + w)) if b + w else 0.0


def _windowed_forms(cfg: Config, mesh) -> xla_overlap.Forms:
    """The windowed-einsum loops XLA forms for this step on `mesh`'s devices
    under GSPMD's overlap; on a GPU the iteration cap is read from a compile's
    log (a deviceless target: 0)."""
    device = mesh.devices.flat[0]
    p = cfg.parallel
    if p.overlap == "none" or not p.sequence_parallel or device.platform == "cpu":
        return xla_overlap.forms(cfg, device.platform)
    deviceless = type(getattr(device, "client", None)).__name__ == "CompileOnlyPyClient"
    target = next((name for name, h in HARDWARE.items() if h.description == device.device_kind),
                  None)
    cap = windowed.logged_cap("local" if not deviceless else target) \
        if device.platform == "gpu" and (target or not deviceless) else None
    return xla_overlap.forms(cfg, device.platform, deviceless=deviceless, cap=cap)


def _compile_and_check(cfg: Config, mesh, out: Path, log, forms: xla_overlap.Forms,
                       compile_step: Callable) -> tuple[list, list, dict]:
    """(collectives, budget, report entry) of the train step of `cfg` (one impl)."""

    m, impl = cfg.model, cfg.parallel.impl
    platform = mesh.devices.flat[0].platform
    options = GPU_UNCOMBINED if platform in ("gpu", "cuda", "rocm") else None
    # the kernel the step is built with on this mesh's devices (the budget's
    # rows depend on it: cuDNN attention keeps the per-slice dp reduction)
    cfg = resolve_attention(cfg, mesh.devices.flat[0])
    log(f"compiling the {impl} train step (tp={cfg.parallel.tp}, {m.n_layers} layers) ...")
    text = compile_step(cfg, mesh, options)[1].as_text()
    (out / f"hlo_{impl}.txt").write_text(text)
    colls = hlo.collectives(text)
    expected = expected_collectives(cfg, impl, platform, forms)
    diff = check(colls, expected, dict(mesh.shape))  # each collective on its budgeted axes
    extra = {}
    if cfg.parallel.overlap != "none" and cfg.parallel.sequence_parallel and \
            impl != "shard_map":
        loops = hlo.windowed_loops(text)
        for line in windowed.report(impl, platform, forms, loops):
            log(line)
        extra["windowed_einsum"] = {
            "loops": [dict(kind=k, pass_=p, scope=sc, count=n) for (k, p, sc), n in loops.items()],
            "all_gather_loops_expected": forms.all_gather,
            "reduce_scatter_loops_expected": forms.reduce_scatter, "why": forms.why}
    by_axis = hlo.by_axis(colls, dict(mesh.shape))
    return colls, expected, {**extra, "collectives": hlo.summarize(colls, dict(mesh.shape)),
                             "by_axis": by_axis,
                             "expected": [e.to_dict() for e in expected],
                             "matches_budget": diff is None,
                             "verdict": "matches budget" if diff is None else diff}


def _analytic_line(budget, sp: bool, ring: dict, overlap: bool = False) -> str:
    per_block = ("2 all-gathers + 2 reduce-scatters forward and backward (shard_map: as "
                 "rings of tp - 1 permutes each), priced as" if overlap else
                 "2 all-gathers + 2 reduce-scatters forward and backward, priced as" if sp
                 else "") + (f" {budget.all_reduce_per_layer_fwd} fwd + "
                             f"{budget.all_reduce_per_layer_bwd} bwd all-reduces")
    return (f"analytic (Megatron{'-SP' if sp else ''}): per block {per_block.strip()} "
            f"of b*s*h = {budget.batch}*{budget.seq}*{budget.d_model} = "
            f"{size_text(budget.bytes_per_all_reduce)}; ring traffic per "
            f"rank {size_text(budget.ring_bytes_per_all_reduce)} each, "
            f"{size_text(budget.ring_bytes_per_layer)} per block, "
            f"{size_text(budget.ring_bytes_blocks_per_step)} for the blocks per step; with the "
            "collectives outside the blocks: " + ", ".join(
                f"{size_text(v)} ({k})" for k, v in ring.items()))
