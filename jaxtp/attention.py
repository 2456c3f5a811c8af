"""Causal self-attention with heads split over tp (GSPMD or shard_map):
multi-head, grouped-query (GQA) and multi-query (MQA), optional RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from . import kernels
from .config import ModelConfig
from .layers import ColumnParallelLinear, RowParallelLinear, init_std_out, rope, rope_inv_freq
from .manual import in_shard_map, tp_rank, tp_region
from .sharding import constrain, mesh_axis_size


class Attention(nnx.Module):
    """Causal attention, Megatron layout; N query heads in K groups of G = N/K.

    W_q: [D, N, H] and W_kv: [D, 2, K, H] are column-parallel by heads; every
    rank attends over its own heads with no communication; W_out: [N, H, D] is
    row-parallel. One all-reduce forward (g, after W_out) and one backward (f,
    the gradient of x entering the projections). Two kv layouts:

    - tp divides K: each rank holds K/tp kv heads and the N/tp query heads of
      their groups. Per group the projections are fused into one [D, K, G+2, H]
      kernel (G queries, k, v, as Megatron-LM lays out its QKV), so x has one
      consumer and the backward pass one all-reduce.
    - K < tp (tp a multiple of K): the kv projection is replicated. Every rank
      computes k, v from the replicated x (no partial dX, so no extra f) and
      keeps the one kv head its N/tp query heads use; the kv gradient, which
      the tp/K ranks of a group each hold a part of, is all-reduced in the
      backward pass.
    """

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", sp: bool = False,
                 rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  rngs=rngs)
        N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.kv_sharded = K % mesh_axis_size("tp") == 0
        self.q = ColumnParallelLinear(cfg.d_model, (N, H), ("heads", "head_dim"),
                                      std=cfg.init_std, **kw)
        self.kv = ColumnParallelLinear(
            cfg.d_model, (2, K, H), (None, "kv_heads" if self.kv_sharded else None, "head_dim"),
            std=cfg.init_std, **kw)
        self.out = RowParallelLinear((N, H), ("heads", "head_dim"), cfg.d_model,
                                     std=init_std_out(cfg.init_std, cfg.n_layers), **kw)
        self.group = N // K
        self.rope_theta = cfg.rope_theta if cfg.style == "llama" else None
        self.cfg = cfg
        self.impl, self.sp = impl, sp
        self.kernel, self.block = cfg.attention, cfg.attention_block
        self.tag = "attn_out"  # the region's reduced output, for remat policies

    def _project(self, x_BTD, enter):
        """q [B, T, k, G', H], k and v [B, T, k, H]: k groups of G' query heads
        sharing one kv head. Counts come from the (local) kernels."""
        dt = self.q.dtype
        wq_DNH, wkv_DCKH = self.q.kernel[...].astype(dt), self.kv.kernel[...].astype(dt)
        bias = self.q.bias is not None
        D, N, H = wq_DNH.shape
        K = wkv_DCKH.shape[2]
        if self.kv_sharded:
            G = N // K
            w_DKCH = jnp.concatenate([wq_DNH.reshape(D, K, G, H),
                                      wkv_DCKH.transpose(0, 2, 1, 3)], axis=2)
            y_BTKCH = jnp.einsum("BTD,DKCH->BTKCH", enter(x_BTD).astype(dt), w_DKCH)
            if bias:
                y_BTKCH += jnp.concatenate([self.q.bias[...].reshape(K, G, H),
                                            self.kv.bias[...].transpose(1, 0, 2)], 1).astype(dt)
            y_BTKCH = checkpoint_name(
                constrain(y_BTKCH, "batch", "seq", "kv_heads", None, "head_dim"), "qkv")
            return y_BTKCH[:, :, :, :G], y_BTKCH[:, :, :, G], y_BTKCH[:, :, :, G + 1]
        x_in = enter(x_BTD)
        q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_in.astype(dt), wq_DNH)
        # k, v from the replicated x; under SP the gathered one (the full sequence)
        kv_BTCKH = jnp.einsum("BTD,DCKH->BTCKH", (x_in if self.sp else x_BTD).astype(dt),
                              wkv_DCKH)
        if bias:
            q_BTNH += self.q.bias[...].astype(dt)
            kv_BTCKH += self.kv.bias[...].astype(dt)
        q_BTNH, kv_BTCKH = checkpoint_name(q_BTNH, "qkv"), checkpoint_name(kv_BTCKH, "qkv")
        B, T = q_BTNH.shape[:2]
        if in_shard_map():  # this rank's N/tp query heads all use one kv head
            kv_BTCKH = jax.lax.dynamic_slice_in_dim(kv_BTCKH, tp_rank() * N // self.group, 1, 3)
            q_BTKGH = q_BTNH.reshape(B, T, 1, N, H)
        else:
            # The global view of the same thing: one kv copy per query head,
            # split over tp like the queries (each rank slices its own; the
            # backward sums the copies, an all-reduce of dkv over tp). Grouping
            # q as [K, G] instead would need a tiling over two dims that one
            # mesh axis cannot name, and GSPMD then gathers weights.
            # Pinning kv replicated first also pins its gradient (the transpose
            # of a sharding constraint is the same constraint), so dW_kv stays
            # replicated like W_kv.
            kv_BTCKH = constrain(kv_BTCKH, "batch", "seq", None, None, "head_dim")
            kv_BTCKH = constrain(jnp.repeat(kv_BTCKH, N // K, axis=3),
                                 "batch", "seq", None, "heads", "head_dim")
            q_BTKGH = q_BTNH.reshape(B, T, N, 1, H)
        return q_BTKGH, kv_BTCKH[:, :, 0], kv_BTCKH[:, :, 1]

    def region(self, x_BTD, enter):
        """Local math from replicated x to the partial (pre-reduction) output."""
        q_BTKGH, k_BTKH, v_BTKH = self._project(x_BTD, enter)
        B, T, K, G, H = q_BTKGH.shape
        if self.rope_theta is not None:
            pos_T, inv_freq = jnp.arange(T), rope_inv_freq(H, self.cfg)
            q_BTKGH = rope(q_BTKGH, pos_T, self.rope_theta, inv_freq)
            k_BTKH = rope(k_BTKH, pos_T, self.rope_theta, inv_freq)
        kernel = self.kernel
        if kernel == "auto":  # a module used on its own; a model resolves it when built
            kernel = kernels.choose(kernel, q_BTKGH.dtype, H, T, jax.devices()[0])
        o_BTKGH = kernels.attend(q_BTKGH, k_BTKH, v_BTKH, kernel, self.block)
        o_BTKGH = checkpoint_name(o_BTKGH, "attn_core")
        return self.out.partial(o_BTKGH.reshape(B, T, K * G, H))

    def __call__(self, x_BTD):
        with jax.named_scope("attention"):
            return self.out.add_bias(tp_region(self, x_BTD))
