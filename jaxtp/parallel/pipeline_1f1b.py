"""The 1F1B pipeline schedule (PipeDream-flush: Narayanan et al. 2021, Sec.
2.2.1): each stage runs a microbatch's backward as soon as its gradient
arrives, so a stage holds at most 2p - 1 microbatches' activations, not
GPipe's M (interleaved over v chunks per stage: v*p + p - 1 chunks').

SPMD, as `jaxtp.parallel.pipeline`'s GPipe: every stage runs the same tick
on what a static table says (`table`). A steady tick runs one microbatch's
forward and another's backward on every stage; the forward keeps what its
backward needs (the residuals of its `jax.vjp`, as the blocks' remat policy
leaves them: GPipe's autodiff keeps the same) in a stash of 2p - 1 slots,
and the backward takes them from there, so nothing is recomputed. The
first p - 1 ticks run forwards only and the last p - 1 backwards only, each
in a loop of its own (`phases`): the stages' block FLOPs are M + p - 1
forwards and M + p - 1 backwards, GPipe's, in M + 2p - 2 ticks.

The head (final norm, LM head, loss) runs on the last stage inside the
loop: its gradient starts each microbatch's backward in the tick of its
forward. The whole schedule is one `jax.custom_vjp` whose forward runs
every tick and keeps the gradients; the step's autodiff multiplies them by
the loss's cotangent and carries the input gradient on to the embedding.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .collectives import vary, varying_axes, wide
from .layout import EP_AXIS, PP_AXIS, Layout, constrain, keep_axes, spec
from .pipeline import (BATCH_SPLIT, _chunk, _enter, _from_last_stage, _is_spec, _manual,
                       _to_first_stage)


# the name scope of the backward shift, which the compiled program's reader
# tells from the forward one by it (`jaxtp.analysis.pp.compiled_ticks`)
BACK_SHIFT = "pp_back"


def table(p: int, M: int, v: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(forward [T, p], backward [T, p]): the op each stage runs forward and
    backward in each tick, as its forward index n (`decode`), -1 for none;
    T = v*M + (v+1)p - 2 (M + 2p - 2 at v = 1).

    A stage's forwards run in the order n = g*v*p + i*p + j: microbatch
    g*p + j's chunk i (of v; at v = 1 simply microbatch n), op n on stage r
    at tick n + r, the tick after the stage before ran it (under v > 1 stage
    0 takes chunk i > 0 from the last stage's chunk i - 1 a tick after it,
    round the ring: Megatron's interleaved order, microbatches in groups of
    p; Narayanan et al. 2021, Sec. 2.2.2). The backwards run the chunks in
    reverse, the k-th (the same order with chunk v-1-i) at tick
    v*p - 1 + k + p - 1 - r: the tick after the stage after ran it, on the
    last stage the tick of its chunk v-1's forward, whose head gradient it
    takes. So the steady ticks carry a forward and a backward on every stage
    (1F1B's order: PipeDream-flush, Narayanan et al. 2021, Sec. 2.2.1), the
    first v*p - 1 forwards only, the last v*p - 1 backwards only (`phases`).
    Stage r holds an op from its forward to its backward (`in_flight`):
    stage 0 at most 2p - 1 microbatches at v = 1, v*p + p - 1 chunks (a
    stage's p + (p-1)/v) under v (GPipe, circular: all of them)."""
    if v > 1 and M % p:
        raise ValueError(f"the interleaved order takes microbatches in groups of p={p}: "
                         f"M={M} is not a multiple")
    T = v * M + (v + 1) * p - 2
    fwd, bwd = np.full((T, p), -1, np.int32), np.full((T, p), -1, np.int32)
    n = np.arange(v * M)
    back = (n // (v * p)) * v * p + (v - 1 - n % (v * p) // p) * p + n % p  # k-th: chunk v-1-i
    for r in range(p):
        fwd[n + r, r] = n
        bwd[v * p - 1 + n + p - 1 - r, r] = back
    return fwd, bwd


def decode(n, p: int, v: int = 1):
    """A forward index's (microbatch, chunk): n = g*v*p + i*p + j is
    microbatch g*p + j's chunk i (numpy or jax integers)."""
    return (n // (v * p)) * p + n % p, n % (v * p) // p


def phases(p: int, M: int, v: int = 1) -> list[tuple[int, int, bool, bool]]:
    """The table's ticks as loops of one kind: (first tick, end, runs
    forwards, runs backwards): v*p - 1 ticks of forwards (no backward has a
    gradient yet), then both until the last forward, then v*p - 1 ticks of
    backwards. Each loop's tick computes only its kinds, so a stage's block
    FLOPs are v*M + p - 1 chunk forwards and as many chunk backwards:
    GPipe's (v = 1) and circular's. (The last tick runs apart, without the
    backward shift: stage 0's gradient is the last, and it stays there.)"""
    edges = [(0, v * p - 1, True, False), (v * p - 1, v * M + p - 1, True, True),
             (v * M + p - 1, v * M + (v + 1) * p - 2, False, True)]
    return [e for e in edges if e[1] > e[0]]


def slots(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(the stash slot each forward writes [T, p], the slot each backward
    reads [T, p], the slots): each forward takes the lowest slot its stage
    has free, its backward frees it (after reading it, in the tick). So the
    slots are the most ops a stage holds at once (`in_flight` of stage 0):
    2p - 1 at v = 1, v*p + p - 1 chunks under v (a stage's p + (p-1)/v)."""
    T, p = fwd.shape
    fslot, bslot = np.zeros((T, p), np.int32), np.zeros((T, p), np.int32)
    for r in range(p):
        free, at = [], {}
        for t in range(T):
            if fwd[t, r] >= 0:
                at[fwd[t, r]] = fslot[t, r] = free.pop(0) if free else len(at) + len(free)
            if bwd[t, r] >= 0:
                bslot[t, r] = at.pop(bwd[t, r])
                free = sorted(free + [bslot[t, r]])
    return fslot, bslot, max(in_flight(fwd, bwd, r) for r in range(p))


def in_flight(fwd: np.ndarray, bwd: np.ndarray, stage: int = 0) -> int:
    """The most ops (microbatches, or chunks of them) `stage` holds at once
    (forwarded, not yet backwarded; a backward in the tick of its forward:
    held that tick)."""
    held = np.cumsum(fwd[:, stage] >= 0) - np.concatenate(
        [[0], np.cumsum(bwd[:, stage] >= 0)[:-1]])
    return int(held.max())


def pipeline_1f1b(stage: Callable, head: Callable, blocks, head_modules, x_BTD, targets_BT,
                  layout: Layout, schedule, stat_weights: np.ndarray | None = None):
    """The mean loss of `head(head_modules, stage(blocks, x), targets)` (a
    microbatch's summed token losses) over the batch, by 1F1B over the
    stacked `blocks`; differentiable in the blocks, the head's modules and
    `x_BTD` (the residual stream after the embedding, B split over pp and
    dp as outside a pipeline).

    With `stat_weights` [n] (MoE blocks, whose `stage` returns (x,
    statistics [n]), means over the batch axes already): plus the
    statistics' weighted sum, summed over the stages and averaged over the
    microbatches, as `jaxtp.parallel.pipeline` gives them to the loss. A
    backward tick hands its stage's vjp weights / M as their cotangent."""
    p, M = schedule.stages, schedule.microbatches
    everything, manual = _manual(layout)
    graphdef, params = nnx.split(blocks)
    hgraph, hparams = nnx.split(head_modules)
    param_specs, head_specs, x_spec, t_spec = _in_specs(layout, params, hparams, manual,
                                                        everything)
    tokens = targets_BT.size

    def per_stage(params, hparams, x_nTD, t_nT):
        over = manual & BATCH_SPLIT
        leaves = jax.tree.leaves(param_specs, is_leaf=_is_spec)
        # each parameter as the ticks use it, and the way back for its gradient
        # (FSDP's reduce-scatter, dp's sum; the head's over pp and dp): once
        w, w_back = jax.vjp(lambda ps: jax.tree.map(
            lambda x, s: _enter(x, s, over), ps, jax.tree.unflatten(
                jax.tree.structure(ps), leaves)), params)
        h, h_back = jax.vjp(lambda hs: jax.tree.map(
            lambda x: vary(x, manual & (BATCH_SPLIT | {PP_AXIS})), hs), hparams)
        pin = lambda x: constrain(x, *(None,) * (x.ndim - 3), *layout.residual)
        xs_MbTD = pin(_to_first_stage(pin(x_nTD), p, M))
        ts_MbT = _to_first_stage(t_nT, p, M, to=p - 1)
        vary_all = lambda a: vary(a, manual & (BATCH_SPLIT | {PP_AXIS}))
        run = lambda w, x: stage(nnx.merge(graphdef, w), x)

        def head_loss(h, y, t):
            return head(nnx.merge(hgraph, h), y, t) / tokens

        axes = tuple(sorted(manual & (BATCH_SPLIT | {PP_AXIS})))
        # (the statistics are the same on every batch rank: each adds 1/n of
        # them, so that the loss's one sum over the axes counts them once)
        router = None if stat_weights is None else (
            jnp.asarray(stat_weights / M), math.prod(jax.lax.axis_size(a) for a in axes
                                                     if a != PP_AXIS))
        grads = _ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, p, schedule.repeats, vary_all,
                       router, schedule.stash == "inputs")
        loss, dw, dh, dxs_MbTD = grads
        return (jax.lax.psum(loss, axes), w_back(dw)[0], h_back(dh)[0],
                _from_last_stage(dxs_MbTD, p, pin, frm=0))

    run_all = jax.shard_map(per_stage, in_specs=(param_specs, head_specs, x_spec, t_spec),
                            out_specs=(P(), param_specs, head_specs, x_spec),
                            axis_names=manual, check_vma=True)

    return _kept_grads(run_all)(params, hparams, x_BTD, targets_BT)


def _in_specs(layout: Layout, params, hparams, manual, everything: bool):
    """The region's in-specs, on its manual axes: the stage's parameters
    (under gspmd pp and the experts' ep alone, as `pipeline`'s), the head's
    (none under gspmd), the residual stream's and the targets'."""
    keep = lambda specs, axes: jax.tree.map(lambda s: keep_axes(s, axes), specs,
                                            is_leaf=_is_spec)
    return (keep(nnx.get_partition_spec(params),
                 manual if everything else {PP_AXIS, EP_AXIS} & manual),
            keep(nnx.get_partition_spec(hparams), manual if everything else set()),
            keep_axes(spec(*layout.residual), manual), keep_axes(spec("batch", "seq"), manual))


def _kept_grads(run_all: Callable) -> Callable:
    """The loss of `run_all(*args, targets) -> (loss, *grads)` as a function
    whose forward runs it and keeps the gradients, and whose backward scales
    them by the loss's cotangent (none for the targets)."""
    @jax.custom_vjp
    def loss_of(*args):
        return run_all(*args)[0]

    def forward(*args):
        loss, *grads = run_all(*args)
        return loss, tuple(grads)

    def backward(grads, g):
        return (*jax.tree.map(lambda a: (g * a).astype(a.dtype), grads), None)

    loss_of.defvjp(forward, backward)
    return loss_of


def _ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, p, v, vary_all, router=None,
           inputs: bool = False):
    """The table's ticks (`table`, looped by `phases`): (summed loss, stage
    weights' gradient, head's gradient, stage 0's input gradients [M, b, T,
    D]). `run(w, x)` runs a chunk of the stage's layers (`w` a chunk of
    its v, `_chunk`). A forward files its VJP's residuals that depend on
    its input in the stash; a backward takes them out and applies them to
    its gradient; with `inputs`, a forward files its input alone and the
    backward runs the forward again from it (`jaxtp.checks.PP_STASHES`).
    `router`: (the statistics' weights / M, the batch ranks that add them)
    where `run` returns (y, statistics)."""
    r = jax.lax.axis_index(PP_AXIS)
    M = xs_MbTD.shape[0]
    fwd_table, bwd_table = table(p, M, v)
    fslot, bslot, S = slots(fwd_table, bwd_table)
    FWD, BWD, FSLOT, BSLOT = (jnp.asarray(t) for t in (fwd_table, bwd_table, fslot, bslot))
    T = len(fwd_table)
    last = r == p - 1
    add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
    masked = lambda on, t: jax.tree.map(lambda g: jnp.where(on, g, 0), t)
    # (under v > 1 the shifts are rings: chunk i's last stage to chunk i+1's first)
    ring = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]
    vjp_tree = {}

    def forward(w, x):  # (output, its VJP's leaves)
        out, vjp = jax.vjp(run, w, x)
        leaves, vjp_tree["tree"] = jax.tree.flatten(vjp)
        return out, leaves

    # what a forward keeps for its backward: the residuals that depend on its
    # input, stashed per op; those of a chunk's weights alone (the weights,
    # their casts and reshapes, masks) are computed once per chunk, here
    if inputs:  # (the stash: the input; the forward runs again in the backward)
        def forward(w, x):
            return run(w, x), [x]
    out_type, kept_types, on_x, known = _split_residuals(
        forward, [_chunk(w, i, v) for i in range(v)], xs_MbTD[0], inputs)
    stats_type = out_type[1] if router is not None else None

    def backward(i, kept, g):
        if inputs:
            return jax.vjp(run, _chunk(w, i, v), kept[0])[1](g)
        kept, known_ = iter(kept), iter(known)
        leaves = [next(kept) if x else next(known_)[i] for x in on_x]
        return jax.tree.unflatten(vjp_tree["tree"], leaves)(g)

    def tick(runs_f: bool, runs_b: bool, sends_b: bool = True):
        def body(carry, s):
            stash, fbox, bbox, loss, dw, dh, dxs = carry
            if runs_f:
                n = FWD[s, r]
                on, n = n >= 0, jnp.maximum(n, 0)
                m, i = decode(n, p, v)
                y, kept = forward(_chunk(w, i, v), jnp.where((r == 0) & (i == 0), xs_MbTD[m],
                                                             fbox))
                if router is not None:  # its statistics into the loss
                    (y, stats), (c, k) = y, router
                    loss = loss + jnp.where(on, jnp.dot(c, stats), 0.0) / k
                kept = [a for a, x in zip(kept, on_x) if x]
                j = FSLOT[s, r]
                stash = [a.at[j].set(jnp.where(on, k, a[j])) for a, k in zip(stash, kept)]
                fbox = jax.lax.ppermute(y, PP_AXIS, ring)
            if runs_b:
                nb = BWD[s, r]
                on_b, nb = nb >= 0, jnp.maximum(nb, 0)
                mb, ib = decode(nb, p, v)
                g_y = bbox
                if runs_f:  # the head on the last stage's last chunk: its gradient
                    # is the cotangent of that microbatch's backward, this tick
                    lm, (gh, gy) = jax.value_and_grad(head_loss, argnums=(0, 1))(
                        h, y, ts_MbT[m])
                    mine = last & on & (i == v - 1)
                    loss = loss + jnp.where(mine, lm, 0.0)
                    dh = add(dh, masked(mine, gh))
                    g_y = jnp.where(last & (ib == v - 1), gy.astype(y.dtype), bbox)
                if router is not None:  # the statistics' cotangent: their weights
                    c_stats = vary(jnp.where(on_b, router[0], 0.0), varying_axes(stats_type))
                    g_y = (g_y, c_stats)
                g_w, g_x = backward(ib, [a[BSLOT[s, r]] for a in stash], g_y)
                dw = _add_chunk(dw, masked(on_b, g_w), ib, v)
                into = (r == 0) & on_b & (ib == 0)
                dxs = dxs.at[mb].set(jnp.where(into, g_x, dxs[mb]))
                if sends_b:  # (named: at p = 2 the rings both ways are one permutation)
                    with jax.named_scope(BACK_SHIFT):
                        bbox = jax.lax.ppermute(g_x, PP_AXIS, [(b, a) for a, b in ring])
            return (stash, fbox, bbox, loss, dw, dh, dxs), None
        return body

    # each carry varying over what its updates vary over (under impl
    # shard_map the stream stays invariant over tp, as Megatron's f wants)
    like = lambda a, ref: vary(a, varying_axes(ref) | {PP_AXIS})
    box = like(jnp.zeros(xs_MbTD.shape[1:], xs_MbTD.dtype), xs_MbTD)
    stash = [vary(jnp.zeros((S, *t.shape), t.dtype), varying_axes(t) | {PP_AXIS})
             for t in kept_types]
    carry = (stash, box, box, vary_all(jnp.zeros((), wide(xs_MbTD))),
             jax.tree.map(lambda a: like(jnp.zeros(a.shape, wide(a)), a), w),
             jax.tree.map(lambda a: like(jnp.zeros(a.shape, wide(a)), a), h),
             like(jnp.zeros_like(xs_MbTD), xs_MbTD))
    for begin, end, runs_f, runs_b in phases(p, M, v):
        end -= end == T  # (the last tick, apart: its gradient goes nowhere)
        carry = jax.lax.scan(tick(runs_f, runs_b), carry, jnp.arange(begin, end))[0]
    carry = tick(False, True, sends_b=False)(carry, T - 1)[0]
    _, _, _, loss, dw, dh, dxs = carry
    cast = lambda g, a: jax.tree.map(lambda x, y: x.astype(y.dtype), g, a)
    return loss, cast(dw, w), cast(dh, h), dxs


def _add_chunk(acc, g, i, v: int):
    """`acc` (a stage's stacked gradients) plus `g` at chunk i of v."""
    if v == 1:
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)

    def one(a, b):
        n = a.shape[0] // v
        part = jax.lax.dynamic_slice_in_dim(a, i * n, n) + b.astype(a.dtype)
        return jax.lax.dynamic_update_slice_in_dim(a, part, i * n, 0)
    return jax.tree.map(one, acc, g)


def _split_residuals(forward, chunks: list, x, inputs: bool = False):
    """(`forward`'s output type, the types of its residuals that depend on
    `x`, a flag per residual: whether it does, and for each of those that
    depend on the weights alone its values on every chunk's weights
    [v, ...]), by JAX's partial evaluation of `forward(w, x) -> (out,
    residuals)` with `w` known (private in jax 0.10.2, so tried: without it
    every residual is stashed). With `inputs`, `forward` keeps `x` alone."""
    closed, (out_type, types) = jax.make_jaxpr(forward, return_shape=True)(chunks[0], x)
    if inputs:
        return out_type, types, [True], []
    n_w, n_out = len(jax.tree.leaves(chunks[0])), len(jax.tree.leaves(out_type))
    try:
        from jax._src.interpreters.partial_eval import partial_eval_jaxpr_nounits
    except ImportError:  # pragma: no cover (a later jax)
        return out_type, types, [True] * len(types), []
    known_jaxpr, _, unknown, _ = partial_eval_jaxpr_nounits(
        closed, [False] * n_w + [True] * len(jax.tree.leaves(x)), instantiate=False)
    on_x = unknown[n_out:]
    # (the known jaxpr's outputs: the known outputs, in order, then its own
    # residuals for the unknown part)
    first = unknown[:n_out].count(False)
    per_chunk = [jax.extend.core.jaxpr_as_fun(known_jaxpr)(*jax.tree.leaves(c))
                 [first:first + on_x.count(False)] for c in chunks]
    known = [jnp.stack(vals) for vals in zip(*per_chunk)]
    return out_type, [t for t, u in zip(types, on_x) if u], on_x, known
