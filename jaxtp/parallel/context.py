"""Context parallelism: the attention core over a sequence split on cp.

Everything but the attention core is token-wise, so under cp it runs on each
rank's tokens with no communication (the weight gradients are summed over
dp x cp by the same transposes that sum them over dp). The core needs the
keys and values of every earlier position; each rank holds its queries and
reaches the other ranks' K/V one of two ways (`parallel.cp_attention`):

- `allgather` (the Llama 3 paper's CP, Grattafiori et al. 2024, Sec. 3.3.2;
  MaxText's default): K and V are all-gathered over cp, once per layer, and
  each rank attends its queries over the whole sequence. The transpose
  reduce-scatters dK and dV. Per layer, per rank: one all-gather of
  2*b*s*Kl*H elements forward (s the whole sequence, Kl the kv heads a rank
  holds: K/tp, or 1 when K < tp), one reduce-scatter of as many backward,
  and the all-gather again in the backward pass unless a remat policy keeps
  its output (the name "cp_kv").
- `ring` (Liu et al. 2023, Ring Attention): the K/V chunk of 2*b*(s/cp)*Kl*H
  elements goes cp-1 hops around the cp ring by `ppermute`; each hop attends
  the rank's queries to the chunk it holds (one call of the kernel's part
  per pair of chunks, `Core.part`), merged by log-sum-exp. A pair wholly
  above the causal diagonal is skipped. The transpose of each hop's permute
  is the reverse ring carrying the dK/dV partial sums: cp-1 permutes of the
  same size backward, plus the cp-1 forward ones again unless a remat policy
  keeps each hop's chunk ("cp_kv").

K and V travel as one array (one collective per layer or hop). Under causal
balance (`parallel.cp_balance`, the dual chunk swap of Megatron-LM's CP
docs) rank r holds chunks r and 2cp-1-r of the sequence's 2cp chunks
(`jaxtp.parallel.layout.cp_order`), so every rank's queries see as many
keys: with the ring, every hop costs each rank two chunk pairs.

The functions here run per cp shard (inside a shard_map manual over cp:
the shard_map impl's regions, or `over_cp` on global arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .collectives import vary, varying_axes, wide
from .layout import CP_AXIS, Layout, spec

NEG_INF = float("-inf")
KV_NAME = "cp_kv"  # remat name of the K/V a rank received (every policy but "full" keeps it)


def attend(core, q_BTKGH, k_BTKH, v_BTKH, layout: Layout):
    """The causal attention of this rank's queries over the whole sequence's
    keys: o like q (per cp shard)."""
    if layout.cp_attention == "allgather":
        return _allgather(core, q_BTKGH, k_BTKH, v_BTKH, layout)
    if layout.cp_attention == "ring":
        return _ring(core, q_BTKGH, k_BTKH, v_BTKH, layout)
    raise ValueError(f"unknown parallel.cp_attention {layout.cp_attention!r}; choose "
                     "'allgather' or 'ring'")


def over_cp(core, q_BTKGH, k_BTKH, v_BTKH, layout: Layout):
    """`attend` on global arrays: a shard_map manual over every mesh axis
    not already manual, q, k and v split as they are (batch over dp,
    sequence over cp, heads over tp: the core moves nothing over dp or tp).
    (Manual over cp alone, GSPMD gathered the kv heads over tp before the
    all-gather over cp.)"""
    mesh = jax.sharding.get_abstract_mesh()
    if CP_AXIS in mesh.manual_axes:  # a pipeline's stage: already per cp shard (tp automatic)
        return attend(core, q_BTKGH, k_BTKH, v_BTKH, layout)
    s = spec("batch", "seq", "heads")  # dim 2: the (kv) heads
    return jax.shard_map(lambda q, k, v: attend(core, q, k, v, layout), in_specs=(s, s, s),
                         out_specs=s, axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
                         check_vma=True)(q_BTKGH, k_BTKH, v_BTKH)


def chunk_starts(rank, layout: Layout, c: int) -> list:
    """The first positions of the chunks (of c positions) rank `rank` holds."""
    if not layout.cp_balance:
        return [rank * c]
    return [rank * c, (2 * layout.cp - 1 - rank) * c]


def local_positions(T: int, layout: Layout):
    """The original positions of this cp rank's T tokens (per cp shard)."""
    n = 2 if layout.cp_balance else 1
    starts = chunk_starts(jax.lax.axis_index(CP_AXIS), layout, T // n)
    return jnp.concatenate([s + jnp.arange(T // n) for s in starts])


def _chunks(x, n: int):
    c = x.shape[1] // n
    return [x[:, i * c:(i + 1) * c] for i in range(n)]


def _allgather(core, q_BTKGH, k_BTKH, v_BTKH, layout: Layout):
    cp, n = layout.cp, 2 if layout.cp_balance else 1
    kv = jnp.stack([k_BTKH, v_BTKH], 2)  # [B, T/cp, 2, K, H]
    kv = checkpoint_name(jax.lax.all_gather(kv, CP_AXIS, axis=1, tiled=True), KV_NAME)
    if n == 2:  # to the original order: a static reshuffle of whole chunks
        B, S = kv.shape[:2]
        pairs = kv.reshape(B, cp, 2, S // (2 * cp), *kv.shape[2:])
        # rank r's pair is chunks (r, 2cp-1-r): the first halves in order, the
        # second ones reversed
        kv = jnp.concatenate([pairs[:, :, 0], pairs[:, ::-1, 1]], 1).reshape(kv.shape)
    c = q_BTKGH.shape[1] // n
    starts = chunk_starts(jax.lax.axis_index(CP_AXIS), layout, c)
    outs = [core.part(q, kv[:, :, 0], kv[:, :, 1], start, 0)[0]
            for q, start in zip(_chunks(q_BTKGH, n), starts)]
    return jnp.concatenate(outs, 1).astype(q_BTKGH.dtype)


def _ring(core, q_BTKGH, k_BTKH, v_BTKH, layout: Layout):
    cp, n = layout.cp, 2 if layout.cp_balance else 1
    kv = jnp.stack([k_BTKH, v_BTKH], 2)  # [B, T/cp, 2, K, H]
    c = q_BTKGH.shape[1] // n
    rank = jax.lax.axis_index(CP_AXIS)
    qs, q_starts = _chunks(q_BTKGH, n), chunk_starts(rank, layout, c)
    acc = [None] * n
    for hop in range(cp):
        if hop:  # rank r now holds the chunk of rank r - hop
            kv = checkpoint_name(jax.lax.ppermute(
                kv, CP_AXIS, [(j, (j + 1) % cp) for j in range(cp)]), KV_NAME)
        k_starts = chunk_starts((rank - hop) % cp, layout, c)
        for i, (q, q_start) in enumerate(zip(qs, q_starts)):
            for kv_j, k_start in zip(_chunks(kv, n), k_starts):
                acc[i] = _merge(acc[i], _part(core, q, kv_j, q_start, k_start))
    return jnp.concatenate([o for o, _ in acc], 1).astype(q_BTKGH.dtype)


def _part(core, q_BTKGH, kv_BSCKH, q_start, k_start):
    """One pair of chunks, skipped (o 0, lse -inf) where every key lies after
    every query."""
    k, v = kv_BSCKH[:, :, 0], kv_BSCKH[:, :, 1]
    B, T, K, G, H = q_BTKGH.shape
    axes = varying_axes(q_BTKGH) | varying_axes(kv_BSCKH)

    def skip():
        return (vary(jnp.zeros(q_BTKGH.shape, wide(q_BTKGH)), axes),
                vary(jnp.full((B, K, G, T), NEG_INF, wide(q_BTKGH)), axes))

    def run():
        o, lse = core.part(q_BTKGH, k, v, q_start, k_start)
        return vary(o, axes), vary(lse, axes)

    return jax.lax.cond(k_start <= q_start + T - 1, run, skip)


def _merge(acc, part):
    """Two attentions of the same queries over disjoint keys, as one: each
    output weighted by its share exp(lse_i - lse) of the softmax sum (the
    first part of every query chunk holds its diagonal, so lse is finite)."""
    if acc is None:
        return part
    (o0, l0), (o1, l1) = acc, part
    lse = jnp.logaddexp(l0, l1)
    w = lambda l: jnp.exp(l - lse).transpose(0, 3, 1, 2)[..., None]  # [B, T, K, G, 1]
    return o0 * w(l0) + o1 * w(l1), lse
