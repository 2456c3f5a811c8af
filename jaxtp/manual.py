"""Tensor-parallel regions, and the shard_map variant with every collective written out.

A *region* is a column-parallel linear, local math, and a row-parallel linear:
replicated in, partial out (`module.region`). Megatron (Shoeybi et al. 2019,
Sec. 3) brackets it with two conjugate operators:

- **f** at the entry: identity forward, all-reduce backward. Each rank's dX
  is a partial sum over its slice of the column-parallel output, so the input
  gradient must be summed over tp.
- **g** at the exit: all-reduce forward, identity backward. Each rank's
  row-parallel product X_i W_i is a partial sum of the output.

Under `impl="gspmd"` XLA's partitioner infers both from the PartitionSpecs.
Under `impl="shard_map"` the same `region` runs per shard inside
`jax.shard_map(check_vma=True)` over the module's own parameters (same pytree,
in_specs read from each weight's PartitionSpec), and f and g are the two
functions below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from .sharding import constrain


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


def _shard_map_region(module, x_BTD):
    graphdef, params = nnx.split(module)
    param_specs = nnx.get_partition_spec(params)  # from each weight's metadata

    def per_shard(x_BTD, params):
        # x_BTD: [B, T, D] replicated over tp; kernels hold N/tp heads or F/tp
        local = nnx.merge(graphdef, params)
        return g(local.region(f(x_BTD)))

    if jax.sharding.get_abstract_mesh().empty:
        raise ValueError("impl='shard_map' needs a mesh: call the model under "
                         "`with jax.set_mesh(mesh):`")
    if x_BTD.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        # jax/jaxlib 0.10.2: a bf16 psum in a shard_map manual over a subset of
        # the mesh axes aborts XLA's CPU compiler ("Invalid binary instruction
        # opcode copy"); float16 and float32 compile. Fail clearly instead.
        raise ValueError("impl='shard_map' with model.dtype=bfloat16 crashes XLA's CPU "
                         "compiler; on CPU use model.dtype=float32 (or float16), or "
                         "impl=gspmd")
    # Manual over tp only: dp (batch split, gradient reduction) stays with GSPMD,
    # exactly as in the gspmd path, so the two differ only in the tp collectives.
    # (Manual over dp too, the weights' dp-invariance would add a psum over dp
    # of every weight gradient inside each region.)
    return jax.shard_map(per_shard, in_specs=(P(), param_specs), out_specs=P(),
                         axis_names={"tp"}, check_vma=True)(x_BTD, params)


def tp_region(module, x_BTD):
    """Run `module.region` (replicated in -> partial out) and sum it over tp.

    gspmd: pinning the output replicated tells the partitioner where g goes;
    it adds f in the backward pass itself. shard_map: f and g written out.
    The row-parallel bias is added by the caller, after this sum.
    """
    if module.impl == "shard_map":
        return _shard_map_region(module, x_BTD)
    return constrain(module.region(x_BTD), "batch", "seq", "embed")
