"""An independent single-device GPT forward in plain jax.numpy.

Written from the GPT-2 equations, not from jaxtp's modules: it reads the
parameters as a nested dict of full (unsharded) arrays and uses plain matmuls
and reshapes, so a layout or collective bug in jaxtp cannot hide in it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def host_params(params) -> dict:
    """nnx.State (any sharding) -> nested dict of full numpy arrays."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(params)))


def _ln(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def attention(a: dict, h, cfg):
    """Causal multi-head attention of h [B, T, D] with parameters a (qkv, out)."""
    B, T, D = h.shape
    N = cfg.n_heads
    Hd = D // N
    w = a["qkv"]["kernel"].reshape(D, 3 * D)  # columns ordered (c, n, h)
    qkv = h.reshape(B * T, D) @ w
    if cfg.use_bias:
        qkv = qkv + a["qkv"]["bias"].reshape(3 * D)
    q, k, v = (qkv[:, c * D:(c + 1) * D].reshape(B, T, N, Hd).transpose(0, 2, 1, 3)
               for c in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(Hd)
    s = jnp.where(np.tril(np.ones((T, T), bool)), s, -1e30)
    o = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B * T, D)
    o = o @ a["out"]["kernel"].reshape(D, D)
    if cfg.use_bias:
        o = o + a["out"]["bias"]
    return o.reshape(B, T, D)


def mlp(m: dict, h, cfg):
    """GELU (tanh form) MLP of h [B, T, D] with parameters m (up, down)."""
    B, T, D = h.shape
    u = h.reshape(B * T, D) @ m["up"]["kernel"]
    if cfg.use_bias:
        u = u + m["up"]["bias"]
    u = 0.5 * u * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
    d = u @ m["down"]["kernel"]
    if cfg.use_bias:
        d = d + m["down"]["bias"]
    return d.reshape(B, T, D)


def forward(p: dict, tokens, cfg):
    T = tokens.shape[1]
    x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][:T]
    for i in range(cfg.n_layers):
        b = p["blocks"][i]
        x = x + attention(b["attn"], _ln(x, b["ln1"], cfg.ln_eps), cfg)
        x = x + mlp(b["mlp"], _ln(x, b["ln2"], cfg.ln_eps), cfg)
    x = _ln(x, p["ln_f"], cfg.ln_eps)
    head = p["wte"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


def loss(p: dict, tokens_BT1, cfg):
    logits = forward(p, tokens_BT1[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens_BT1[:, 1:]
    return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()
