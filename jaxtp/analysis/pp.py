"""The pipeline's ledger: the rows on the pp axis (`jaxtp.parallel.pipeline`),
and its bubble, analytic and read from the compiled program.

GPipe (Huang et al. 2019, Sec. 2.2) runs M microbatches through p stages in
M + p - 1 ticks; each stage idles (here: computes what is dropped) p - 1 of
them, the bubble (p-1)/(M+p-1) of the step; with v chunks per stage
(Narayanan et al. 2021, Sec. 2.2.2, interleaving) v*M + p - 1 ticks of 1/v
the work, the bubble (p-1)/(v*M+p-1). Compiled FLOPs per useful FLOP of the
blocks: (v*M + p - 1)/(v*M), as every stage computes in every tick.

Per tick each stage sends its output, a microbatch's b = B/(M*dp) rows of
the residual stream, to the next (circular: the last stage to the first
too, a ring of p pairs against GPipe's p - 1) (one collective-permute of b*(s/cp)*D
elements, /tp under SP, where the stream is split along the sequence over
tp: Megatron's `get_tensor_shapes`), and the backward pass sends the
gradients the other way, the same bytes. The bubble's ticks send too, and
are booked with the rest (`ticks`). Entering the pipeline stage 0 receives
every other stage's B/(p*dp) rows (p - 1 permutes), leaving the last stage
sends each stage its rows (p - 1 permutes); the backward pass runs the
transposes, the same permutes reversed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import hlo
from ..groups import hops_on
from ..hlo_dots import dots
from ..config import Config
from ..parallel import CP_AXIS, DATA_AXIS, PP_AXIS
from ..checks import ONE_F_ONE_B, SPLIT
from ..parallel.pipeline_1f1b import BACK_SHIFT
from ..parallel.vjp_split import WGRAD
from ..parallel.pipeline_table import decode, phases, table as f1b_table, weights
from .rows import HLO_DTYPES, Expected, microbatch_rows, on, runs_head, schedule_of


def expected_pp(cfg: Config) -> list[Expected]:
    """The step's collectives on the pp axis, the shifts counted per tick
    (`rows.per_step` multiplies by `Schedule.ticks`)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.pp == 1:
        return []
    split = p.tp if p.sequence_parallel else 1
    row = (m.seq_len // p.cp) * m.d_model // split  # one sequence's residual stream per rank
    shift = microbatch_rows(cfg) * row
    mine = t.batch_size // (p.pp * p.dp * p.ep) * row  # a stage's own rows outside the pipeline
    # a permute's group is its source-target pairs, in each of the
    # devices/p pipelines: p - 1 for a shift, 1 for an entry or exit permute
    pipelines = p.devices // p.pp
    E = lambda name, pass_, n, count, pairs=1, per="step", scope="": Expected(
        name, "collective-permute", pass_, scope, n, HLO_DTYPES[m.dtype], pairs * pipelines,
        count, "pp", (PP_AXIS,), per=per)
    hops = p.pp - 1
    ring = p.pp if p.pp_repeats > 1 else hops  # circular: the last stage's to the first too
    if runs_head(cfg):
        return _expected_1f1b(E, shift, mine, hops, t.batch_size // (p.pp * p.dp * p.ep)
                              * (m.seq_len // p.cp), schedule_of(cfg), ring)
    return [
        E("pp shift: each stage's output to the next, every tick", "forward", shift, 1, ring,
          per="tick"),
        E("pp shift, backward: each stage's input gradient to the one before, every tick",
          "backward", shift, 1, ring, per="tick"),
        E("pp entry: each stage's rows to stage 0", "forward", mine, hops),
        E("pp exit: the last stage's outputs to their stages", "forward", mine, hops),
        E("pp exit and entry, backward: the same permutes reversed", "backward", mine,
          2 * hops),
    ]


def _expected_1f1b(E, shift: int, mine: int, hops: int, targets: int,
                   schedule, ring: int) -> list[Expected]:
    """1F1B's rows (`jaxtp.parallel.pipeline_1f1b`): each tick that runs a
    forward sends its output on (+1), each that runs a backward but the last
    its input gradient back (-1), all in the step's forward program (the
    schedule runs its own backward); the entry brings stage 0 the stages'
    rows and the last stage their targets, and stage 0 returns each stage
    its rows' input gradient, once. No transposes: the step's autodiff only
    scales the schedule's gradients. Interleaved: both shifts rings of p
    pairs (`ring`). (zb at M = p: the last forward's shift dropped,
    `Schedule.forward_shifts`.)"""
    ticks = schedule.ticks
    return [
        E("pp shift +1: each stage's output to the next, each forward tick", "forward",
          shift, schedule.forward_shifts, ring),
        E("pp shift -1: each stage's input gradient to the one before, each backward tick "
          "but the last", "forward", shift, ticks - 1, ring, scope=BACK_SHIFT),
        E("pp entry: each stage's rows to stage 0", "forward", mine, hops),
        dataclasses.replace(E("pp entry: each stage's targets to the last stage", "forward",
                              targets, hops), dtype="s32"),
        E("pp exit: stage 0's input gradients to their stages", "forward", mine, hops),
    ]


def in_pipeline(cfg: Config, path: str, in_stack: bool) -> bool:
    """Whether a parameter is used inside the pipeline's shard_map: a stage's,
    and under 1F1B the head's (final norm, LM head, a tied table's head part)."""
    if cfg.parallel.pp == 1:
        return False
    return in_stack or runs_head(cfg) and path in (
        "ln_f/scale", "ln_f/bias", "lm_head/embedding")


def pipeline_parts(cfg: Config, impl: str, g, platform: str = "") -> list:
    """The sums around a pipeline (`jaxtp.parallel.pipeline`), once per step.

    A stage's weights are summed over the batch axes its stage is manual
    over (dp, ep, cp; the experts' over dp x cp) in one all-reduce after it
    (FSDP's under shard_map reduce-scattered over dp); 1F1B's head weights,
    in the loop, over pp too. The weights outside the stages are summed where
    their tokens are split: written in a region, one psum over pp, the batch
    axes and cp; placed by GSPMD, over cp and then over pp and the batch axes.
    (Accumulated over the ticks in the loop: in its own dtype.)"""
    p, pd = cfg.parallel, HLO_DTYPES[cfg.model.param_dtype]
    cp = on(cfg, CP_AXIS)
    outer = on(cfg, PP_AXIS) + g.batch
    over = lambda a: " x ".join(a)
    step = dict(per="step")
    if g.shard.in_stack:
        inner = g.batch + cp
        if g.expert:
            return [g.part(f"{over(inner)}: the experts' weight gradients (ep owns its "
                           "experts)", g.shard.elements, pd, inner, role="moe_grads",
                           **step)] * bool(inner)
        if p.fsdp and impl == "shard_map" and p.dp > 1 and g.shard.dp_split:
            return [g.part("cp: the stages' FSDP weight gradients, summed over cp once",
                           g.shard.elements, pd, cp, **step)] * bool(cp) + [
                g.part("dp: the stages' FSDP weight gradients, reduce-scattered once",
                       g.shard.elements // p.dp, pd, (DATA_AXIS,), kind="reduce-scatter",
                       **step)]
        return [g.part(f"{over(inner)}: the stages' weight gradients, summed over "
                       f"{over(inner)} once (after the pipeline)", g.shard.elements, pd,
                       inner, **step)] * bool(inner)
    fsdp = p.fsdp and p.dp > 1 and g.shard.dp_split and g.written
    tied_head = g.shard.path == "wte/embedding" and g.sums > 1
    f1b = runs_head(cfg)
    in_loop = [False] + [f1b] * (g.sums - 1) if tied_head else \
        [in_pipeline(cfg, g.shard.path, False)] * g.sums
    out = []
    for looped, dt, use in zip(in_loop, g.dtypes, g.uses):
        dt = pd if looped else dt
        step = dict(per="step", use=use)
        if fsdp:  # (pp x cp at once in the region, then FSDP's reduce-scatter over dp)
            rest = on(cfg, PP_AXIS, CP_AXIS)
            out += [g.part(f"{over(rest)}: the FSDP vocab tables' gradients outside the "
                           "stages", g.shard.elements, dt, rest, **step),
                    g.part("dp: the FSDP vocab tables' gradients outside the stages, "
                           "reduce-scattered", g.shard.elements // p.dp, dt, (DATA_AXIS,),
                           kind="reduce-scatter", **step)]
        elif looped or (impl == "shard_map" and g.written):
            out.append(g.part(f"{over(outer + cp)}: the gradients of the weights outside "
                              "the stages (embedding, head, final norm), summed at once",
                              g.shard.elements, dt, outer + cp, written=impl == "shard_map",
                              role="grads_outside", **step))
        else:  # (a learned positions' gradient: its own sequence rows over pp x dp)
            if cp and not g.keyed:
                out.append(g.part("cp: the gradients of the weights outside the pipeline, "
                                  "placed by GSPMD, summed over cp", g.shard.elements, dt,
                                  cp, written=False, role="grads_apart_cp", **step))
            out.append(g.part(f"{over(outer)}: the gradients of the weights outside the "
                              "pipeline (embedding, head, final norm)", g.dp_elements, dt,
                              outer, written=False, role="grads_apart", **step))
    return out


def compute_factor(cfg: Config) -> tuple[int, int]:
    """(compiled, useful) block FLOPs of a step, as every stage computes in
    every tick: (v*M + p - 1, v*M) (GPipe and 1F1B (M+p-1)/M, 1F1B's
    forward-only and backward-only ticks each in a loop of their own;
    circular and interleaved (v*M+p-1)/(v*M)); zb's weight gradients run
    v*M times, not v*M + p - 1: (3v*M + 2(p - 1), 3v*M), a forward, an input
    gradient and a weight gradient costing alike (Qi et al. 2024, Sec. 2;
    `--compare-hlo` reads their shares from the program); (1, 1) without a
    pipeline."""
    p, M = cfg.parallel, cfg.train.microbatches
    if p.pp == 1:
        return 1, 1
    ticks, useful = schedule_of(cfg).ticks, p.pp_repeats * M
    if schedule_of(cfg).split:
        return 3 * ticks - (p.pp - 1), 3 * useful
    return ticks, useful


BLOCK_SCOPES = ("attention", "mlp", "moe")


def block_flops(text: str) -> dict[str, int]:
    """The blocks' matmul FLOPs per step and device by pass ("forward",
    "backward"; of the backward, "weights": the zero-bubble schedule's W,
    named `WGRAD`), read from compiled HLO (`jaxtp.hlo_dots.dots`: every dot
    at its loops' trip counts; XLA:CPU's dots, none where the compiler
    calls cuBLAS)."""
    out = {"forward": 0, "backward": 0, "weights": 0}
    for d in dots(text):
        if d.scope in BLOCK_SCOPES and d.pass_ in out:
            out[d.pass_] += d.flops
            out["weights"] += d.flops * (WGRAD in d.op_name)
    return out


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The analytic bubble: (p-1)/(v*M + p - 1) of the step's ticks."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def compiled_ticks(colls: list[hlo.Collective], mesh: dict[str, int]) -> int | None:
    """The pipeline's forward ticks as the compiled program runs them: the
    trips of the forward shift (a floating-point collective-permute over pp
    whose pairs step +1 along pp, or wrap round a ring, in a loop's body;
    not 1F1B's backward shift, named `BACK_SHIFT`),
    summed over the loops that hold it (1F1B's fill and steady loops);
    None without one."""
    p = mesh.get(PP_AXIS, 1)
    counts = [c.count for c in colls if c.kind == "collective-permute" and c.dtype[0] in "fb"
              and c.pass_ == "forward" and "while" in c.op_name and BACK_SHIFT not in c.op_name and c.axes(mesh) == (PP_AXIS,) and 1 in (hops := hops_on(c.groups, mesh, PP_AXIS))
              and hops <= {1, 1 - p}]
    return sum(counts) if counts else None


def cells(stages: int, microbatches: int, repeats: int = 1,
          schedule: str = "gpipe") -> list[list[str]]:
    """The schedule as it runs (`jaxtp.parallel.pipeline`), per stage, per
    tick: v*M + p - 1 forward ticks, then the scan's transpose, the same
    ticks in reverse. "F3": the forward of microbatch 3; "B3": its
    backward; circular (v > 1) adds the chunk, "F3:1"; "": a bubble tick
    (computed on dropped data). 1F1B: its M + 2p - 2 ticks, "F3/B1" a
    tick's forward of microbatch 3 and backward of 1 (interleaved:
    v*M + (v+1)p - 2 ticks, with the chunks); zb adds the tick's weight
    gradient, "F3/B1/W0"."""
    p, M, v = stages, microbatches, repeats
    if schedule in ONE_F_ONE_B:  # its own table: a forward, a backward or both a tick
        fwd, bwd = f1b_table(p, M, v)
        wgt = weights(bwd) if schedule in SPLIT else np.full_like(bwd, -1)
        name = lambda kind, n: "{}{}".format(kind, decode(n, p, v)[0]) + (
            f":{decode(n, p, v)[1]}" if v > 1 else "")
        return [["/".join(name(k, n) for k, n in zip("FBW", ops) if n >= 0)
                 for ops in zip(fwd[:, r], bwd[:, r], wgt[:, r])] for r in range(p)]
    T = v * M + p - 1

    def op(kind: str, k: int) -> str:
        if not 0 <= k < v * M:
            return ""
        return f"{kind}{k % M}" + (f":{k // M}" if v > 1 else "")

    return [[op("F", t - r) for t in range(T)] + [op("B", T - 1 - t - r) for t in range(T)]
            for r in range(p)]


def picture(stages: int, microbatches: int, schedule: str = "gpipe", repeats: int = 1) -> str:
    """`pipeline.svg`: stages down, ticks across; forward, backward and
    bubble cells (circular: a chunk's cells a shade of their own)."""
    grid = cells(stages, microbatches, repeats, schedule)
    f1b = schedule in ONE_F_ONE_B
    w, h, left, top = 34, 26, 70, 44
    ticks = len(grid[0])
    width, height = left + ticks * w + 10, top + stages * h + 40
    shades = {"F": ("#4f81bd", "#1f4e79"), "B": ("#9bbb59", "#5a7a1e"),
              "W": ("#f79646", "#b65708")}
    fill = lambda cell: (shades[cell[0]][int(cell.partition(":")[2] or 0) % 2] if cell
                         else "#d9d9d9")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="6" y="18" font-size="13" font-weight="bold">{schedule}: {stages} stages, '
             f'{microbatches} microbatches{f", {repeats} chunks each" if repeats > 1 else ""}, '
             + (f'{ticks} ticks, a forward (top) and a backward (bottom) in the steady ones; '
                if f1b and schedule not in SPLIT else
                f'{ticks} ticks, a forward (top), an input gradient and a weight gradient '
                '(bottom) in the steady ones; '
                if f1b else
                f'{ticks // 2} ticks forward + {ticks // 2} backward; ')
             + f'bubble {bubble(stages, microbatches, repeats):.1%} (grey: computed, '
             'dropped)</text>']
    kinds = "FBW" if schedule in SPLIT else "FB"
    runs = [kind[:len(kinds)] for begin, end, *kind in
            phases(stages, microbatches, repeats, schedule in SPLIT)
            for _ in range(begin, end)] if f1b else []
    for r, row in enumerate(grid):
        y = top + r * h
        parts.append(f'<text x="6" y="{y + 17}" font-size="11">stage {r}</text>')
        for t, cell in enumerate(row):
            x = left + t * w
            # 1F1B: a tick's forward above its backward; white where the
            # tick's loop does not compute that kind at all
            halves = ([(kind, next((c for c in cell.split("/") if c[:1] == kind), ""), live)
                       for kind, live in zip(kinds, runs[t])] if f1b else [("", cell, True)])
            hh = (h - 2) // len(halves)
            for i, (_, op, live) in enumerate(halves):
                parts.append(f'<rect x="{x}" y="{y + i * hh}" width="{w - 2}" height="{hh}" '
                             f'fill="{fill(op) if live else "#ffffff"}" class="cell" '
                             f'data-stage="{r}" data-tick="{t}" '
                             f'data-op="{op or ("bubble" if live else "none")}"/>')
                if op:
                    parts.append(f'<text x="{x + 5}" y="{y + i * hh + (hh - 2 if f1b else 17)}" '
                                 f'font-size="{(9, 7)[len(halves) > 2] if f1b else 11}" '
                                 'fill="#ffffff">'
                                 f'{op.partition(":")[0]}</text>')
    parts.append(f'<text x="{left}" y="{top + stages * h + 24}" font-size="11">ticks across: '
                 + ('forward (blue) and backward (green' + ('; weight gradients orange'
                                                            if schedule in SPLIT else '')
                    + ') as 1F1B interleaves them, the fill and drain ticks in loops of '
                    'their kinds (white: not computed)' if f1b else
                    'forward (blue), then backward (green, the scan reversed)')
                 + ('; a darker shade: an odd chunk' if repeats > 1 else '') + '</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"
