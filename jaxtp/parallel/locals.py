"""The `Local`s: how a region's local math reaches the other tp ranks.

`GSPMD` works on global arrays and pins layouts for the partitioner;
`Explicit` works on global arrays whose types carry their shardings and
names each reduction; `ShardMap` works per shard inside `jax.shard_map` with
f, g and the loss reductions written out; `Ring` is `ShardMap` with SP's
entry and exit as collective-matmul rings. `jaxtp.parallel.regions` picks
one by the `Layout`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from .collectives import f, f_sp, g, g_sp, gather, pmax, pmin, rank
from .layout import DATA_AXIS, Layout, constrain, explicit_mesh, spec
from .overlap import allgather_matmul, matmul_reducescatter


class GSPMD:
    """A region on global arrays: GSPMD partitions it by the layouts pinned here."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def enter(self, x_BTD, mm: Callable | None = None):
        """The region's input, whole along T (under SP an all-gather), or
        `mm` of it (the column-parallel matmul)."""
        x_BTD = constrain(x_BTD, "batch", "seq", "embed") if self.layout.sp else x_BTD
        return x_BTD if mm is None else mm(x_BTD)

    def exit(self, h, mm: Callable):
        """The region's output `mm(h)` (the row-parallel matmul): GSPMD sums
        the partial products where `region` pins the result."""
        return mm(h)

    def constrain(self, x, *logical):
        return constrain(x, *logical)

    def attend(self, kernel: Callable, q, k, v):
        """The attention core `kernel(q, k, v)`: local to each rank's heads."""
        return kernel(q, k, v)

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
        best_BR, at_BR = s_BRV.max(-1), s_BRV.argmax(-1)
        r_B = best_BR.argmax(-1)
        return r_B * s_BRV.shape[-1] + jnp.take_along_axis(at_BR, r_B[:, None], 1)[:, 0]

    def vocab_top(self, scores_BV, c: int):
        """Each shard's `c` best (scores, ids), side by side [B, tp*c]."""
        s_BRV = self._by_shard(scores_BV)
        top_BRc, at_BRc = jax.lax.top_k(s_BRV, min(c, s_BRV.shape[-1]))
        ids_BRc = at_BRc + (jnp.arange(s_BRV.shape[1]) * s_BRV.shape[-1])[:, None]
        B = top_BRc.shape[0]
        return top_BRc.reshape(B, -1), ids_BRc.reshape(B, -1)

    def vocab_start(self, rows: int):
        return 0

    def batch_per_dp_rank(self, B: int) -> int:
        return B // self.layout.dp  # the arrays are global

    def vocab_max(self, v):
        return v

    def vocab_sum(self, v):
        return v


class Explicit(GSPMD):
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

    def enter(self, x_BTD, mm: Callable | None = None):
        """Under SP, the all-gather along T is a reshard to the whole sequence."""
        if self.layout.sp:
            x_BTD = jax.sharding.reshard(x_BTD, spec("batch", "seq", "embed"))
        return x_BTD if mm is None else mm(x_BTD)

    def attend(self, kernel: Callable, q, k, v):
        """The attention kernels are opaque to the types: blockwise's loop
        carries start untyped (they meet sharded values in its custom VJP),
        cuDNN partitions itself and hands back untyped cotangents. So the core
        runs in Auto mode (`auto_axes`), split by heads as its operands are,
        its output typed like q."""
        return jax.sharding.auto_axes(kernel, out_sharding=jax.typeof(q).sharding)(q, k, v)

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


class ShardMap:
    """A region per tp shard inside jax.shard_map: f and g written out."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def enter(self, x_BTD, mm: Callable | None = None):
        """f (SP: f_sp, an all-gather along T), then `mm`."""
        x_BTD = f_sp(x_BTD) if self.layout.sp else f(x_BTD)
        return x_BTD if mm is None else mm(x_BTD)

    def exit(self, h, mm: Callable):
        """This rank's partial product `mm(h)`, then g (SP: g_sp, a
        reduce-scatter along T)."""
        return (g_sp if self.layout.sp else g)(mm(h))

    def constrain(self, x, *logical):
        return x

    def attend(self, kernel: Callable, q, k, v):
        return kernel(q, k, v)

    def kv_for_heads(self, kv_BTCKH, n_heads: int):
        """This rank's N/tp query heads all use one kv head: its slice."""
        group = n_heads * self.layout.tp // kv_BTCKH.shape[3]  # query heads per kv head
        return jax.lax.dynamic_slice_in_dim(kv_BTCKH, rank() * n_heads // group, 1, 3)

    def kv_per_rank(self, kv_BTCKH):
        """The kv head this rank's query heads use, for its KV cache."""
        K = kv_BTCKH.shape[3]
        return jax.lax.dynamic_slice_in_dim(kv_BTCKH, rank() * K // self.layout.tp, 1, 3)

    def row_start(self, B: int):
        """The global index of this dp rank's first row (of B)."""
        return jax.lax.axis_index(DATA_AXIS) * B if self.layout.dp > 1 else 0

    def vocab_argmax(self, scores_BV):
        """The lowest id of the highest score over every shard [B]: a max and a
        min of B values over tp."""
        best_B = pmax(scores_BV.max(-1))
        at_B = scores_BV.argmax(-1) + self.vocab_start(scores_BV.shape[-1])
        return pmin(jnp.where(scores_BV.max(-1) == best_B, at_B, jnp.iinfo(at_B.dtype).max))

    def vocab_top(self, scores_BV, c: int):
        """Each shard's `c` best (scores, ids), side by side [B, tp*c]."""
        top_Bc, at_Bc = jax.lax.top_k(scores_BV, min(c, scores_BV.shape[-1]))
        return gather(top_Bc, 1), gather(at_Bc + self.vocab_start(scores_BV.shape[-1]), 1)

    def vocab_rows(self, table_VD, ids_BT, dtype):
        """This rank's rows of table[ids]; zero for the ids other ranks hold."""
        start = self.vocab_start(table_VD.shape[0])
        local_BT = ids_BT - start
        hit_BT = (local_BT >= 0) & (local_BT < table_VD.shape[0])
        x_BTD = jnp.take(table_VD, jnp.where(hit_BT, local_BT, 0), axis=0)
        return jnp.where(hit_BT[..., None], x_BTD, 0).astype(dtype)  # g sums in dtype

    def vocab_start(self, rows: int):
        return rank() * rows

    def batch_per_dp_rank(self, B: int) -> int:
        return B  # the arrays are this rank's

    def vocab_max(self, v):
        return pmax(v)

    def vocab_sum(self, v):
        return g(v)


class Ring(ShardMap):
    """`ShardMap` under SP with each region's entry and exit as collective-
    matmul rings: tp - 1 ppermutes of one sequence chunk each, a chunk's
    matmul running while the next one travels. Only the blocks' regions use
    it: the embedding's reduce-scatter and the LM head's all-gather (whose
    matmul runs per loss chunk) are not overlapped yet."""

    def enter(self, x_BtD, mm: Callable | None = None):
        return super().enter(x_BtD) if mm is None else allgather_matmul(x_BtD, mm)

    def exit(self, h, mm: Callable):
        return matmul_reducescatter(h, mm)


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
