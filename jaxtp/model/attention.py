"""Causal self-attention with heads split over tp: multi-head, grouped-query
(GQA) and multi-query (MQA), optional RoPE and per-head q/k RMSNorm, any
kernel of `kernels`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from .. import parallel
from ..config import ModelConfig
from ..parallel import Layout
from . import kernels
from .layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear, autodiff_norms,
                     init_std_out, rope, rope_inv_freq)


class Attention(nnx.Module):
    """Causal attention, Megatron layout; N query heads in K groups of G = N/K.

    W_q: [D, N, H] and W_kv: [D, 2, K, H] are column-parallel by heads; every
    rank attends over its own heads with no communication; W_out: [N, H, D] is
    row-parallel. One all-reduce forward (g, after W_out) and one backward (f,
    the gradient of x entering the projections). The layout says which of two
    kv layouts a run has (`_grouped` when tp divides K, else `_shared`).
    With `model.qk_norm`, q and k are RMS-normalised per head over H before
    RoPE (Qwen3), by two replicated [H] scales.
    """

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  rngs=rngs)
        N, K, H, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
        kv_axis = "kv_heads" if layout.kv_sharded else None
        qkv = kw | {"use_bias": cfg.use_bias or cfg.qkv_bias}  # (Qwen2: q, k, v alone)
        self.q = ColumnParallelLinear(D, (N, H), ("heads", "head_dim"), "NH", layout,
                                      std=cfg.init_std, **qkv)
        self.kv = ColumnParallelLinear(D, (2, K, H), (None, kv_axis, "head_dim"), "CKH",
                                       layout, std=cfg.init_std, **qkv)
        self.out = RowParallelLinear((N, H), ("heads", "head_dim"), "NH", D, layout,
                                     std=init_std_out(cfg.init_std, cfg.n_layers), **kw)
        # Qwen3's q_norm / k_norm (HF Qwen3MoeAttention): over each head's H
        # dims, so any split of the heads over tp leaves them local
        norm = lambda: RMSNorm(H, layout, eps=cfg.ln_eps, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, axis="head_dim",
                               autodiff=autodiff_norms(cfg, layout))
        self.q_norm, self.k_norm = (norm(), norm()) if cfg.qk_norm else (None, None)
        self.rope_theta = cfg.rope_theta if cfg.style == "llama" else None
        self.cfg, self.layout = cfg, layout
        self.kernel, self.block = cfg.attention, cfg.attention_block
        self.tag = "attn_out"  # the region's reduced output, for remat policies

    def __call__(self, x_BTD):
        with jax.named_scope("attention"):
            return self.out.add_bias(parallel.region(self, x_BTD))

    def extend(self, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
        """Attention that reads and extends a KV cache (`cached_region`):
        (output, k cache, v cache)."""
        with jax.named_scope("attention"):
            y_BTD, k_BSKH, v_BSKH = parallel.cached_region(self, x_BTD, k_BSKH, v_BSKH, pos_BT,
                                                           prefill)
            return self.out.add_bias(y_BTD), k_BSKH, v_BSKH

    def region(self, x_BTD, local):
        """Local math from x to the output summed over tp (`local.exit`)."""
        qkv = self._grouped if self.layout.kv_sharded else self._shared
        q_BTKGH, k_BTKH, v_BTKH = qkv(x_BTD, local)
        q_BTKGH, k_BTKH = self._qk_norm(q_BTKGH, k_BTKH)
        B, T, K, G, H = q_BTKGH.shape
        if self.rope_theta is not None:
            pos_T, inv_freq = local.positions(T), rope_inv_freq(H, self.cfg)
            q_BTKGH = rope(q_BTKGH, pos_T, self.rope_theta, inv_freq)
            k_BTKH = rope(k_BTKH, pos_T, self.rope_theta, inv_freq)
        kernel, block = self.kernel, self.block
        if kernel == "auto":  # a module used on its own; a model resolves it when built
            device = jax.devices()[0]
            kernel = kernels.choose(kernel, q_BTKGH.dtype, H, T, device)
            block = kernels.choose_block("auto", block, device)
        o_BTKGH = local.attend(kernels.Core(kernel, block), q_BTKGH, k_BTKH, v_BTKH)
        o_BTKGH = checkpoint_name(o_BTKGH, "attn_core")
        # split by heads into the row-parallel matmul, so that its transpose
        # keeps the output gradient's product split by heads too (an SP
        # gradient split along T would otherwise reach the core: all-to-alls)
        o_BTNH = local.constrain(o_BTKGH.reshape(B, T, K * G, H), "batch", "seq", "heads",
                                 "head_dim")
        return local.exit(o_BTNH, self.out.partial)

    def cached_region(self, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool, local):
        """`region` over a KV cache [B, S, Kc, H] whose slot s holds position s
        (Kc: K split over tp, or, when K < tp, on each rank the one kv head its
        query heads use): (partial output, k cache, v cache). `prefill`: x is
        every row's prompt from position 0 (right-padded), attended by the
        configured kernel and written to slots [0, T); else one token per row
        at `pos_BT` [B, 1], written to its slot and attending over the cache."""
        if self.layout.kv_sharded:
            q_BTKGH, k_BTKH, v_BTKH = self._grouped(x_BTD, local)
        else:
            q_BTNH = self.q(local.enter(x_BTD))
            kv_BTCKH = local.kv_per_rank(self.kv(x_BTD))
            B, T, N, H = q_BTNH.shape
            K = kv_BTCKH.shape[3]
            q_BTKGH, k_BTKH, v_BTKH = (q_BTNH.reshape(B, T, K, N // K, H), kv_BTCKH[:, :, 0],
                                       kv_BTCKH[:, :, 1])
        q_BTKGH, k_BTKH = self._qk_norm(q_BTKGH, k_BTKH)
        if self.rope_theta is not None:
            inv_freq = rope_inv_freq(q_BTKGH.shape[-1], self.cfg)
            q_BTKGH = rope(q_BTKGH, pos_BT, self.rope_theta, inv_freq)
            k_BTKH = rope(k_BTKH, pos_BT, self.rope_theta, inv_freq)
        k_BTKH, v_BTKH = k_BTKH.astype(k_BSKH.dtype), v_BTKH.astype(v_BSKH.dtype)
        if prefill:
            o_BTKGH = kernels.attend(q_BTKGH, k_BTKH, v_BTKH, self.kernel, self.block)
            k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH, 0, 1)
            v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH, 0, 1)
        else:  # a select, not a scatter: no row's slot is special to the partitioner
            at_BS11 = (jnp.arange(k_BSKH.shape[1])[None] == pos_BT)[..., None, None]
            k_BSKH = jnp.where(at_BS11, k_BTKH, k_BSKH)
            v_BSKH = jnp.where(at_BS11, v_BTKH, v_BSKH)
            o_BTKGH = kernels.cached_attention(q_BTKGH, k_BSKH, v_BSKH, pos_BT)
        B, T, K, G, H = o_BTKGH.shape
        return self.out.partial(o_BTKGH.reshape(B, T, K * G, H)), k_BSKH, v_BSKH

    def _qk_norm(self, q_BTKGH, k_BTKH):
        """q and k normalised per head (`model.qk_norm`), else as they are."""
        if self.q_norm is None:
            return q_BTKGH, k_BTKH
        return self.q_norm(q_BTKGH), self.k_norm(k_BTKH)

    def _grouped(self, x_BTD, local):
        """tp divides K: each rank holds K/tp kv heads and the N/tp query heads
        of their groups. Per group the projections are one [D, K, G+2, H]
        matmul (G queries, k, v, as Megatron-LM lays out its QKV), so x has one
        consumer and the backward pass one f."""
        (wq_DNH, bq_NH), (wkv_DCKH, bkv_CKH) = self.q.weights(), self.kv.weights()
        D, N, H = wq_DNH.shape
        K = wkv_DCKH.shape[2]
        G = N // K
        w_DKCH = jnp.concatenate([wq_DNH.reshape(D, K, G, H), wkv_DCKH.transpose(0, 2, 1, 3)], 2)
        y_BTKCH = local.enter(
            x_BTD, lambda x, out_sharding=None: jnp.einsum(
                "BTD,DKCH->BTKCH", x.astype(w_DKCH.dtype), w_DKCH, out_sharding=out_sharding),
            ("kv_heads", None, "head_dim"))
        if bq_NH is not None:
            y_BTKCH += jnp.concatenate([bq_NH.reshape(K, G, H), bkv_CKH.transpose(1, 0, 2)], 1)
        y_BTKCH = checkpoint_name(
            local.constrain(y_BTKCH, "batch", "seq", "kv_heads", None, "head_dim"), "qkv")
        return y_BTKCH[:, :, :, :G], y_BTKCH[:, :, :, G], y_BTKCH[:, :, :, G + 1]

    def _shared(self, x_BTD, local):
        """K < tp (tp a multiple of K): the kv projection is replicated. Every
        rank computes k, v from the replicated x (under SP the gathered one; no
        partial dX, so no second f) and keeps the kv head its query heads use
        (`local.kv_for_heads`); the kv gradient, which the ranks sharing a head
        each hold a part of, is summed in the backward pass."""
        if self.layout.sp:  # both from the gathered x, in one entry
            q_BTNH, kv_BTCKH = local.enter(x_BTD, lambda x: (self.q(x), self.kv(x)))
        else:
            q_BTNH, kv_BTCKH = self.q(local.enter(x_BTD)), self.kv(x_BTD)
        q_BTNH, kv_BTCKH = checkpoint_name(q_BTNH, "qkv"), checkpoint_name(kv_BTCKH, "qkv")
        kv_BTCKH = local.kv_for_heads(kv_BTCKH, q_BTNH.shape[2])
        B, T, N, H = q_BTNH.shape
        K = kv_BTCKH.shape[3]  # kv heads this rank sees: one, N copies (partitioned), tp (typed)
        return q_BTNH.reshape(B, T, K, N // K, H), kv_BTCKH[:, :, 0], kv_BTCKH[:, :, 1]
