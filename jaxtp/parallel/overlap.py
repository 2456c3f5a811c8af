"""Collective matmuls: hiding sequence parallelism's communication behind the
matmuls it feeds (`parallel.overlap="collective_matmul"`).

Under SP a region starts with an all-gather of x along T and a column-
parallel matmul, and ends with a row-parallel matmul and a reduce-scatter
along T. Each pair is decomposed into tp ring steps of `lax.ppermute`, so
that the matmul of one sequence chunk can run while the next chunk travels
(Wang et al. 2023, "Overlap communication with dependent computation via
decomposition in large deep learning models"; the JAX shard_map tutorial's
collective matmul):

- `allgather_matmul`: tp - 1 hops of x's chunk, [B, T/tp, D] each;
- `matmul_reducescatter`: tp - 1 hops of a partial-sum chunk, [B, T/tp, D].

The bytes are those of the one all-gather / reduce-scatter they replace
((tp - 1)/tp of the full tensor per rank), none of it on the critical path
once the hardware runs a permute beside a matmul. The backward pass follows
from autodiff: the transpose of a ppermute is the permute the other way, so
dX is reduce-scattered by the reverse ring and the output gradient
all-gathered by one (`jaxtp.analysis.budget` counts them). The rings are
one-directional: a bidirectional ring would halve the hops on links that
carry both directions at once, at twice the number of (half-size) matmuls.

For GSPMD and explicit the same intent is XLA's: its partitioner can
decompose an all-gather or reduce-scatter beside a dot into a loop of
collective-permutes itself ("windowed einsum"), when the dot is written so
(`jaxtp.parallel.GSPMD.project`) and the backend's rules allow
(`jaxtp.parallel.xla_overlap`); `reread` keeps a gathered input to one dot
per pass, which that needs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .layout import TP_AXIS

def reread(mm: Callable) -> Callable:
    """`mm` rematerialised (nothing saved but its inputs): its backward pass
    reads the input it was given again, through an optimization barrier,
    instead of the value XLA gathered for the forward matmul. Under SP's
    overlap the input is x's sequence shard, so the weight gradient gathers
    x again (Megatron-SP keeps the shard and gathers it twice, Korthikanti
    et al. 2022, Sec. 4.2.3), and each gather has one dot consumer: XLA's
    partitioner declines a windowed loop for an operand whose other users
    need the same gathered value (dot_handler.cc, check_users_sharding) and
    shares one plain all-gather instead."""
    return jax.checkpoint(mm)


def _ring(tp: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % tp) for j in range(tp)]


def allgather_matmul(x_BtD, mm: Callable, axis: str = TP_AXIS):
    """mm(all_gather(x along T)) as a ring, for `mm` that maps each position
    on its own (a column-parallel matmul): x [B, T/tp, D] -> mm's outputs
    (any pytree) with T whole, [B, T, ...].

    Step i: rank r holds the chunk of rank r - i, sends it on to rank r + 1
    and multiplies it into its rows of the output (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = x_BtD.shape[1]
    whole = lambda p: jnp.zeros((p.shape[0], t * tp, *p.shape[2:]), p.dtype)
    y, x = None, x_BtD
    for i in range(tp):
        nxt = jax.lax.ppermute(x, axis, _ring(tp)) if i < tp - 1 else None
        part = mm(x)
        y = jax.tree.map(whole, part) if y is None else y
        at = (r - i) % tp * t
        y = jax.tree.map(lambda y, p: jax.lax.dynamic_update_slice_in_dim(y, p, at, 1),
                         y, part)
        x = nxt
    return y


def matmul_reducescatter(h_BT, mm: Callable, axis: str = TP_AXIS):
    """reduce_scatter(mm(h) along T) as a ring, for `mm` that maps each
    position on its own (a row-parallel matmul's partial sum): h (any pytree
    of [B, T, ...]) -> [B, T/tp, D], this rank's chunk of the sum over tp.

    The partial sums travel: the accumulator that ends on rank e starts on
    rank e + 1, and each rank it passes adds its own product for chunk e, so
    step i on rank r adds chunk r - 1 - i (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = jax.tree.leaves(h_BT)[0].shape[1] // tp
    part = lambda c: mm(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * t, t, 1),
                                     h_BT))
    acc = part((r - 1) % tp)
    for i in range(1, tp):
        acc = jax.lax.ppermute(acc, axis, _ring(tp)) + part((r - 1 - i) % tp)
    return acc
