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
- `Explicit`: global arrays on a mesh of Explicit axes (sharding in types):
  each reduction over tp named by its `out_sharding`, layouts `reshard`ed.

The `Local`s live in `jaxtp.parallel.locals`; `region`, `embed` and
`vocab_losses` here run a module one way or the other by its `Layout`. A new
way to communicate is one more `Local` and one more branch here, not edits
in the model.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .collectives import g, g_sp
from .layout import DATA_AXIS, IMPL_AXIS, constrain
from .locals import GSPMD, Explicit, Ring, ShardMap

BF16_CPU_SHARD_MAP = ("impl='shard_map' with model.dtype=bfloat16 crashes XLA's CPU compiler "
                      "(jax 0.10.2); on CPU use model.dtype=float32 (or float16), or "
                      "impl=gspmd")


def region(module, x_BTD):
    """`module.region` from replicated x (SP: split along T) to its output
    summed over tp: the row-parallel bias is added by the caller.

    GSPMD: pinning the output replicated tells the partitioner where g goes;
    it adds f in the backward pass itself. shard_map: f and g written out by
    the `Local` (as rings under `layout.overlap`). explicit: the types say
    it, g named by the row-parallel matmul's out_sharding.
    The sum carries the remat name `module.tag`: every remat policy keeps it
    (jaxtp.model.transformer.REMAT_POLICIES), so recomputing a block in the
    backward pass never repeats g's collective.
    """
    layout = module.layout
    if layout.impl == "shard_map":
        spec, local = act_spec(layout.sp), (Ring if layout.overlap else ShardMap)(layout)
        y = run_sharded(module, lambda m, x: m.region(x, local), x_BTD, arg_specs=(spec,),
                        out_specs=spec, vary_params=layout.overlap)
    elif layout.impl == "explicit":
        y = module.region(x_BTD, Explicit(layout))
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
    if layout.impl == "explicit":
        return module.rows(ids_BT, Explicit(layout))  # typed as the residual
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
    local = Explicit(layout) if layout.impl == "explicit" else GSPMD(layout)
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
