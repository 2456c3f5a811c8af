"""Pipeline parallelism: the stacked blocks split by layer over the pp axis,
the batch run through the stages in microbatches (SPMD, as GPipe: Huang et
al. 2019; the form of MaxText's `layers/pipeline.py`).

Stage r holds layers [r*L/p, (r+1)*L/p). Inside a shard_map manual over pp
and dp, a scan runs M + p - 1 ticks; at tick t stage 0 takes microbatch t,
every stage runs its layers on what it holds, the last stage keeps
microbatch t - (p - 1)'s output, and every stage passes its output to the
next by one `ppermute` (pairs r -> r+1). Every stage computes in every tick:
the p - 1 fill and drain ticks of each stage run on zeros or stale inputs
and their results are dropped (the bubble, (p-1)/(M+p-1) of the ticks).
Autodiff of the scan gives the backward pass: a scan over the ticks in
reverse whose ppermute has the pairs reversed.

Outside the pipeline pp splits the batch as dp does (`RULES["batch"]`):
each stage embeds, and later takes the loss of, its own B/p rows, so the
LM head is not computed p times. Entering, stage 0 receives every other
stage's rows (p - 1 permutes r -> 0); leaving, the last stage sends each
stage its rows (p - 1 permutes p-1 -> r). Their transposes run in the
backward pass. (Point to point, not all-gather and reduce-scatter: inside
a shard_map manual over pp but not tp, XLA gathers an all-gather's or
reduce-scatter's operand over tp first, measured on jax 0.10.2; a permute
keeps its split.) The weights outside the pipeline (embedding, final norm,
head) are replicated over pp; their gradients are summed over pp x dp once
per step, as dp's are.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .collectives import vary, wide
from .layout import (CP_AXIS, DATA_AXIS, EP_AXIS, PP_AXIS, TP_AXIS, Layout, constrain, keep_axes, spec,
                     spec_axes)

_is_spec = lambda x: isinstance(x, P)
# the axes that split a stage's tokens (not pp's): ep's too, which splits
# the batch as dp's does outside a MoE layer's experts
BATCH_SPLIT = {DATA_AXIS, EP_AXIS, CP_AXIS}


def pipeline(stage: Callable, blocks, x_BTD, layout: Layout, schedule, n_stats: int = 0):
    """`stage(blocks, x)` over the stacked `blocks` of every stage, in
    order, on `x_BTD` [B, T, D] (the residual stream, B split over pp and
    dp), by GPipe's schedule: the stream after the last layer, laid out
    like `x_BTD`. With `n_stats` (MoE blocks, whose `stage` returns (x,
    statistics [n_stats]) summed over its layers): (that stream, the
    statistics summed over every stage's layers and averaged over the
    microbatches, the bubble ticks' left out), as M slices of the batch
    would give them (`jaxtp.parallel.schedule`; a pipeline's microbatch m
    is the rows m*b to (m+1)*b - 1, a slice's the rows m, M+m, ...).

    The shard_map is manual over pp and dp (under impl shard_map over every
    axis, so that the blocks' own regions run inside it, unnested): each
    stage's parameters enter once, cast to varying over dp, so that their
    gradients are reduced over dp once per step (the cast's transpose), not
    once per tick. FSDP's are gathered over dp on entry (by GSPMD, before
    the shard_map, under gspmd; by an all-gather in it under shard_map), so
    a stage holds its layers whole for the step."""
    p, M, v = schedule.stages, schedule.microbatches, schedule.repeats
    everything, manual = _manual(layout)
    graphdef, params = nnx.split(blocks)
    specs = nnx.get_partition_spec(params)
    # under gspmd an FSDP weight enters whole over dp (GSPMD gathers it)
    # (and the experts enter split over ep, which is manual here: each stage's
    # ep rank runs its own experts, `jaxtp.model.moe`)
    param_specs = jax.tree.map(
        lambda s: keep_axes(s, manual if everything else {PP_AXIS, EP_AXIS} & manual),
        specs, is_leaf=_is_spec)
    x_spec = keep_axes(spec(*layout.residual), manual)
    over = manual & BATCH_SPLIT

    def per_stage(params, x_nTD):
        leaves, tree = jax.tree.flatten(params)
        leaves = [_enter(x, s, over) for x, s in zip(
            leaves, jax.tree.leaves(param_specs, is_leaf=_is_spec))]
        params = jax.tree.unflatten(tree, leaves)
        # (pinned as the stream is: under SP split along T over tp)
        pin = lambda x: constrain(x, *(None,) * (x.ndim - 3), *layout.residual)
        run = lambda i, x: stage(nnx.merge(graphdef, _chunk(params, i, v)), x)
        out_MbTD, stats = _gpipe(run, pin(_to_first_stage(pin(x_nTD), p, M)), p, v, n_stats)
        out = _from_last_stage(out_MbTD, p, pin)
        # (the stages' statistics: each its own layers'; over the batch axes
        # already means, `jaxtp.model.moe`)
        return (out, jax.lax.psum(stats, PP_AXIS) / M) if n_stats else out

    return jax.shard_map(per_stage, in_specs=(param_specs, x_spec),
                         out_specs=(x_spec, P()) if n_stats else x_spec,
                         axis_names=manual, check_vma=True)(params, x_BTD)


def stages_leave_axes(parallel) -> bool:
    """Whether a run's pipeline stages (`parallel`: a
    `jaxtp.config.ParallelConfig`) leave axes to GSPMD (every impl but
    shard_map, whose stages are manual over every axis: `_manual`). cuDNN's
    attention does not partition there (jax 0.10.2: its custom partitioner
    reads a `.spec` the shard_map's GSPMDSharding lacks)."""
    return parallel.pp > 1 and parallel.impl != "shard_map"


def _manual(layout: Layout) -> tuple[bool, set]:
    """(whether every axis is manual, the axes the pipeline's shard_map makes
    manual): pp and dp, and under impl shard_map every axis (so that the
    blocks' own regions run inside it, unnested)."""
    big = {a for a, n in dict(jax.sharding.get_abstract_mesh().shape).items() if n > 1}
    everything = layout.impl == "shard_map"
    return everything, (big | {TP_AXIS}) if everything else big & ({PP_AXIS} | BATCH_SPLIT)


def _gpipe(run: Callable, xs_in_MbTD, p: int, v: int = 1, n_stats: int = 0):
    """GPipe's M + p - 1 ticks: at tick t stage 0 takes microbatch t, every
    stage runs `run(0, x)` on what it holds and shifts its output to the
    next; (the last stage's outputs [M, b, T, D] (the other stages': zeros),
    with `n_stats` the sum of the statistics `run` returns beside its output
    over the stage's ticks that hold a microbatch, else zeros).

    Circular (v > 1 chunks per stage): v*M + p - 1 ticks; at tick t stage r
    runs its chunk i = (t-r) // M on microbatch (t-r) % M (`run(i, x)`),
    and the shift is a ring: the last stage's output of chunk i < v-1 goes
    to stage 0, which files it among its inputs and takes it up M - p + 1
    ticks later (M >= p), for chunk i+1. MaxText's `layers/pipeline.py`
    runs the same order."""
    M = xs_in_MbTD.shape[0]
    r = jax.lax.axis_index(PP_AXIS)
    pairs = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]

    def tick(carry, t):
        held_bTD, out_MbTD, stats, *circ = carry
        xs_MbTD = circ[0] if v > 1 else xs_in_MbTD
        if v > 1:  # stage 0 files what came round the ring: the last stage's
            back = t - p  # microbatch of tick t-1, for its next chunk
            k = jnp.clip(back, 0, v * M - 1) % M
            keep = (r == 0) & (back >= 0) & (back < (v - 1) * M)
            xs_MbTD = jax.lax.dynamic_update_index_in_dim(
                xs_MbTD, jnp.where(keep, held_bTD, xs_MbTD[k]), k, 0)
        k = jnp.clip(t - r, 0, v * M - 1)  # this stage's microbatch and chunk
        x_bTD = jnp.where(r == 0, xs_MbTD[k % M], held_bTD)
        y_bTD = run(k // M, x_bTD) if v > 1 else run(0, x_bTD)
        if n_stats:  # a fill or drain tick's run on zeros or stale rows: left out
            y_bTD, s = y_bTD
            stats = stats + jnp.where((t - r >= 0) & (t - r < v * M), s, 0.0)
        m = jnp.clip(t - (p - 1) - (v - 1) * M, 0, M - 1)  # one the last stage finished
        done = (r == p - 1) & (t - (p - 1) >= (v - 1) * M)
        out_MbTD = jax.lax.dynamic_update_index_in_dim(
            out_MbTD, jnp.where(done, y_bTD, out_MbTD[m]), m, 0)
        held_bTD = jax.lax.ppermute(y_bTD, PP_AXIS, pairs)
        return (held_bTD, out_MbTD, stats, *([xs_MbTD] if v > 1 else [])), None

    start = (jnp.zeros_like(xs_in_MbTD[0]), jnp.zeros_like(xs_in_MbTD),
             vary(jnp.zeros(n_stats, wide(xs_in_MbTD)), {PP_AXIS}),
             *([xs_in_MbTD] if v > 1 else []))
    _, out_MbTD, stats, *_ = jax.lax.scan(tick, start, jnp.arange(v * M + p - 1))[0]
    return out_MbTD, stats


def _chunk(params, i, v: int):
    """A stage's chunk i of v of its stacked layers (all of them at v = 1;
    the Variables are remade in each tick's trace: nnx refuses Variables
    from another trace level)."""
    if v == 1:
        return jax.tree.map(lambda a: a, params)
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(
        a, i * (a.shape[0] // v), a.shape[0] // v), params)


def _to_first_stage(x_nTD, p: int, M: int, to: int = 0):
    """Each stage's own rows [n, ...] -> on stage `to` (default 0), every
    stage's rows, in stage order, as M microbatches [M, p*n/M, ...]
    (microbatch m: rows m*b to (m+1)*b - 1, so down to one row each), by
    p - 1 permutes r -> `to`; on the others zeros, unread."""
    xs_pnTD = jnp.stack([x_nTD if k == to else jax.lax.ppermute(x_nTD, PP_AXIS, [(k, to)])
                         for k in range(p)])
    _, n, *rest = xs_pnTD.shape
    return xs_pnTD.reshape(M, p * n // M, *rest)


def _from_last_stage(out_MbTD, p: int, pin: Callable, frm: int | None = None):
    """The inverse of `_to_first_stage` from stage `frm` (default the last):
    each stage's own rows of its M microbatches, by p - 1 permutes frm -> r
    (the other stages' `out_MbTD`, zeros, unsent)."""
    frm = p - 1 if frm is None else frm
    M, b, *rest = out_MbTD.shape
    out_pnTD = pin(out_MbTD.reshape(p, M * b // p, *rest))
    r = jax.lax.axis_index(PP_AXIS)
    mine = jnp.where(r == frm, out_pnTD[frm], 0)
    for k in range(p):
        if k != frm:
            mine = mine + jax.lax.ppermute(out_pnTD[k], PP_AXIS, [(frm, k)])
    return mine


def _enter(x, s: P, over: set):
    """A stage's parameter as its layers use it: whole over dp (FSDP's
    all-gather, where it is split over dp here, whose transpose
    reduce-scatters the gradient) and varying over the manual batch-splitting
    axes `over` (dp, cp: the transpose of the cast is one all-reduce of the
    gradient per step, not one per use)."""
    if DATA_AXIS in over:
        for dim, axes in enumerate(s):
            if DATA_AXIS in spec_axes(axes):
                x = jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)
    return vary(x, over)
