"""The `Local`s per shard: `ShardMap` runs a region's math inside
`jax.shard_map` (check_vma) with Megatron's f and g, SP's f_sp and g_sp and
the loss reductions written out; `Ring` is `ShardMap` with SP's entry and
exit matmuls as collective-matmul rings of ppermutes
(`jaxtp.parallel.overlap`). `run_sharded` runs a module's method per shard
over its own parameters (in_specs read from each weight's PartitionSpec).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import context, ep
from .collectives import f, f_sp, g, g_sp, gather, pmax, pmin, rank, vary
from .layout import DATA_AXIS, TP_AXIS, Layout, cache_spec, keep_axes, spec, spec_axes
from .overlap import (allgather_matmul, allgather_matmul_bidi, matmul_reducescatter,
                      matmul_reducescatter_bidi)

BF16_CPU_SHARD_MAP = ("impl='shard_map' with model.dtype=bfloat16 crashes XLA's CPU compiler "
                      "(jax 0.10.2); on CPU use model.dtype=float32 (or float16), or "
                      "impl=gspmd")


class ShardMap:
    """A region per tp shard inside jax.shard_map: f and g written out."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def enter(self, x_BTD, mm: Callable | None = None, out: tuple | None = None):
        """f (SP: f_sp, an all-gather along T), then `mm`."""
        x_BTD = f_sp(x_BTD) if self.layout.sp else f(x_BTD)
        return x_BTD if mm is None else mm(x_BTD)

    def project(self, x_BTD, mm: Callable, out: tuple | None = None):
        """This rank's column-parallel product of an entered input."""
        return mm(x_BTD)

    def exit(self, h, mm: Callable):
        """This rank's partial product `mm(h)`, then g (SP: g_sp, a
        reduce-scatter along T)."""
        return (g_sp if self.layout.sp else g)(mm(h))

    def constrain(self, x, *logical):
        return x

    # a MoE layer's experts (`jaxtp.model.moe`): the slots stay split as the
    # tokens are, and the region sends them to the experts' ranks and back
    # (`jaxtp.parallel.ep.over_ep`), gathered over tp and reduce-scattered
    # back under SP, else f and g
    def place_slots(self, module, x_EGCD, to_experts: bool):
        return ep.kept(x_EGCD, to_experts, module.slots)

    def run_experts(self, module, x_EGCD):
        s = spec(*module.slots.tokens)
        enter, leave = (f_sp, g_sp) if module.slots.sp else (f, g)
        return run_sharded(module, lambda m, x: ep.over_ep(lambda x: leave(m.local(enter(x))), x),
                           x_EGCD, arg_specs=(s,), out_specs=s)

    def run_ragged(self, module, local: Callable, *args, arg_specs, out_specs):
        return run_sharded(module, local, *args, arg_specs=arg_specs, out_specs=out_specs)

    def attend(self, core: Callable, q, k, v):
        """The core on this rank's heads (under cp, its queries over every
        rank's K/V: `jaxtp.parallel.context`)."""
        return context.attend(core, q, k, v, self.layout) if self.layout.cp > 1 else \
            core(q, k, v)

    def positions(self, T: int):
        """The original positions of this rank's T tokens."""
        return context.local_positions(T, self.layout) if self.layout.cp > 1 else jnp.arange(T)

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
        at_B = jax.lax.argmax(scores_BV, 1, jnp.int32) + self.vocab_start(scores_BV.shape[-1])
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

    def seq_parts(self) -> int:
        return 1  # the arrays are this rank's positions


    def batch_per_dp_rank(self, B: int) -> int:
        return B  # the arrays are this rank's

    def vocab_max(self, v):
        return pmax(v)

    def vocab_sum(self, v):
        return g(v)

    # how a module runs per shard
    def run_region(self, module, x_BTD):
        """f and g written out (as rings under `layout.overlap`)."""
        layout = self.layout
        spec, local = act_spec(layout.sp), Ring(layout) if layout.overlap else self
        return run_sharded(module, lambda m, x: m.region(x, local), x_BTD, arg_specs=(spec,),
                           out_specs=spec, vary_params=layout.overlap)

    def run_embed(self, module, ids_BT):
        """Each rank's partial rows summed (g, or under SP g_sp)."""
        exit_ = g_sp if self.layout.sp else g
        return run_sharded(module, lambda m, ids: exit_(m.rows(ids, self)), ids_BT,
                           out_specs=act_spec(self.layout.sp))

    def run_losses(self, module, x_BTD, targets_BT):
        return run_sharded(module, lambda m, x, t: m.losses(self.enter(x), t, self),
                           x_BTD, targets_BT, arg_specs=(act_spec(self.layout.sp), act_spec()))

    def run_cached(self, module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
        def fn(m, x, k, v, pos):
            y, k, v = m.cached_region(x, k, v, pos, prefill, self)
            return g(y), k, v

        spec = cache_spec()
        return run_sharded(module, fn, x_BTD, k_BSKH, v_BSKH, pos_BT,
                           arg_specs=(act_spec(), spec, spec, act_spec()),
                           out_specs=(act_spec(), spec, spec))

    def run_sample(self, module, x_BD, key, **sampling):
        return run_sharded(module, lambda m, x, k: m.sample(x, k, local=self, **sampling),
                           x_BD, key, arg_specs=(spec("batch"), P()),
                           out_specs=spec("batch"))


class Ring(ShardMap):
    """`ShardMap` under SP with each region's entry and exit as collective-
    matmul rings: tp - 1 ppermutes of one sequence chunk each (`layout.bidi`:
    two of half a chunk, one each way), a chunk's matmul running while the
    next one travels. Only the blocks' regions use
    it: the embedding's reduce-scatter and the LM head's all-gather (whose
    matmul runs per loss chunk) are not overlapped yet."""

    def enter(self, x_BtD, mm: Callable | None = None, out: tuple | None = None):
        if mm is None:
            return super().enter(x_BtD)
        return (allgather_matmul_bidi if self.layout.bidi else allgather_matmul)(x_BtD, mm)

    def exit(self, h, mm: Callable):
        return (matmul_reducescatter_bidi if self.layout.bidi else matmul_reducescatter)(h, mm)


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
        {a for a, n in dict(mesh.shape).items() if n > 1} | {TP_AXIS}
    manual -= set(mesh.manual_axes)  # nested: what the outer shard_map left automatic
    only = lambda s: keep_axes(s, manual)
    is_spec = lambda x: isinstance(x, P)
    param_specs = jax.tree.map(only, nnx.get_partition_spec(params), is_leaf=is_spec)
    spec_leaves = jax.tree.leaves(param_specs, is_leaf=is_spec)

    def per_shard(params, *args):
        leaves, tree = jax.tree.flatten(params)
        leaves = [_gather_over_dp(x, s) for x, s in zip(leaves, spec_leaves)]
        if vary_params:
            leaves = [vary(x, manual) for x in leaves]
        return fn(nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)), *args)

    if not manual:  # inside a shard_map already manual over every axis (a pipeline's)
        return per_shard(params, *args)
    in_specs = (param_specs,) + tuple(map(only, arg_specs or (act_spec(),) * len(args)))
    out_specs = act_spec() if out_specs is None else out_specs
    out_specs = tuple(map(only, out_specs)) if isinstance(out_specs, tuple) else only(out_specs)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=manual, check_vma=True)(params, *args)


def act_spec(seq_split: bool = False) -> P:
    """shard_map spec of an activation [B, T, ...]: the batch split as the
    rules say, and T too when `seq_split` (sequence parallelism)."""
    return spec("batch", "sp_seq" if seq_split else "seq")


def _gather_over_dp(x, s: P):
    """An FSDP weight whole over dp: all-gather the dim split over dp."""
    for dim, axes in enumerate(s):
        if spec_axes(axes) == (DATA_AXIS,):
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
    GPU mesh (jaxtp.parallel.targets) is not this machine's CPU."""
    device = getattr(mesh, "abstract_device", None)
    if device is None and hasattr(mesh, "devices"):
        device = mesh.devices.flat[0]
    return getattr(device, "platform", jax.default_backend())
