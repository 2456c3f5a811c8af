"""An independent single-device decoder forward in plain jax.numpy.

Written from the GPT-2 and Llama equations, not from jaxtp's modules: it reads
the parameters as a nested dict of full (unsharded) arrays and uses plain 2-D
matmuls, Hugging Face style `repeat_kv` for grouped-query attention, its own
rotary embedding and a full-vocabulary softmax, so a layout or collective bug
in jaxtp cannot hide in it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def host_params(params) -> dict:
    """nnx.State (any sharding) -> nested dict of full numpy arrays."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(params)))


def _norm(x, p, cfg):
    if cfg.style == "llama":
        return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.ln_eps) * p["scale"]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + cfg.ln_eps) * p["scale"] + p["bias"]


def _rotary(x, theta):
    """x [B, N, T, H]: rotate pairs (i, i + H/2) by position * theta^(-2i/H),
    angles in float32 as Hugging Face's LlamaRotaryEmbedding computes them."""
    T, H = x.shape[2], x.shape[3]
    freq = (1.0 / theta ** (np.arange(0, H, 2, dtype=np.float32) / H)).astype(np.float32)
    ang = np.arange(T, dtype=np.float32)[:, None] * freq[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = jnp.concatenate([-x[..., H // 2:], x[..., : H // 2]], -1)
    return x * cos + rot * sin


def attention(a: dict, h, cfg):
    """Causal attention of h [B, T, D]; q [D, N, H], kv [D, 2, K, H], out [N, H, D]
    (H: d_head, else D / N); with qk_norm, Qwen3's RMSNorm of each q and k
    head before the rotation (HF Qwen3MoeAttention: q_norm, k_norm)."""
    B, T, D = h.shape
    N, K, Hd = cfg.n_heads, cfg.kv_heads, cfg.d_head or D // cfg.n_heads
    h2 = h.reshape(B * T, D)
    q = h2 @ a["q"]["kernel"].reshape(D, N * Hd)
    k = h2 @ a["kv"]["kernel"][:, 0].reshape(D, K * Hd)
    v = h2 @ a["kv"]["kernel"][:, 1].reshape(D, K * Hd)
    if cfg.use_bias:
        q = q + a["q"]["bias"].reshape(-1)
        k = k + a["kv"]["bias"][0].reshape(-1)
        v = v + a["kv"]["bias"][1].reshape(-1)
    q = q.reshape(B, T, N, Hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, T, K, Hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, K, Hd).transpose(0, 2, 1, 3)
    if cfg.qk_norm:
        rms = lambda x, w: x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.ln_eps) * w
        q, k = rms(q, a["q_norm"]["scale"]), rms(k, a["k_norm"]["scale"])
    if cfg.style == "llama":
        q, k = _rotary(q, cfg.rope_theta), _rotary(k, cfg.rope_theta)
    k, v = jnp.repeat(k, N // K, axis=1), jnp.repeat(v, N // K, axis=1)  # repeat_kv
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(Hd)
    s = jnp.where(np.tril(np.ones((T, T), bool)), s, -1e30)
    o = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B * T, N * Hd)
    o = o @ a["out"]["kernel"].reshape(N * Hd, D)
    if cfg.use_bias:
        o = o + a["out"]["bias"]
    return o.reshape(B, T, D)


def mlp(m: dict, h, cfg):
    """GELU (tanh form) or SwiGLU MLP of h [B, T, D]."""
    B, T, D = h.shape
    h2 = h.reshape(B * T, D)
    up = m["up"]["kernel"]
    if cfg.style == "llama":  # up kernel [D, 2, F]: gate, up
        u = h2 @ up[:, 0] + (m["up"]["bias"][0] if cfg.use_bias else 0)
        w = h2 @ up[:, 1] + (m["up"]["bias"][1] if cfg.use_bias else 0)
        u = u / (1 + jnp.exp(-u)) * w
    else:
        u = h2 @ up + (m["up"]["bias"] if cfg.use_bias else 0)
        u = 0.5 * u * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
    d = u @ m["down"]["kernel"]
    if cfg.use_bias:
        d = d + m["down"]["bias"]
    return d.reshape(B, T, D)


def forward(p: dict, tokens, cfg):
    """Logits [B, T, vocab_size] (padding rows of the tables dropped)."""
    T = tokens.shape[1]
    x = p["wte"]["embedding"][tokens]
    if cfg.style != "llama":
        x = x + p["wpe"]["embedding"][:T]
    for i in range(cfg.n_layers):
        b = p["blocks"][i]
        x = x + attention(b["attn"], _norm(x, b["ln1"], cfg), cfg)
        x = x + mlp(b["mlp"], _norm(x, b["ln2"], cfg), cfg)
    x = _norm(x, p["ln_f"], cfg)
    table = p["wte" if cfg.tie_embeddings else "lm_head"]["embedding"]
    return x @ table[: cfg.vocab_size].T


def loss(p: dict, tokens_BT1, cfg):
    logits = forward(p, tokens_BT1[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens_BT1[:, 1:]
    return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()
