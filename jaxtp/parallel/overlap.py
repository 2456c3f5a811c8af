"""Collective matmuls: the all-gather before a matmul and the reduce-scatter
after one, decomposed into tp ring steps of `lax.ppermute` so that each
step's matmul can run while the next chunk travels (Wang et al. 2023,
"Overlap communication with dependent computation via decomposition in large
deep learning models"; the JAX shard_map tutorial's collective matmul).

They are the sequence-parallel region entry and exit written as rings, for
use inside `jax.shard_map` manual over tp: the same bytes as one all-gather /
reduce-scatter (tp - 1 hops of one chunk each), none of it on the critical
path once the hardware overlaps a permute with a matmul. The backward pass
follows from autodiff: the transpose of a ppermute ring is the reverse ring.

Building blocks for issue 15's `--overlap collective_matmul`; not yet wired
into the model's regions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layout import IMPL_AXIS


def _ring(tp: int, step: int = 1) -> list[tuple[int, int]]:
    return [(j, (j + step) % tp) for j in range(tp)]


def allgather_matmul(x_BtD, w_DF, axis: str = IMPL_AXIS):
    """all_gather(x over T) @ w, as a ring: [B, T/tp, D] x [D, F] -> [B, T, F].

    Step i: rank r holds the sequence chunk of rank r - i, multiplies it into
    its rows of the output, and passes it on to rank r + 1 (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    B, t, _ = x_BtD.shape
    y_BTF = jnp.zeros((B, t * tp, w_DF.shape[1]), jnp.result_type(x_BtD, w_DF))
    x = x_BtD
    for i in range(tp):
        chunk = (r - i) % tp
        y_BTF = jax.lax.dynamic_update_slice_in_dim(y_BTF, x @ w_DF, chunk * t, 1)
        if i < tp - 1:
            x = jax.lax.ppermute(x, axis, _ring(tp))
    return y_BTF


def matmul_reducescatter(x_BTF, w_FD, axis: str = IMPL_AXIS):
    """reduce_scatter(x @ w over T), as a ring: [B, T, F] x [F, D] -> [B, T/tp, D].

    The partial sums travel: the accumulator that ends on rank e starts on
    rank e + 1, and each rank it passes adds its own product for chunk e, so
    step i on rank r adds chunk r - 1 - i (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = x_BTF.shape[1] // tp
    part = lambda c: jax.lax.dynamic_slice_in_dim(x_BTF, c * t, t, 1) @ w_FD
    acc = part((r - 1) % tp)
    for i in range(1, tp):
        acc = jax.lax.ppermute(acc, axis, _ring(tp)) + part((r - 1 - i) % tp)
    return acc
