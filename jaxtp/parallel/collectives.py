"""Megatron's conjugate operators, the one-reduction gradient norm, and
FSDP's all-gather of a parameter where it is used (`gathered`).

A *region* is a column-parallel linear, local math, and a row-parallel
linear: replicated in, partial out. Megatron (Shoeybi et al. 2019, Sec. 3)
brackets it with two operators:

- **f** at the entry: identity forward, all-reduce backward. Each rank's dX
  is a partial sum over its slice of the column-parallel output, so the input
  gradient must be summed over tp.
- **g** at the exit: all-reduce forward, identity backward. Each rank's
  row-parallel product X_i W_i is a partial sum of the output.

Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) splits each into
an all-gather and a reduce-scatter of the same bytes (`f_sp`, `g_sp`).
These are written out for the shard_map implementation; under GSPMD the
partitioner derives them from the PartitionSpecs (`jaxtp.parallel.locals`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from .layout import DATA_AXIS, TP_AXIS, explicit_axes, keep_axes, mesh_size, spec_axes


def f(x):
    """Megatron f: identity forward, all-reduce over tp backward.

    Under check_vma, x entering the region is tp-invariant (replicated) while
    the weights are tp-varying. `pcast(..., to="varying")` declares that from
    here on each rank's value may differ; its transpose is `psum` over tp, which
    is exactly the backward all-reduce of dX. No psum of any gradient is written
    by hand: that one would count it twice.
    """
    return jax.lax.pcast(x, TP_AXIS, to="varying")


def g(y_partial):
    """Megatron g: all-reduce over tp forward, identity backward.

    psum turns the tp-varying partial sums into a tp-invariant total; its
    transpose hands each rank the (invariant) output gradient unchanged.
    """
    return jax.lax.psum(y_partial, TP_AXIS)


def f_sp(x_BTD):
    """Megatron-SP entry: all-gather the sequence-split input forward (tiled
    along T); the transpose is a reduce-scatter of dX. Same bytes as f's
    all-reduce, split in two."""
    return jax.lax.all_gather(x_BTD, TP_AXIS, axis=1, tiled=True)


def g_sp(y_partial_BTD):
    """Megatron-SP exit: reduce-scatter the partial output along the sequence;
    the transpose all-gathers the output gradient."""
    return jax.lax.psum_scatter(y_partial_BTD, TP_AXIS, scatter_dimension=1, tiled=True)


def pmax(x):
    """The maximum over tp (the vocab-parallel loss's running max)."""
    return jax.lax.pmax(x, TP_AXIS)


def pmin(x):
    """The minimum over tp (the lowest token id among the shards' best)."""
    return jax.lax.pmin(x, TP_AXIS)


def gather(x, axis: int):
    """The tp shards of x side by side along `axis`, the same on every rank:
    each rank places its shard in a zero array and the sum over tp fills it
    (an all-reduce of tp x the shard: jax 0.10's public all_gather returns a
    value check_vma counts as varying over tp)."""
    tp = jax.lax.axis_size(TP_AXIS)
    placed = jnp.zeros(x.shape[:axis] + (tp,) + x.shape[axis:], x.dtype)
    placed = jax.lax.dynamic_update_index_in_dim(placed, x, rank(), axis)
    whole = jax.lax.psum(placed, TP_AXIS)
    return whole.reshape(x.shape[:axis] + (tp * x.shape[axis],) + x.shape[axis + 1:])


def varying_axes(x) -> frozenset:
    """The manual mesh axes x (an array, or a `jax.ShapeDtypeStruct` from
    `jax.eval_shape`) varies over, inside shard_map (check_vma)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; earlier: aval.vma
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """x cast to varying over those of `axes` it is invariant over: the
    transpose is one psum of its gradient over them (no forward collective)."""
    invariant = tuple(a for a in sorted(axes) if a not in varying_axes(x))
    return jax.lax.pcast(x, invariant, to="varying") if invariant else x


def wide(dtype) -> jnp.dtype:
    """The dtype a softmax, a norm or a sum is computed in: float32, or the
    input's where it is wider (float64: a verification run, `train.py
    --float64`, which turns on jax_enable_x64). `dtype`: a dtype or an
    array."""
    if not isinstance(dtype, type) and hasattr(dtype, "dtype"):  # an array (not np.float32)
        dtype = dtype.dtype
    return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def rank():
    """This shard's index on the tp axis (only inside shard_map)."""
    return jax.lax.axis_index(TP_AXIS)


def global_norm(grads, specs):
    """sqrt of the sum of squares of all gradients, with one scalar all-reduce.

    Each rank sums the squares of its shards, weighting a gradient that is
    replicated over a mesh axis by 1/size of that axis, and the weighted sums
    are reduced once over the axes the gradients are split on (tp; and dp
    under FSDP), as Megatron-LM reduces its norm once. Left to GSPMD, each
    sharded tensor's sum would be a separate all-reduce. (The weights are
    powers of two for the usual tp/dp, so exact.)
    """
    leaves = jax.tree.leaves(grads)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    mesh = jax.sharding.get_abstract_mesh()
    names = () if mesh.empty else mesh.axis_names
    split = [set(a for e in s for a in spec_axes(e) if a in names) for s in spec_leaves]
    axes = tuple(a for a in names if mesh_size(a) > 1 and any(a in s for s in split))
    if not axes:
        return optax.tree.norm(grads)
    size = {a: mesh_size(a) for a in axes}
    in_specs = tuple(keep_axes(s, axes) for s in spec_leaves)

    def local(*leaves):
        total = jnp.zeros((), wide(jnp.result_type(*leaves)))
        for x, s in zip(leaves, split):
            weight = math.prod(size[a] for a in axes if a not in s)
            total += jnp.sum(jnp.square(x.astype(total.dtype))) / weight
        return jnp.sqrt(jax.lax.psum(total, axes))

    return jax.shard_map(local, in_specs=in_specs, out_specs=P(), axis_names=set(axes),
                         check_vma=False)(*leaves)


def gathered(x: jax.Array, s: P | None) -> jax.Array:
    """FSDP's all-gather of a parameter where it is used: `x`, laid out by
    `s`, pinned whole over dp (its spec without dp), so that GSPMD gathers it
    right here and the gradient's transpose reduces it over dp and keeps this
    rank's slice (a reduce-scatter, where the compiler forms one). A no-op
    for a parameter not split over dp, inside shard_map (`run_sharded`
    gathers its own) and without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if s is None or mesh.empty or mesh.manual_axes or not any(
            DATA_AXIS in spec_axes(e) for e in s):
        return x
    whole = keep_axes(s, set(mesh.axis_names) - {DATA_AXIS})
    if explicit_axes(mesh):
        return jax.sharding.reshard(x, whole)
    return jax.lax.with_sharding_constraint(x, whole)
