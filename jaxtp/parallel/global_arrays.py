"""The `Local`s on global arrays: `GSPMD` pins layouts and XLA's partitioner
places f and g; `Explicit` runs on a mesh of Explicit axes whose types carry
each array's sharding and names each reduction over tp. `GlobalArrays` is
what they share (the math on whole arrays, and how a module runs with it).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from . import context, ep
from .overlap import reread
from .shardmap import run_sharded
from .layout import CP_AXIS, EP_AXIS, Layout, cache_spec, constrain, explicit_mesh, manual_axes, spec


class GlobalArrays:
    """The math of a region on global arrays (each impl says where the
    collectives go: `GSPMD` by pinned layouts, `Explicit` by typed ones)."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def exit(self, h, mm: Callable):
        """The region's output `mm(h)` (the row-parallel matmul): GSPMD sums
        the partial products where `run_region` pins the result."""
        return mm(h)

    def project(self, x_BTD, mm: Callable, out: tuple | None = None):
        """The column-parallel matmul `mm(x)` of an entered input. Under SP's
        overlap, with `out` (the logical axes of mm's output dims after B, T,
        one of them split over tp), x arrives split along T and the output
        is named split over tp: the dot then meets XLA's windowed-einsum
        all-gather pattern (`jaxtp.parallel.overlap`), and the partitioner
        may gather x chunk by chunk inside the matmul's loop. The matmul is
        rematerialised (`overlap.reread`): its weight gradient reads x's
        sequence shard again in the backward pass, so that x has one dot
        consumer per pass (XLA shares one plain all-gather between two)."""
        if not (self.layout.overlap and out is not None):
            return mm(x_BTD)
        return reread(lambda x: self._split_over_tp(mm, x, ("batch", "seq", *out)))(x_BTD)

    def constrain(self, x, *logical):
        return constrain(x, *logical)

    def attend(self, core: Callable, q, k, v):
        """The attention core `core(q, k, v)`: local to each rank's heads;
        under cp, its ranks' parts in a shard_map manual over cp
        (`jaxtp.parallel.context`)."""
        if self.layout.cp > 1:
            return context.over_cp(core, q, k, v, self.layout)
        return core(q, k, v)

    def positions(self, T: int):
        """The original positions of the array's T tokens (`Layout.positions`;
        a cp rank's, in a pipeline's stage, manual over cp)."""
        if CP_AXIS in jax.sharding.get_abstract_mesh().manual_axes:
            return context.local_positions(T, self.layout)
        return jnp.asarray(self.layout.positions(T))

    def kv_for_heads(self, kv_BTCKH, n_heads: int):
        """Replicated kv heads as GSPMD sees them: one kv copy per query head,
        split over tp like the queries (each rank slices its own; the backward
        pass sums the copies, an all-reduce of dkv). Pinning kv replicated
        first also pins its gradient (the transpose of a sharding constraint is
        the same constraint), so dW_kv stays replicated like W_kv; grouping q as
        [K, G] instead would need a tiling over two dims that one mesh axis
        cannot name, and GSPMD then gathers weights."""
        K = kv_BTCKH.shape[3]
        kv_BTCKH = constrain(kv_BTCKH, "batch", "seq", None, None, "head_dim")
        return constrain(jnp.repeat(kv_BTCKH, n_heads // K, axis=3),
                         "batch", "seq", None, "heads", "head_dim")

    def kv_per_rank(self, kv_BTCKH):
        """Replicated kv heads for a KV cache: tp copies split over tp, copy r
        the kv head rank r's query heads use (one per rank, not one per query
        head as in training's `kv_for_heads`)."""
        K, tp = kv_BTCKH.shape[3], self.layout.tp
        kv_BTCKH = constrain(kv_BTCKH, "batch", "seq", None, None, "head_dim")
        return constrain(jnp.repeat(kv_BTCKH, tp // K, axis=3),
                         "batch", "seq", None, "heads", "head_dim")

    def vocab_rows(self, table_VD, ids_BT, dtype):
        """table[ids]: GSPMD masks each shard's rows and sums them at the gather."""
        return _cast_lookup(table_VD, ids_BT, dtype)

    def _by_shard(self, x_BV):
        """[B, V] as [B, tp, V/tp] with the tp dim split: a reduction over the
        last dim stays on each shard, and only [B, tp] values move."""
        B, V = x_BV.shape
        tp = self.layout.tp
        return constrain(x_BV.reshape(B, tp, V // tp), "batch", "vocab", None)

    def row_start(self, B: int):
        """The global index of this array's first row (the arrays are global)."""
        return 0

    def vocab_argmax(self, scores_BV):
        """The lowest id of the highest score [B], from each shard's best."""
        s_BRV = self._by_shard(scores_BV)
        # token ids are int32 (jnp.argmax's are int64 under jax_enable_x64)
        best_BR, at_BR = s_BRV.max(-1), jax.lax.argmax(s_BRV, 2, jnp.int32)
        r_B = jax.lax.argmax(best_BR, 1, jnp.int32)
        return r_B * s_BRV.shape[-1] + jnp.take_along_axis(at_BR, r_B[:, None], 1)[:, 0]

    def vocab_top(self, scores_BV, c: int):
        """Each shard's `c` best (scores, ids), side by side [B, tp*c]."""
        s_BRV = self._by_shard(scores_BV)
        top_BRc, at_BRc = jax.lax.top_k(s_BRV, min(c, s_BRV.shape[-1]))
        ids_BRc = at_BRc + (jnp.arange(s_BRV.shape[1], dtype=jnp.int32) * s_BRV.shape[-1])[:, None]
        B = top_BRc.shape[0]
        return top_BRc.reshape(B, -1), ids_BRc.reshape(B, -1)

    def vocab_start(self, rows: int):
        return 0

    def seq_parts(self) -> int:
        """How many parts the arrays' T is split into over cp (global: cp)."""
        return self.layout.cp


    def batch_per_dp_rank(self, B: int) -> int:
        # the arrays are global over the axes not manual here (a pipeline's,
        # `jaxtp.train.step`'s dp-local gradient accumulation's)
        return self.layout.rows(B, manual_axes())

    def vocab_max(self, v):
        return v

    def vocab_sum(self, v):
        return v

    # how a module runs on global arrays
    def run_region(self, module, x_BTD):
        return module.region(x_BTD, self)

    def run_embed(self, module, ids_BT):
        return module.rows(ids_BT, self)

    def run_losses(self, module, x_BTD, targets_BT):
        if self.layout.sp:  # the final norm stays on its shard (see `GSPMD.run_region`)
            x_BTD = constrain(x_BTD, *self.layout.residual)
        return module.losses(self.enter(x_BTD), targets_BT, self)

    def run_cached(self, module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
        y, k_BSKH, v_BSKH = module.cached_region(x_BTD, k_BSKH, v_BSKH, pos_BT, prefill, self)
        pin = lambda c: jax.lax.with_sharding_constraint(c, cache_spec())
        return constrain(y, *self.layout.residual), pin(k_BSKH), pin(v_BSKH)

    def run_sample(self, module, x_BD, key, **sampling):
        return module.sample(x_BD, key, local=self, **sampling)

    # a MoE layer's experts (`jaxtp.model.moe`): GSPMD places ep's all-to-alls
    # by the slots' layouts; in a pipeline's stage, manual over ep, the slots
    # are the rank's and travel as under shard_map (tp left to GSPMD)
    def place_slots(self, module, x_EGCD, to_experts: bool):
        return ep.placed(x_EGCD, to_experts, module.slots, sent=self.layout.ep > 1)

    def run_experts(self, module, x_EGCD):
        if EP_AXIS in manual_axes():
            return ep.over_ep(lambda x: constrain(module.local(x), *module.slots.out), x_EGCD)
        return constrain(module.local(x_EGCD), *module.slots.out)

    def run_ragged(self, module, local: Callable, *args, arg_specs, out_specs):
        # (the ragged path runs per shard under every impl)
        return run_sharded(module, local, *args, arg_specs=arg_specs, out_specs=out_specs)


class GSPMD(GlobalArrays):
    """A region on global arrays: GSPMD partitions it by the layouts pinned here."""

    def enter(self, x_BTD, mm: Callable | None = None, out: tuple | None = None):
        """The region's input, whole along T (under SP an all-gather), or
        `mm` of it (the column-parallel matmul). Under SP's overlap, x
        stays split along T into a matmul that names its output's split
        (`project`): XLA places the all-gather, as a windowed loop where it can."""
        layout = self.layout
        windowed = layout.overlap and (mm is None or out is not None)
        if windowed:
            x_BTD = constrain(x_BTD, *layout.residual)
        elif layout.sp:
            x_BTD = constrain(x_BTD, "batch", "seq", "embed")
        return x_BTD if mm is None else self.project(x_BTD, mm, out)

    def _split_over_tp(self, mm: Callable, x_BTD, logical: tuple):
        return constrain(mm(x_BTD), *logical)

    def run_region(self, module, x_BTD):
        """Pinning the output replicated (SP: split along T) tells the
        partitioner where g goes; it adds f in the backward pass itself."""
        sp, residual = self.layout.sp, self.layout.residual
        if sp:
            # the norm's output stays on its shard: else GSPMD may gather first
            # and apply the norm's scale to the full-length tensor, whose
            # gradient then needs the whole dX (an all-reduce, not SP's
            # reduce-scatter; seen in XLA's GPU pipeline)
            x_BTD = constrain(x_BTD, *residual)
        y = module.region(x_BTD, self)
        # under the overlap, the row-parallel output goes straight to its
        # split along T: the dot meets XLA's windowed reduce-scatter pattern
        if sp and not self.layout.overlap:
            # full-length first: its transpose pins the incoming gradient too,
            # which GSPMD would otherwise carry split along T into the
            # attention's backward pass (all-to-alls)
            y = constrain(y, "batch", "seq", "embed")
        return constrain(y, *residual)

    def run_embed(self, module, ids_BT):
        """GSPMD sums each shard's rows replicated, then splits along T under
        SP, which XLA's GPU pipeline turns into one reduce-scatter (pinned
        straight to the split, GSPMD would rather gather a small table or
        shuffle the ids)."""
        x_BTD = constrain(module.rows(ids_BT, self), "batch", "seq", "embed")
        return constrain(x_BTD, *self.layout.residual)


class Explicit(GlobalArrays):
    """A region on global arrays whose types carry their shardings (a mesh
    of Explicit axes): JAX's sharding-in-types propagates the column-parallel
    split from the weights, and each reduction over tp is named where it
    happens. Constraints become `reshard`s (`constrain` on an Explicit mesh)."""

    def __init__(self, layout: Layout):
        if not explicit_mesh():
            raise ValueError("impl='explicit' runs on a mesh of Explicit axes, and the mesh "
                             "in context has none (or Auto axes): build it with make_mesh(dp, "
                             "tp, impl='explicit') or mesh_for(mesh, 'explicit') (a "
                             "TrainState's .mesh is one) and call the model under "
                             "`with jax.set_mesh(mesh):`")
        super().__init__(layout)

    def enter(self, x_BTD, mm: Callable | None = None, out: tuple | None = None):
        """Under SP, the all-gather along T is a reshard to the whole
        sequence; under its overlap, the matmul's typed output instead
        (`project`), from x split along T."""
        windowed = self.layout.overlap and (mm is None or out is not None)
        if self.layout.sp and not windowed:
            x_BTD = jax.sharding.reshard(x_BTD, spec("batch", "seq", "embed"))
        return x_BTD if mm is None else self.project(x_BTD, mm, out)

    def _split_over_tp(self, mm: Callable, x_BTD, logical: tuple):
        # both operands split over tp (x along T, the weight on its output
        # dim): the types cannot tell the output's split, so it is named
        return mm(x_BTD, out_sharding=spec(*logical))

    def attend(self, core: Callable, q, k, v):
        """The attention kernels are opaque to the types: blockwise's loop
        carries start untyped (they meet sharded values in its custom VJP),
        cuDNN partitions itself and hands back untyped cotangents. So the core
        runs in Auto mode (`auto_axes`), split by heads as its operands are,
        its output typed like q (under cp: `GlobalArrays.attend` there)."""
        return jax.sharding.auto_axes(lambda q, k, v: super(Explicit, self).attend(core, q, k, v),
                                      axes=_free_axes(),
                                      out_sharding=jax.typeof(q).sharding)(q, k, v)

    def exit(self, h, mm: Callable):
        """The row-parallel contraction runs over the tp-split dim of both
        operands, so its output sharding is ambiguous and JAX requires it named
        (`out_sharding`): replicated over tp is g (an all-reduce), split along
        T under SP is g_sp (a reduce-scatter)."""
        return mm(h, out_sharding=spec(*self.layout.residual))

    def vocab_rows(self, table_VD, ids_BT, dtype):
        """table[ids] from a table split over tp along V: JAX cannot tell the
        gather's output sharding from the operands' (the indexed dim is the
        split one), so it is named: the residual's sharding (under SP split
        along T). With `out_sharding`, JAX computes the gather in Auto mode
        (`auto_axes`): GSPMD partitions it as in impl gspmd (each shard's
        masked rows, summed: an all-reduce, or under SP a reduce-scatter) and
        the result is typed again."""
        rows_BTD = _cast_lookup(table_VD, ids_BT, dtype, spec("batch", "seq", "embed"))
        # under SP, the split along T after the sum (named as the gather's
        # output, GSPMD gathers the small table instead and reduces its
        # gradient over tp)
        return jax.sharding.reshard(rows_BTD, spec(*self.layout.residual))

    def kv_for_heads(self, kv_BTCKH, n_heads: int):
        """Replicated kv heads [B, T, C, K, H] -> [B, T, C, tp, H] split over
        tp: copy r the kv head rank r's query heads use, as in shard_map.
        Picked by a 0/1 matrix [K, tp] split over tp, so that the backward
        pass is a contraction over tp named replicated: one all-reduce of the
        kv gradient. (GSPMD's repeat to one copy per query head, resharded,
        types its gradient as an all-gather of every copy, tp/K times larger.)"""
        K, tp = kv_BTCKH.shape[3], self.layout.tp
        pick_KR = jax.sharding.reshard(
            (jnp.arange(K)[:, None] == jnp.arange(tp)[None] * K // tp).astype(kv_BTCKH.dtype),
            spec(None, "heads"))
        return jnp.einsum("BTCKH,KR->BTCRH", kv_BTCKH, pick_KR,
                          precision=jax.lax.Precision.HIGHEST,  # a copy, exact in any dtype
                          out_sharding=spec("batch", "seq", None, "heads", "head_dim"))

    def run_experts(self, module, x_EGCD):
        """The types carry the split; the sum over tp is the down-projection's,
        named by its output's sharding."""
        return module.local(x_EGCD, spec(*module.slots.out))

    def run_ragged(self, module, local: Callable, *args, arg_specs, out_specs):
        raise ValueError("the ragged MoE dispatch is not built for impl 'explicit' yet")


def _free_axes() -> tuple[str, ...]:
    """The mesh axes not manual in context (inside `jaxtp.train.step`'s
    dp-local accumulation, dp is manual)."""
    return tuple(a for a in jax.sharding.get_abstract_mesh().axis_names
                 if a not in manual_axes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cast_lookup(table_VD, ids_BT, dtype, out=None):
    """table[ids] in `dtype`, gathered from the table cast to it, so that the
    rows are summed over tp in the compute dtype (GSPMD sums them right at the
    gather, before any later cast). Every id is a valid row (the data is
    checked against the vocabulary); the gradient is scatter-added in the
    table's dtype, as a plain lookup's would be. `out`: the rows' sharding
    (impl explicit; see `Explicit.vocab_rows`)."""
    return table_VD.astype(dtype).at[ids_BT].get(mode="promise_in_bounds", out_sharding=out)


def _cast_lookup_fwd(table_VD, ids_BT, dtype, out):
    return _cast_lookup(table_VD, ids_BT, dtype, out), (ids_BT, jnp.zeros_like(table_VD))


def _cast_lookup_bwd(dtype, out, res, dx_BTD):
    ids_BT, zeros_VD = res
    # explicit: a scatter into the split dim has no sharding rule either; the
    # gradient is named the table's own sharding
    table = None if out is None else jax.typeof(zeros_VD).sharding
    return zeros_VD.at[ids_BT].add(dx_BTD.astype(zeros_VD.dtype), out_sharding=table), None


_cast_lookup.defvjp(_cast_lookup_fwd, _cast_lookup_bwd)
