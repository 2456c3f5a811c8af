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

The zero-bubble schedule (`Schedule.split`) runs the same table with each
backward in two (`jaxtp.parallel.vjp_split`): B, the input's gradient, in
the backward's tick, and W, the weights', in the tick stage 0 runs that
op's B (`weights`), from the forward's residuals (their slot freed by W)
and what B filed for it in a second stash: no W on dropped data.

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
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .collectives import vary, varying_axes, wide
from .layout import EP_AXIS, PP_AXIS, Layout, constrain, keep_axes, spec
from .pipeline import (BATCH_SPLIT, _chunk, _enter, _from_last_stage, _is_spec, _manual,
                       _to_first_stage)
from .pipeline_table import decode, phases, reading, slots, table, weights
from .vjp_split import chunk_split, chunk_vjp


# the name scope of the backward shift, which the compiled program's reader
# tells from the forward one by it (`jaxtp.analysis.pp.compiled_ticks`)
BACK_SHIFT = "pp_back"


def pipeline_1f1b(stage: Callable, head: Callable, blocks, head_modules, x_BTD, targets_BT,
                  layout: Layout, schedule, stat_weights: np.ndarray | None = None,
                  units: tuple[Callable, Callable] | None = None):
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
        split = schedule.split and (units, graphdef)
        grads = _ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, p, schedule.repeats, vary_all,
                       router, schedule.stash == "inputs", split)
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
           inputs: bool = False, split=None):
    """The table's ticks (`table`, looped by `phases`): (summed loss, stage
    weights' gradient, head's gradient, stage 0's input gradients [M, b, T,
    D]). `run(w, x)` runs a chunk of the stage's layers (`w` a chunk of
    its v, `_chunk`). A forward files its VJP's residuals that depend on
    its input in the stash; a backward takes them out and applies them to
    its gradient; with `inputs`, a forward files its input alone and the
    backward runs the forward again from it (`jaxtp.checks.PP_STASHES`).
    `split` ((enter, unit), graphdef): the backward in two, B filing what
    W needs in a second stash, W in the tick stage 0 runs B (`weights`).
    `router`: (the statistics' weights / M, the batch ranks that add them)
    where `run` returns (y, statistics)."""
    ticks = _Ticks(run, head_loss, w, h, xs_MbTD, ts_MbT, p, v, router, inputs, split)
    carry, T = ticks.start(vary_all), ticks.T
    for begin, end, runs_f, runs_b, runs_w in phases(p, xs_MbTD.shape[0], v, bool(split)):
        end -= end == T  # (the last tick, apart: its gradient goes nowhere)
        carry = jax.lax.scan(ticks.body(runs_f, runs_b, runs_w), carry,
                             jnp.arange(begin, end))[0]
    carry = ticks.body(False, True, bool(split), sends_b=False)(carry, T - 1)[0]
    _, _, _, loss, dw, dh, dxs = carry
    cast = lambda g, a: jax.tree.map(lambda x, y: x.astype(y.dtype), g, a)
    return loss, cast(dw, w), cast(dh, h), dxs


class _Ticks:
    """One stage's view of the table: its ops' forward and backward (under
    `split`, B and W), and the carry they update (the stashes, the mailboxes
    each way, loss, gradients, stage 0's input gradients)."""

    def __init__(self, run, head_loss, w, h, xs_MbTD, ts_MbT, p, v, router, inputs, split):
        self.head_loss, self.w, self.h, self.xs, self.ts = head_loss, w, h, xs_MbTD, ts_MbT
        self.p, self.v, self.router, self.split = p, v, router, bool(split)
        self.r = jax.lax.axis_index(PP_AXIS)
        fwd, bwd = table(p, xs_MbTD.shape[0], v)
        wgt = weights(bwd) if split else bwd  # (the F stash's freeing read)
        fslot, wslot, self.S = slots(fwd, wgt)
        tables = [fwd, bwd, wgt, fslot, reading(fwd, fslot, bwd), wslot]
        self.S_W = 0  # W's own stash (zb's): from its B to its W
        if split:
            bslot, vslot, self.S_W = slots(bwd, wgt)
            tables += [bslot, vslot]
        self.tables = [jnp.asarray(t) for t in tables]
        self.T = len(fwd)
        # (under v > 1 the shifts are rings: chunk i's last stage to chunk i+1's first)
        self.ring = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]
        chunks = [_chunk(w, i, v) for i in range(v)]
        if split:
            (enter, unit), graphdef = split
            (self.forward, self.backward_input, self.backward_weights, out_type,
             self.kept_types, self.saved_types) = chunk_split(unit, enter, graphdef, chunks[0],
                                                              xs_MbTD[0])
        else:
            self.forward, self.backward, out_type, self.kept_types = chunk_vjp(
                run, chunks, xs_MbTD[0], inputs)
            self.saved_types = []
        self.stats_type = out_type[1] if router is not None else None

    def start(self, vary_all):
        """The carry before the first tick, each part varying over what its
        updates vary over (under impl shard_map the stream stays invariant
        over tp, as Megatron's f wants)."""
        like = lambda a, ref: vary(a, varying_axes(ref) | {PP_AXIS})
        zeros = lambda tree: jax.tree.map(lambda a: like(jnp.zeros(a.shape, wide(a)), a), tree)
        box = like(jnp.zeros(self.xs.shape[1:], self.xs.dtype), self.xs)
        stash = lambda n, types: [vary(jnp.zeros((n, *t.shape), t.dtype),
                                       varying_axes(t) | {PP_AXIS}) for t in types]
        stashes = (stash(self.S, self.kept_types),
                   stash(self.S_W, jax.tree.leaves(self.saved_types)))
        return (stashes, box, box, vary_all(jnp.zeros((), wide(self.xs))), zeros(self.w),
                zeros(self.h), like(jnp.zeros_like(self.xs), self.xs))

    def body(self, runs_f: bool, runs_b: bool, runs_w: bool = False, sends_b: bool = True):
        """A tick of a loop that runs forwards, backwards (under `split`:
        input gradients), weight gradients, or some of them (`phases`)."""
        def tick(carry, s):
            ran = None
            if runs_f:
                carry, ran = self._forward_op(carry, s)
            if runs_b:
                carry = self._backward_op(carry, s, ran, sends_b)
            if runs_w:
                carry = self._weights_op(carry, s)
            return carry, None
        return tick

    def _at(self, k: int, s):
        """Table k's entry for this stage at tick s (`__init__`'s order)."""
        return self.tables[k][s, self.r]

    def _forward_op(self, carry, s):
        """The tick's forward: the op's chunk on its input (stage 0's chunk 0:
        the microbatch), its residuals filed, its output sent on."""
        (stash, saved), fbox, bbox, loss, dw, dh, dxs = carry
        n = self._at(0, s)
        on, n = n >= 0, jnp.maximum(n, 0)
        m, i = decode(n, self.p, self.v)
        first = (self.r == 0) & (i == 0)
        y, kept = self.forward(_chunk(self.w, i, self.v), jnp.where(first, self.xs[m], fbox))
        if self.router is not None:  # its statistics into the loss
            (y, stats), (c, k) = y, self.router
            loss = loss + jnp.where(on, jnp.dot(c, stats), 0.0) / k
        stash = _file(stash, kept, self._at(3, s), on)
        fbox = jax.lax.ppermute(y, PP_AXIS, self.ring)
        return ((stash, saved), fbox, bbox, loss, dw, dh, dxs), (y, m, i, on)

    def _backward_op(self, carry, s, ran, sends_b: bool):
        """The tick's backward: the op's residuals out of the stash, applied
        to its gradient (the last stage's last chunk: the head's, taken on
        this tick's forward), the weights' gradient added (under `split`:
        W's inputs filed instead), the input's sent back (stage 0's chunk 0:
        kept)."""
        (stash, saved), fbox, bbox, loss, dw, dh, dxs = carry
        last, v = self.r == self.p - 1, self.v
        n = self._at(1, s)
        on, n = n >= 0, jnp.maximum(n, 0)
        m, i = decode(n, self.p, v)
        g_y = bbox
        if ran is not None:  # the head on the last stage's last chunk
            y, mf, i_f, on_f = ran
            lm, (gh, gy) = jax.value_and_grad(self.head_loss, argnums=(0, 1))(
                self.h, y, self.ts[mf])
            mine = last & on_f & (i_f == v - 1)
            loss = loss + jnp.where(mine, lm, 0.0)
            dh = _add(dh, _masked(mine, gh))
            g_y = jnp.where(last & (i == v - 1), gy.astype(y.dtype), bbox)
        if self.router is not None:  # the statistics' cotangent: their weights
            g_y = (g_y, vary(jnp.where(on, self.router[0], 0.0), varying_axes(self.stats_type)))
        kept = [a[self._at(4, s)] for a in stash]
        if self.split:
            g_x, hand = self.backward_input(_chunk(self.w, i, v), kept, g_y)
            saved = _file(saved, jax.tree.leaves(hand), self._at(6, s), on)
        else:
            g_w, g_x = self.backward(i, _chunk(self.w, i, v), kept, g_y)
            dw = _add_chunk(dw, _masked(on, g_w), i, v)
        dxs = dxs.at[m].set(jnp.where((self.r == 0) & on & (i == 0), g_x, dxs[m]))
        if sends_b:  # (named: at p = 2 the rings both ways are one permutation)
            with jax.named_scope(BACK_SHIFT):
                bbox = jax.lax.ppermute(g_x, PP_AXIS, [(b, a) for a, b in self.ring])
        return (stash, saved), fbox, bbox, loss, dw, dh, dxs

    def _weights_op(self, carry, s):
        """The tick's W (under `split`): the op whose B stage 0 runs this tick,
        from its residuals and what its B filed, into the weights' gradient."""
        (stash, saved), fbox, bbox, loss, dw, dh, dxs = carry
        n = self._at(2, s)
        on, n = n >= 0, jnp.maximum(n, 0)
        i = decode(n, self.p, self.v)[1]
        hand = jax.tree.unflatten(jax.tree.structure(self.saved_types),
                                  [a[self._at(7, s)] for a in saved])
        g_w = self.backward_weights(_chunk(self.w, i, self.v),
                                    [a[self._at(5, s)] for a in stash], hand)
        dw = _add_chunk(dw, _masked(on, g_w), i, self.v)
        return (stash, saved), fbox, bbox, loss, dw, dh, dxs


def _file(stash: list, values: list, j, on) -> list:
    """`values` into slot j of the stash's arrays, where `on`."""
    return [a.at[j].set(jnp.where(on, x, a[j])) for a, x in zip(stash, values)]


def _add(acc, g):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)


def _masked(on, tree):
    return jax.tree.map(lambda g: jnp.where(on, g, 0), tree)


def _add_chunk(acc, g, i, v: int):
    """`acc` (a stage's stacked gradients) plus `g` at chunk i of v."""
    if v == 1:
        return _add(acc, g)

    def one(a, b):
        n = a.shape[0] // v
        part = jax.lax.dynamic_slice_in_dim(a, i * n, n) + b.astype(a.dtype)
        return jax.lax.dynamic_update_slice_in_dim(a, part, i * n, 0)
    return jax.tree.map(one, acc, g)
