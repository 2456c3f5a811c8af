"""Where each implementation puts the tp collectives of a region.

The model's regions are local math over a `Local`: `module.region(x, local)`
takes the replicated (under SP: sequence-split) input to the output summed
over tp, entering through `local.enter(x, mm)` (f, and the column-parallel
matmul `mm`) and leaving through `local.exit(h, mm)` (the row-parallel
matmul `mm`, and g); `module.rows(ids, local)` looks up token rows and
`module.losses(x, targets, local)` computes the vocab-parallel
cross-entropy. `Local` says how that math reaches the other tp ranks:

- `GSPMD`: the arrays are global; it pins layouts and the partitioner places
  f and g (and their SP forms) from them.
- `ShardMap`: the math runs per shard inside `jax.shard_map(check_vma=True)`
  over the module's own parameters (in_specs read from each weight's
  PartitionSpec), with f, g, f_sp, g_sp and the loss reductions written out.
- `Ring`: `ShardMap` with SP's entry and exit matmuls as collective-matmul
  rings of ppermutes (`jaxtp.parallel.overlap`).

`region`, `embed` and `vocab_losses` run a module one way or the other by
its `Layout`. A new way to communicate is one more `Local` and one more
branch here, not edits in the model.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .collectives import f, f_sp, g, g_sp, gather, pmax, pmin, rank
from .layout import DATA_AXIS, IMPL_AXIS, Layout, constrain
from .overlap import allgather_matmul, matmul_reducescatter

BF16_CPU_SHARD_MAP = ("impl='shard_map' with model.dtype=bfloat16 crashes XLA's CPU compiler "
                      "(jax 0.10.2); on CPU use model.dtype=float32 (or float16), or "
                      "impl=gspmd")


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


def region(module, x_BTD):
    """`module.region` from replicated x (SP: split along T) to its output
    summed over tp: the row-parallel bias is added by the caller.

    GSPMD: pinning the output replicated tells the partitioner where g goes;
    it adds f in the backward pass itself. shard_map: f and g written out by
    the `Local` (as rings under `layout.overlap`).
    The sum carries the remat name `module.tag`: every remat policy keeps it
    (jaxtp.model.transformer.REMAT_POLICIES), so recomputing a block in the
    backward pass never repeats g's collective.
    """
    layout = module.layout
    if layout.impl == "shard_map":
        spec, local = act_spec(layout.sp), (Ring if layout.overlap else ShardMap)(layout)
        y = run_sharded(module, lambda m, x: m.region(x, local), x_BTD, arg_specs=(spec,),
                        out_specs=spec, vary_params=layout.overlap)
    else:
        if layout.sp:
            # the norm's output stays on its shard: else GSPMD may gather first
            # and apply the norm's scale to the full-length tensor, whose
            # gradient then needs the whole dX (an all-reduce, not SP's
            # reduce-scatter; seen in XLA's GPU pipeline)
            x_BTD = constrain(x_BTD, *layout.residual)
        y = module.region(x_BTD, GSPMD(layout))
        if layout.sp:
            # full-length first: its transpose pins the incoming gradient too,
            # which GSPMD would otherwise carry split along T into the
            # attention's backward pass (all-to-alls)
            y = constrain(y, "batch", "seq", "embed")
        y = constrain(y, *layout.residual)
    return checkpoint_name(y, module.tag)


def embed(module, ids_BT):
    """`module.rows(ids, local)`: token rows, replicated over tp (SP: split
    along T). shard_map sums each rank's partial rows (g, or g_sp); GSPMD sums
    them replicated, then splits along T, which XLA's GPU pipeline turns into
    one reduce-scatter (pinned straight to the split, GSPMD would rather
    gather a small table or shuffle the ids)."""
    layout = module.layout
    if layout.impl == "shard_map":
        exit_ = g_sp if layout.sp else g
        local = ShardMap(layout)
        return run_sharded(module, lambda m, ids: exit_(m.rows(ids, local)), ids_BT,
                           out_specs=act_spec(layout.sp))
    x_BTD = constrain(module.rows(ids_BT, GSPMD(layout)), "batch", "seq", "embed")
    return constrain(x_BTD, *layout.residual)


def vocab_losses(module, x_BTD, targets_BT):
    """`module.losses(x, targets, local)`: per-token cross-entropy [B, T] from
    vocab-sharded logits. The input enters as a region's does (f once, on the
    whole input, so dX is reduced once); the three statistics are reduced
    over tp by the `Local`."""
    layout = module.layout
    if layout.impl == "shard_map":
        local = ShardMap(layout)
        return run_sharded(module, lambda m, x, t: m.losses(local.enter(x), t, local),
                           x_BTD, targets_BT, arg_specs=(act_spec(layout.sp), act_spec()))
    local = GSPMD(layout)
    if layout.sp:  # the final norm stays on its shard (see `region`)
        x_BTD = constrain(x_BTD, *layout.residual)
    return module.losses(local.enter(x_BTD), targets_BT, local)


def run_sharded(module, fn: Callable, *args, arg_specs=None, out_specs=None,
                vary_params: bool = False):
    """Run `fn(local_module, *args)` per shard, inside jax.shard_map manual
    over every mesh axis.

    `args` and the outputs are activations whose leading dim is the batch,
    split over dp; `arg_specs`/`out_specs` say which are also split along T
    over tp (`act_spec(True)`, under SP). The module's parameters enter with
    the PartitionSpecs their metadata carries: replicated over dp, a weight's
    gradient is summed over dp where it is made (the transpose of its
    implicit dp broadcast, `check_vma`), the all-reduce GSPMD places in the
    gspmd impl; split over dp (FSDP) it is all-gathered here, and its
    gradient reduce-scattered (the all-gather's transpose). dp and tp are
    then both written out, and GSPMD has no say in the region: left to it,
    the dp split of an activation entering a shard_map manual over tp only
    was gathered (the embedding's backward pass at dp > 1, every SP region).
    `vary_params`: each parameter is made varying once, on entry, over the
    axes it is replicated on, so that a weight used several times (by every
    step of a collective-matmul ring) has its gradient summed once, not once
    per use (the implicit cast check_vma inserts at each use).
    """
    graphdef, params = nnx.split(module)
    mesh = _mesh_of(params)
    dtypes = [a.dtype for a in args] + [jnp.dtype(getattr(module, "dtype", "float32"))]
    if jnp.dtype(jnp.bfloat16) in dtypes and _platform(mesh) == "cpu":
        # jax/jaxlib 0.10.2: a bf16 psum in a shard_map manual over a subset of
        # the mesh axes (here at dp=1) aborts XLA's CPU compiler ("Invalid
        # binary instruction opcode copy"); float16 and float32 compile. Not
        # tried at dp > 1, where every axis is manual. (train.py refuses this combination before anything
        # is built; this guards library callers.)
        raise ValueError(BF16_CPU_SHARD_MAP)
    # an axis of size 1 stays automatic (a psum over it would still be emitted),
    # except for cuDNN attention, whose custom partitioning fails in jax 0.10.2
    # inside a shard_map that leaves any axis to GSPMD
    manual = set(mesh.axis_names) if getattr(module, "kernel", None) == "cudnn" else \
        {a for a, n in dict(mesh.shape).items() if n > 1} | {IMPL_AXIS}
    only = lambda s: P(*(a if a in manual else None for a in s))
    is_spec = lambda x: isinstance(x, P)
    param_specs = jax.tree.map(only, nnx.get_partition_spec(params), is_leaf=is_spec)
    spec_leaves = jax.tree.leaves(param_specs, is_leaf=is_spec)

    def per_shard(params, *args):
        leaves, tree = jax.tree.flatten(params)
        leaves = [_gather_over_dp(x, s) for x, s in zip(leaves, spec_leaves)]
        if vary_params:
            leaves = [_varying(x, manual) for x in leaves]
        return fn(nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)), *args)

    in_specs = (param_specs,) + tuple(map(only, arg_specs or (act_spec(),) * len(args)))
    out_specs = act_spec() if out_specs is None else out_specs
    out_specs = tuple(map(only, out_specs)) if isinstance(out_specs, tuple) else only(out_specs)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=manual, check_vma=True)(params, *args)


def act_spec(seq_split: bool = False) -> P:
    """shard_map spec of an activation [B, T, ...]: batch over dp, and T over
    tp when `seq_split` (sequence parallelism)."""
    return P(DATA_AXIS, IMPL_AXIS if seq_split else None)


def _varying(x, axes: set):
    """x cast to varying over the manual axes it is invariant over: the
    transpose is one psum of its gradient over them."""
    # jax 0.10: the varying manual axes of a value's type (`.vma` before)
    invariant = tuple(a for a in sorted(axes) if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, invariant, to="varying") if invariant else x


def _gather_over_dp(x, s: P):
    """An FSDP weight whole over dp: all-gather the dim split over dp."""
    for dim, axes in enumerate(s):
        if axes == DATA_AXIS:
            return jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)
    return x


def _mesh_of(params):
    """The mesh in context, or (called eagerly outside `jax.set_mesh`) the
    parameters' own."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    placed = [x.sharding.mesh for x in jax.tree.leaves(params)
              if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)]
    if not placed:
        raise ValueError("impl='shard_map' needs a mesh: call the model under "
                         "`with jax.set_mesh(mesh):`")
    return placed[0]


def _platform(mesh) -> str:
    """The platform a (concrete or abstract) mesh compiles for: a compile-only
    GPU mesh (jaxtp.analysis.targets) is not this machine's CPU."""
    device = getattr(mesh, "abstract_device", None)
    if device is None and hasattr(mesh, "devices"):
        device = mesh.devices.flat[0]
    return getattr(device, "platform", jax.default_backend())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cast_lookup(table_VD, ids_BT, dtype):
    """table[ids] in `dtype`, gathered from the table cast to it, so that the
    rows are summed over tp in the compute dtype (GSPMD sums them right at the
    gather, before any later cast). Every id is a valid row (the data is
    checked against the vocabulary); the gradient is scatter-added in the
    table's dtype, as a plain lookup's would be."""
    return table_VD.astype(dtype).at[ids_BT].get(mode="promise_in_bounds")


def _cast_lookup_fwd(table_VD, ids_BT, dtype):
    return _cast_lookup(table_VD, ids_BT, dtype), (ids_BT, jnp.zeros_like(table_VD))


def _cast_lookup_bwd(dtype, res, dx_BTD):
    ids_BT, zeros_VD = res
    return zeros_VD.at[ids_BT].add(dx_BTD.astype(zeros_VD.dtype)), None


_cast_lookup.defvjp(_cast_lookup_fwd, _cast_lookup_bwd)
