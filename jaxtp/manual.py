"""Tensor-parallel regions, and the shard_map variant with every collective written out.

A *region* is a column-parallel linear, local math, and a row-parallel linear:
replicated in, partial out (`module.region(x, enter)`). Megatron (Shoeybi et
al. 2019, Sec. 3) brackets it with two conjugate operators:

- **f** at the entry: identity forward, all-reduce backward. Each rank's dX
  is a partial sum over its slice of the column-parallel output, so the input
  gradient must be summed over tp.
- **g** at the exit: all-reduce forward, identity backward. Each rank's
  row-parallel product X_i W_i is a partial sum of the output.

Under `impl="gspmd"` XLA's partitioner infers both from the PartitionSpecs and
`enter` is the identity. Under `impl="shard_map"` the same `region` runs per
shard inside `jax.shard_map(check_vma=True)` over the module's own parameters
(same pytree, in_specs read from each weight's PartitionSpec), with `enter=f`
and `g` applied to its result.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .sharding import constrain, residual_axes, tp_only


BF16_CPU_SHARD_MAP = ("impl='shard_map' with model.dtype=bfloat16 crashes XLA's CPU compiler "
                      "(jax 0.10.2); on CPU use model.dtype=float32 (or float16), or "
                      "impl=gspmd")


def f(x):
    """Megatron f: identity forward, all-reduce over tp backward.

    Under check_vma, x entering the region is tp-invariant (replicated) while
    the weights are tp-varying. `pcast(..., to="varying")` declares that from
    here on each rank's value may differ; its transpose is `psum` over tp, which
    is exactly the backward all-reduce of dX. No psum of any gradient is written
    by hand: that one would count it twice.
    """
    return jax.lax.pcast(x, "tp", to="varying")


def g(y_partial):
    """Megatron g: all-reduce over tp forward, identity backward.

    psum turns the tp-varying partial sums into a tp-invariant total; its
    transpose hands each rank the (invariant) output gradient unchanged.
    """
    return jax.lax.psum(y_partial, "tp")


def f_sp(x_BTD):
    """Megatron-SP entry (Korthikanti et al. 2022, Sec. 4.2.2): all-gather the
    sequence-split input forward (tiled along T); the transpose is a
    reduce-scatter of dX. Same bytes as f's all-reduce, split in two."""
    return jax.lax.all_gather(x_BTD, "tp", axis=1, tiled=True)


def g_sp(y_partial_BTD):
    """Megatron-SP exit: reduce-scatter the partial output along the sequence;
    the transpose all-gathers the output gradient."""
    return jax.lax.psum_scatter(y_partial_BTD, "tp", scatter_dimension=1, tiled=True)


def _identity(x):
    return x


def gather_seq(x_BTD):
    """GSPMD: the full sequence, replicated over tp (an all-gather under SP)."""
    return constrain(x_BTD, "batch", "seq", "embed")


SEQ_SPLIT = P(None, "tp")  # shard_map spec of a [B, T, ...] array split along T


def in_shard_map() -> bool:
    """True inside a shard_map that is manual over tp (per-shard arrays)."""
    return "tp" in jax.sharding.get_abstract_mesh().manual_axes


def tp_rank():
    """This shard's index on the tp axis (only inside shard_map)."""
    return jax.lax.axis_index("tp")


def run_sharded(module, fn: Callable, *args, arg_specs=None, out_specs=P()):
    """Run `fn(local_module, *args)` per tp shard, inside jax.shard_map.

    A module whose `kernel` is cudnn runs manual over every mesh axis, which
    must then all be size 1 but tp: in jax 0.10.2 cuDNN attention's custom
    partitioning fails inside a shard_map that leaves an axis to GSPMD
    (`kernels.cudnn_problem` refuses cudnn for shard_map at dp > 1).

    The module's parameters enter with the PartitionSpecs their metadata
    carries; `args` enter replicated over tp unless `arg_specs` says
    otherwise (`SEQ_SPLIT` under sequence parallelism). The shard_map is manual over tp
    only: dp (batch split, gradient reduction) stays with GSPMD exactly as in
    the gspmd path, so the two impls differ only in the tp collectives. (Manual
    over dp too, every weight gradient would get an extra psum over dp.)
    """
    graphdef, params = nnx.split(module)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # called eagerly outside `jax.set_mesh`: use the parameters' mesh
        placed = [x.sharding.mesh for x in jax.tree.leaves(params)
                  if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)]
        if not placed:
            raise ValueError("impl='shard_map' needs a mesh: call the model under "
                             "`with jax.set_mesh(mesh):`")
        mesh = placed[0]
    dtypes = [a.dtype for a in args] + [jnp.dtype(getattr(module, "dtype", "float32"))]
    platform = _platform(mesh)
    if jnp.dtype(jnp.bfloat16) in dtypes and platform == "cpu":
        # jax/jaxlib 0.10.2: a bf16 psum in a shard_map manual over a subset of
        # the mesh axes aborts XLA's CPU compiler ("Invalid binary instruction
        # opcode copy"); float16 and float32 compile. (train.py refuses this
        # combination before anything is built; this guards library callers.)
        raise ValueError(BF16_CPU_SHARD_MAP)

    def per_shard(params, *args):
        return fn(nnx.merge(graphdef, params), *args)

    # only the tp part of a spec: a dp split (FSDP) stays with GSPMD, which
    # gathers the weight over dp before it enters
    param_specs = jax.tree.map(tp_only, nnx.get_partition_spec(params),
                               is_leaf=lambda x: isinstance(x, P))
    in_specs = (param_specs,) + tuple(arg_specs or (P(),) * len(args))
    axes = {"tp"}
    if getattr(module, "kernel", None) == "cudnn":
        axes = set(mesh.axis_names)
        if any(size > 1 for name, size in dict(mesh.shape).items() if name != "tp"):
            raise ValueError("attention='cudnn' under impl='shard_map' needs dp=1 (jax 0.10.2)")
    return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=axes, check_vma=True)(params, *args)


def _platform(mesh) -> str:
    """The platform a (concrete or abstract) mesh compiles for: a compile-only
    GPU mesh (jaxtp.targets) is not this machine's CPU."""
    device = getattr(mesh, "abstract_device", None)
    if device is None and hasattr(mesh, "devices"):
        device = mesh.devices.flat[0]
    return getattr(device, "platform", jax.default_backend())


def tp_region(module, x_BTD):
    """Run `module.region` (replicated in -> partial out) and sum it over tp.

    gspmd: pinning the output replicated tells the partitioner where g goes;
    it adds f in the backward pass itself. shard_map: f and g written out.
    Under sequence parallelism (`module.sp`) x and the output are split along
    T over tp, and f/g become all-gather/reduce-scatter (f_sp, g_sp).
    The row-parallel bias is added by the caller, after this sum.

    The summed output carries the remat name `module.tag`: every remat policy
    keeps it (jaxtp.model.REMAT_POLICIES), so recomputing a block in the
    backward pass never repeats g's collective.
    """
    return checkpoint_name(_tp_region(module, x_BTD), module.tag)


def _tp_region(module, x_BTD):
    if module.impl == "shard_map":
        # x_BTD: [B, T, D] replicated over tp (SP: [B, T/tp, D]); kernels hold
        # N/tp heads or F/tp
        if module.sp:
            return run_sharded(module, lambda m, x: g_sp(m.region(x, f_sp)), x_BTD,
                               arg_specs=(SEQ_SPLIT,), out_specs=SEQ_SPLIT)
        return run_sharded(module, lambda m, x: g(m.region(x, f)), x_BTD)
    if module.sp:
        # pin the input (the norm's output) to its sequence shard: else GSPMD may
        # gather first and apply the norm's scale and bias to the full-length
        # tensor, whose gradient then needs the full dX (an all-reduce, not the
        # reduce-scatter of Megatron-SP; seen in XLA's GPU pipeline)
        x_BTD = constrain(x_BTD, *residual_axes(True))
    y = module.region(x_BTD, gather_seq if module.sp else _identity)
    if module.sp:
        # pin the output full-length first: its transpose pins the incoming
        # gradient too, which GSPMD would otherwise carry split along T into
        # the attention backward (all-to-alls)
        y = gather_seq(y)
    return constrain(y, *residual_axes(module.sp))
