"""Causal attention kernels over grouped heads: `xla`, `blockwise`, `cudnn`.

All take q [B, T, K, G, H] (K kv heads, G query heads per kv head) and k, v
[B, T, K, H], and return o [B, T, K, G, H]: o = softmax(q k^T / sqrt(H) +
causal mask) v per head. Each works on global arrays (the SPMD partitioner splits
the head dims) and on one rank's heads inside a manual region; none moves data between
heads, so none adds a collective.

- `xla`: einsum, fp32 softmax, einsum; the reference. It materialises the
  [B, heads, T, T] scores.
- `blockwise`: exact attention in O(T * block) memory (`jaxtp.model.blockwise`).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's
  fused flash attention on NVIDIA GPUs (fp16/bf16, head dim a multiple of 8
  and at most 256; GQA native).

`auto` is resolved once per model by `choose` from the device and the shapes;
this module is that choice and the `xla` and `cudnn` kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ATTENTIONS
from ..parallel.collectives import wide
from .blockwise import NEG_INF, blockwise_attention, blockwise_chunk, causal, scaled

KERNELS = ATTENTIONS  # the config owns the names
# `auto` on an accelerator without cuDNN takes blockwise from this sequence
# length on (below it the T x T scores are small).
BLOCKWISE_FROM_SEQ = 1024
# `auto` on CPU: blockwise in blocks of at most 64 from two blocks on. XLA's
# CPU backend (jaxlib 0.10.2) runs the tiny step (T = 128) in 0.73x the time
# of the xla kernel: the causal block above the diagonal is skipped, and the
# custom VJP's backward (FlashAttention-2's rowsum(dO o)) makes fewer passes
# over the scores than autodiff's softmax does (jaxtp.bench cpu_profile).
CPU_BLOCK = 64


class KernelError(ValueError):
    """An attention kernel that cannot run for this device, dtype or shape."""


def cudnn_problem(dtype, head_dim: int, platform: str, device_kind: str = "") -> str | None:
    """Why cuDNN flash attention cannot run here, or None if it can."""
    if platform not in ("gpu", "cuda") or "nvidia" not in device_kind.lower():
        return (f"model.attention='cudnn' needs an NVIDIA GPU (cuDNN flash attention); this "
                f"is a {platform} device{f' ({device_kind})' if device_kind else ''}: use "
                "'blockwise' or 'xla'")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (f"model.attention='cudnn' needs bfloat16 or float16 activations, got "
                f"model.dtype={jnp.dtype(dtype).name}: add --bf16 or use 'blockwise'")
    if head_dim % 8 or head_dim > 256:
        return (f"model.attention='cudnn' needs a head dim that is a multiple of 8 and at "
                f"most 256, got {head_dim} (model.d_head, 0: d_model/n_heads)")
    return None


def choose(kernel: str, dtype, head_dim: int, seq_len: int, device,
           cpu_tuned: bool = True) -> str:
    """Resolve `auto` (and check an explicit choice) for `device`.
    `cpu_tuned=False`: on CPU, the accelerators' rule (the planner, whose CPU
    compile stands in for an accelerator's)."""
    platform = getattr(device, "platform", "cpu")
    kind = getattr(device, "device_kind", "")
    problem = cudnn_problem(dtype, head_dim, platform, kind)
    if kernel == "cudnn":
        if problem:
            raise KernelError(problem)
        return kernel
    if kernel != "auto":
        return kernel
    if problem is None:
        return "cudnn"
    if platform == "cpu" and cpu_tuned:
        return "blockwise" if seq_len >= 2 * CPU_BLOCK else "xla"
    return "blockwise" if seq_len >= BLOCKWISE_FROM_SEQ else "xla"


def choose_block(kernel: str, block: int, device, cpu_tuned: bool = True) -> int:
    """The blockwise block `kernel` (as configured, before `choose`) runs
    with on `device`: `auto` on CPU at most `CPU_BLOCK` (`cpu_tuned`)."""
    cpu = getattr(device, "platform", "cpu") == "cpu" and cpu_tuned
    return min(block, CPU_BLOCK) if kernel == "auto" and cpu else block


def attend(q_BTKGH, k_BTKH, v_BTKH, kernel: str = "xla", block: int = 512):
    """Causal attention with the named (resolved) kernel; o like q."""
    if kernel == "xla":
        return xla_attention(q_BTKGH, k_BTKH, v_BTKH)
    if kernel == "blockwise":
        return blockwise_attention(q_BTKGH, k_BTKH, v_BTKH, block)
    if kernel == "cudnn":
        return cudnn_attention(q_BTKGH, k_BTKH, v_BTKH)
    raise KernelError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS[1:]}")


class Core:
    """The attention core a region hands its `Local` (`Local.attend`): the
    named kernel over whole sequences (`__call__`), and over one context-
    parallel part with its positions (`part`), for `jaxtp.parallel.context`."""

    def __init__(self, kernel: str, block: int):
        self.kernel, self.block = kernel, block

    def __call__(self, q_BTKGH, k_BTKH, v_BTKH):
        return attend(q_BTKGH, k_BTKH, v_BTKH, self.kernel, self.block)

    def part(self, q_BTKGH, k_BSKH, v_BSKH, q_start, k_start):
        """(o fp32, lse [B, K, G, T]) of queries at positions q_start + t over
        keys at k_start + s under the causal mask; rows that see no key give
        o = 0 and lse = -inf."""
        if self.kernel == "blockwise":
            return blockwise_chunk(q_BTKGH, k_BSKH, v_BSKH, q_start, k_start, self.block)
        if self.kernel == "xla":
            return xla_part(q_BTKGH, k_BSKH, v_BSKH, q_start, k_start)
        raise KernelError(f"attention kernel {self.kernel!r} has no context-parallel part; use "
                          "'blockwise' or 'xla'")


def xla_part(q_BTKGH, k_BSKH, v_BSKH, q_start, k_start):
    """`Core.part` as `xla_attention`'s math: the [T, S] scores masked by
    position, a softmax safe for rows that see nothing, o in fp32."""
    T, S = q_BTKGH.shape[1], k_BSKH.shape[1]
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", scaled(q_BTKGH), k_BSKH,
                         preferred_element_type=wide(q_BTKGH))
    seen_TS = (q_start + jnp.arange(T))[:, None] >= (k_start + jnp.arange(S))[None]
    s_BKGTS = jnp.where(seen_TS, s_BKGTS, NEG_INF)
    # o and lse do not depend on the shift: no gradient through it
    m_BKGT = jax.lax.stop_gradient(s_BKGTS.max(-1))
    m_BKGT = jnp.where(jnp.isfinite(m_BKGT), m_BKGT, 0.0)
    p_BKGTS = jnp.exp(s_BKGTS - m_BKGT[..., None])
    l_BKGT = p_BKGTS.sum(-1)
    seen_BKGT = l_BKGT > 0
    l_BKGT = jnp.where(seen_BKGT, l_BKGT, 1.0)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                   preferred_element_type=wide(v_BSKH))
    o = o / l_BKGT.transpose(0, 3, 1, 2)[..., None]
    return o, jnp.where(seen_BKGT, m_BKGT + jnp.log(l_BKGT), NEG_INF)


def cached_attention(q_BTKGH, k_BSKH, v_BSKH, pos_BT):
    """Queries at positions `pos_BT` (each row its own) over a KV cache whose
    slot s holds position s: key s is seen where s <= the query's position
    (later slots are empty or stale). Decoding reads the whole cache once per
    token: this is xla_attention's math with a per-row mask."""
    q = scaled(q_BTKGH)
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_BSKH, preferred_element_type=wide(q))
    seen_BTS = jnp.arange(k_BSKH.shape[1])[None, None] <= pos_BT[..., None]
    s_BKGTS = jnp.where(seen_BTS[:, None, None], s_BKGTS, NEG_INF)
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return o.astype(q_BTKGH.dtype)


def xla_attention(q_BTKGH, k_BTKH, v_BTKH, return_lse: bool = False):
    """The reference: scores, fp32 softmax, weighted sum.

    With one query head per kv head (MHA, and the partitioner's replicated-kv layout)
    the scores are 4-D [B, N, T, S]: XLA's CPU compiler turns the 5-D grouped
    form into separate copy and select passes (measured 227 vs 117 ms of a
    tiny step's attention). The mask is a select fused into the max and exp.
    """
    B, T, K, G, H = q_BTKGH.shape
    q = scaled(q_BTKGH)
    mask = causal(T, T)
    if G == 1:
        s_BKTS = jnp.einsum("BTKH,BSKH->BKTS", q[:, :, :, 0], k_BTKH,
                            preferred_element_type=wide(q))
        s_BKTS = jnp.where(mask, s_BKTS, NEG_INF)
        p_BKTS = jax.nn.softmax(s_BKTS, axis=-1)
        o = jnp.einsum("BKTS,BSKH->BTKH", p_BKTS.astype(v_BTKH.dtype), v_BTKH)[:, :, :, None]
        lse = jax.nn.logsumexp(s_BKTS, axis=-1)[:, :, None] if return_lse else None
    else:
        s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_BTKH,
                             preferred_element_type=wide(q))
        s_BKGTS = jnp.where(mask, s_BKGTS, NEG_INF)
        p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
        o = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS.astype(v_BTKH.dtype), v_BTKH)
        lse = jax.nn.logsumexp(s_BKGTS, axis=-1) if return_lse else None
    o = o.astype(q_BTKGH.dtype)
    return (o, lse) if return_lse else o  # lse: [B, K, G, T]


def cudnn_attention(q_BTKGH, k_BTKH, v_BTKH):
    """cuDNN flash attention; query head n = k*G + g uses kv head k, as cuDNN's
    GQA expects (N divisible by K, no repeat)."""
    B, T, K, G, H = q_BTKGH.shape
    o_BTNH = jax.nn.dot_product_attention(
        q_BTKGH.reshape(B, T, K * G, H), k_BTKH, v_BTKH, is_causal=True,
        implementation="cudnn")
    return o_BTNH.reshape(B, T, K, G, H)


# ---------------------------------------------------------------- blockwise
#
# Layout inside: the G query heads of a kv head are folded into the rows of
# a query block, q [n, B, K, G*b, H] (n blocks of b positions), so every block
# product is a 4-D einsum against k [n, B, K, b, H], and k, v are never
# repeated per query head. Row r of a block is its query position r % b.
