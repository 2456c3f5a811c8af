"""The 1F1B pipeline schedule (PipeDream-flush: Narayanan et al. 2021, Sec.
2.2.1): each stage runs a microbatch's backward as soon as its gradient
arrives, so stage r holds at most p - r microbatches' inputs, not M.

SPMD, as `jaxtp.parallel.pipeline`'s GPipe: every stage runs the same tick,
a forward and a backward of its layers (`jax.vjp`), on what a static table
says: a forward tick feeds a new input and a zero cotangent, a backward
tick the stashed input of that microbatch (its forward recomputed: only
stage inputs are kept) and the gradient that came back. So 1F1B's 2(M+p-1)
ticks each cost one forward and one backward: twice GPipe's compute, for
p/M of its activations (MaxText, maxtext#752, finds 1F1B to need MPMD to
save the compute; on XLA:CPU a `lax.cond` per stage, which would skip the
idle half, deadlocks in the permutes' rendezvous, measured on jax 0.10.2).

The head (final norm, LM head, loss) runs on the last stage inside the
loop: its gradient starts each microbatch's backward. The whole schedule
is one `jax.custom_vjp` whose forward runs every tick and keeps the
gradients; the step's autodiff multiplies them by the loss's cotangent and
carries the input gradient on to the embedding.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .collectives import vary, varying_axes, wide
from .layout import EP_AXIS, PP_AXIS, Layout, constrain, keep_axes, spec
from .pipeline import BATCH_SPLIT, _enter, _from_last_stage, _is_spec, _manual, _to_first_stage

IDLE, FORWARD, BACKWARD = 0, 1, 2


def table(p: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """(op [ticks, p], microbatch [ticks, p]): PipeDream-flush's order per
    stage (p-1-r forwards, then one backward per forward, then the last
    backwards), each op at the first tick its input has arrived (a forward
    the tick after the stage before ran it, a backward the tick after the
    stage after ran its own, or after this stage's own forward on the last).
    2(M + p - 1) ticks. Checks that the p mailbox slots (microbatch mod p)
    and the p stash slots are never overwritten before they are read."""
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, M)
        seq = [(FORWARD, m) for m in range(warm)]
        for m in range(M):
            if warm + m < M:
                seq.append((FORWARD, warm + m))
            seq.append((BACKWARD, m))
        orders.append(seq)
    done, ptr, rows = {}, [0] * p, []
    while any(ptr[r] < len(orders[r]) for r in range(p)):
        t, row = len(rows), []
        for r in range(p):
            op, m = orders[r][ptr[r]] if ptr[r] < len(orders[r]) else (IDLE, 0)
            before = ((FORWARD, r - 1, m) if op == FORWARD else
                      (FORWARD, r, m) if r == p - 1 else (BACKWARD, r + 1, m))
            ready = op != IDLE and (op == FORWARD and r == 0 or done.get(before, t) < t)
            row.append((op, m) if ready else (IDLE, 0))
            if ready:
                done[op, r, m] = t
                ptr[r] += 1
        rows.append(row)
    ops = np.array([[op for op, _ in row] for row in rows], np.int32)
    mbs = np.array([[m for _, m in row] for row in rows], np.int32)
    for r in range(p):
        for m in range(M - p):  # slot m % p is m + p's only after m's was read
            assert done[FORWARD, r, m + p] > done[BACKWARD, r, m]  # the stash
            if r:
                assert done[FORWARD, r - 1, m + p] >= done[FORWARD, r, m]
            if r < p - 1:
                assert done[BACKWARD, r + 1, m + p] >= done[BACKWARD, r, m]
    return ops, mbs


def in_flight(ops: np.ndarray, stage: int = 0) -> int:
    """The most microbatches whose input `stage` holds at once (forwarded,
    not yet backwarded)."""
    held = np.cumsum(ops[:, stage] == FORWARD) - np.cumsum(ops[:, stage] == BACKWARD)
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
    ops, mbs = table(p, M)

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
        grads = _ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, ops, mbs, p, vary_all, router)
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


def _ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, ops, mbs, p, vary_all, router=None):
    """The table's ticks: (summed loss, stage weights' gradient, head's
    gradient, stage 0's input gradients [M, b, T, D]); every stage runs a
    forward and a backward per tick, masked by its op. `router`: (the
    statistics' weights / M, the batch ranks that add them) where `run`
    returns (y, statistics)."""
    r = jax.lax.axis_index(PP_AXIS)
    OPS, MBS = jnp.asarray(ops), jnp.asarray(mbs)
    b_shape = xs_MbTD.shape[1:]
    zeros_w = jax.tree.map(lambda a: jnp.zeros(a.shape, wide(a)), w)
    zeros_h = jax.tree.map(lambda a: jnp.zeros(a.shape, wide(a)), h)
    add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)

    def tick(carry, s):
        stash, fbox, bbox, loss, dw, dh, dxs = carry
        op, m = OPS[s, r], MBS[s, r]
        slot = m % p
        fwd, bwd, last = op == FORWARD, op == BACKWARD, r == p - 1
        x_in = jnp.where(r == 0, xs_MbTD[m], fbox[slot])
        stash = jnp.where(fwd, stash.at[slot].set(x_in), stash)
        y, vjp = jax.vjp(run, w, jnp.where(bwd, stash[slot], x_in))
        if router is not None:  # a forward's statistics into the loss; a backward's
            # cotangent for them, the weights (a recomputed forward's are unused)
            (y, stats), (c, n) = y, router
            loss = loss + jnp.where(fwd, jnp.dot(c, stats), 0.0) / n
            c_stats = vary(jnp.where(bwd, c, 0.0), varying_axes(stats))
        # the head on the last stage's forward: its gradient is the cotangent
        # of that microbatch's backward, filed in the stage's own mailbox
        lm, (gh, gy) = jax.value_and_grad(head_loss, argnums=(0, 1))(h, y, ts_MbT[m])
        mine = last & fwd
        loss = loss + jnp.where(mine, lm, 0.0)
        dh = add(dh, jax.tree.map(lambda g: jnp.where(mine, g, 0), gh))
        g_y = jnp.where(bwd, bbox[slot], 0).astype(y.dtype)
        g_w, g_x = vjp(g_y if router is None else (g_y, c_stats))
        dw = add(dw, g_w)  # (zero on a forward tick: a zero cotangent)
        dxs = jnp.where((r == 0) & bwd, dxs.at[m].set(g_x), dxs)
        sent_f = jax.lax.ppermute(y, PP_AXIS, [(i, i + 1) for i in range(p - 1)])
        sent_b = jax.lax.ppermute(g_x, PP_AXIS, [(i + 1, i) for i in range(p - 1)])
        # what arrived, filed by the sender's microbatch (the table is static)
        prev, nxt = jnp.maximum(r - 1, 0), jnp.minimum(r + 1, p - 1)
        got_f = (r > 0) & (OPS[s, prev] == FORWARD)
        got_b = (r < p - 1) & (OPS[s, nxt] == BACKWARD)
        fbox = jnp.where(got_f, fbox.at[MBS[s, prev] % p].set(sent_f), fbox)
        bbox = jnp.where(got_b, bbox.at[MBS[s, nxt] % p].set(sent_b), bbox)
        bbox = jnp.where(mine, bbox.at[slot].set(gy.astype(bbox.dtype)), bbox)
        return (stash, fbox, bbox, loss, dw, dh, dxs), None

    # each carry varying over what its updates vary over (under impl
    # shard_map the stream stays invariant over tp, as Megatron's f wants)
    like = lambda a, ref: vary(a, varying_axes(ref) | {PP_AXIS})
    box = like(jnp.zeros((p, *b_shape), xs_MbTD.dtype), xs_MbTD)
    start = (box, box, box, vary_all(jnp.zeros((), wide(xs_MbTD))),
             jax.tree.map(like, zeros_w, w), jax.tree.map(like, zeros_h, h),
             like(jnp.zeros_like(xs_MbTD), xs_MbTD))
    (_, _, _, loss, dw, dh, dxs), _ = jax.lax.scan(tick, start, jnp.arange(len(ops)))
    cast = lambda g, a: jax.tree.map(lambda x, y: x.astype(y.dtype), g, a)
    return loss, cast(dw, w), cast(dh, h), dxs
