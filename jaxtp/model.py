"""GPT-style Transformer: pre-norm blocks of attention and MLP.

Dimension alphabet used in variable names throughout jaxtp:
B batch, T sequence, D model, N heads, H head dim, F mlp hidden, V vocab,
C the q/k/v index of the fused QKV projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention
from .config import ModelConfig
from .layers import Embed, LayerNorm, dropout
from .mlp import MLP
from .sharding import constrain, spec


class Block(nnx.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)); the residual stream is replicated over tp."""

    def __init__(self, cfg: ModelConfig, *, impl: str, rngs: nnx.Rngs):
        ln = dict(eps=cfg.ln_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.ln1 = LayerNorm(cfg.d_model, **ln)
        self.attn = Attention(cfg, impl=impl, rngs=rngs)
        self.ln2 = LayerNorm(cfg.d_model, **ln)
        self.mlp = MLP(cfg, impl=impl, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x_BTD, key=None):
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x_BTD = x_BTD + dropout(self.attn(self.ln1(x_BTD)), self.rate, k1)
        x_BTD = x_BTD + dropout(self.mlp(self.ln2(x_BTD)), self.rate, k2)
        return constrain(x_BTD, "batch", "seq", "embed")


class Transformer(nnx.Module):
    """Token + learned position embeddings, L blocks, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", rngs: nnx.Rngs):
        emb = dict(std=cfg.init_std, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.wte = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), **emb)
        self.wpe = Embed(cfg.seq_len, cfg.d_model, (None, "embed"), **emb)
        self.blocks = nnx.List([Block(cfg, impl=impl, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = LayerNorm(cfg.d_model, eps=cfg.ln_eps, dtype=cfg.dtype,
                              param_dtype=cfg.param_dtype)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.d_model, cfg.vocab_size),
                                                  cfg.param_dtype),
            out_sharding=spec("embed", "vocab"))
        self.cfg = cfg

    def __call__(self, tokens_BT, *, dropout_key=None):
        """int tokens [B, T] -> fp32 logits [B, T, V]. A key enables dropout."""
        T = tokens_BT.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.cfg.seq_len}")
        keys = ([None] * (len(self.blocks) + 1) if dropout_key is None else
                list(jax.random.split(dropout_key, len(self.blocks) + 1)))
        x_BTD = self.wte(tokens_BT) + self.wpe(jnp.arange(T))[None]
        x_BTD = constrain(dropout(x_BTD, self.cfg.dropout, keys[0]), "batch", "seq", "embed")
        for block, key in zip(self.blocks, keys[1:]):
            x_BTD = block(x_BTD, key)
        x_BTD = self.ln_f(x_BTD)
        if self.lm_head is None:
            return self.wte.attend(x_BTD)
        return jnp.einsum("BTD,DV->BTV", x_BTD.astype(jnp.float32),
                          self.lm_head[...].astype(jnp.float32))
