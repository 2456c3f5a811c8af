"""Causal self-attention with heads split over tp (GSPMD or shard_map)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import ColumnParallelLinear, RowParallelLinear, init_std_out
from .manual import tp_region
from .sharding import constrain


class Attention(nnx.Module):
    """Multi-head causal attention, Megatron layout.

    W_qkv: [D, 3, N, H] column-parallel by heads (each rank [D, 3, N/tp, H]);
    every rank attends over its own N/tp heads with no communication;
    W_out: [N, H, D] row-parallel (each rank [N/tp, H, D]). One all-reduce
    forward (g, after W_out) and one backward (f, the gradient of x entering
    W_qkv). The fused QKV kernel gives one f, not three.
    """

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  rngs=rngs)
        N, H = cfg.n_heads, cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.d_model, (3, N, H), (None, "heads", "head_dim"),
                                        std=cfg.init_std, **kw)
        self.out = RowParallelLinear((N, H), ("heads", "head_dim"), cfg.d_model,
                                     std=init_std_out(cfg.init_std, cfg.n_layers), **kw)
        self.impl = impl

    def region(self, x_BTD):
        """Local math from replicated x to the partial (pre-reduction) output.

        N below is whatever head count the kernels hold: all heads under GSPMD,
        the rank's N/tp heads inside shard_map. Shapes come from the arrays,
        never from the config.
        """
        qkv_BTCNH = self.qkv(x_BTD)
        qkv_BTCNH = constrain(qkv_BTCNH, "batch", "seq", None, "heads", "head_dim")
        q_BTNH, k_BTNH, v_BTNH = (qkv_BTCNH[:, :, i] for i in range(3))
        T, H = q_BTNH.shape[1], q_BTNH.shape[-1]
        logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BTNH,
                                 preferred_element_type=jnp.float32) / jnp.sqrt(H)
        causal_TS = jnp.tril(jnp.ones((T, T), bool))
        logits_BNTS = jnp.where(causal_TS, logits_BNTS, jnp.finfo(jnp.float32).min)
        probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(v_BTNH.dtype)
        o_BTNH = jnp.einsum("BNTS,BSNH->BTNH", probs_BNTS, v_BTNH)
        return self.out.partial(o_BTNH)

    def __call__(self, x_BTD):
        with jax.named_scope("attention"):
            return self.out.add_bias(tp_region(self, x_BTD))
