"""A peer to time jaxtp against: a GPT-2 train step in plain JAX.

Written from the GPT-2 equations with none of jaxtp's modules: a dict of
arrays, 2-D matmuls, 4-D [B, N, T, S] attention scores with the scale folded
into q, an fp32 softmax, the full-vocabulary cross-entropy, and optax's
clip-by-global-norm + AdamW. Same shapes, optimizer and dtypes as a jaxtp
`gpt2` config at tp=1; what jaxtp adds on top (tensor-parallel layouts,
the guarded update, the vocab-parallel loss, the gradient norm it logs) is
what `python -m jaxtp.bench --only peer` prices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import Config


def init(cfg: Config, seed: int = 0) -> dict:
    m = cfg.model
    D, F, V, L = m.d_model, m.d_ff, m.padded_vocab, m.n_layers
    keys = iter(jax.random.split(jax.random.key(seed), 4 * L + 2))
    normal = lambda shape, std=m.init_std: std * jax.random.normal(next(keys), shape)
    out_std = m.init_std / np.sqrt(2 * L)
    layer = lambda: {
        "ln1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
        "qkv": {"w": normal((D, 3 * D)), "b": jnp.zeros(3 * D)},
        "out": {"w": normal((D, D), out_std), "b": jnp.zeros(D)},
        "ln2": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
        "up": {"w": normal((D, F)), "b": jnp.zeros(F)},
        "down": {"w": normal((F, D), out_std), "b": jnp.zeros(D)},
    }
    return {"wte": normal((V, D)), "wpe": normal((m.seq_len, D)),
            "layers": [layer() for _ in range(L)],
            "ln_f": {"scale": jnp.ones(D), "bias": jnp.zeros(D)}}


def _ln(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def loss(params: dict, tokens_BT1, cfg: Config):
    m = cfg.model
    x_in, y = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    B, T = x_in.shape
    N, H = m.n_heads, m.head_dim
    x = params["wte"][x_in] + params["wpe"][:T]
    mask = jnp.tril(jnp.ones((T, T), bool))
    for p in params["layers"]:
        h = _ln(x, p["ln1"], m.ln_eps)
        qkv = (h @ p["qkv"]["w"] + p["qkv"]["b"]).reshape(B, T, 3, N, H)
        q, k, v = qkv[:, :, 0] * H ** -0.5, qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k), -jnp.inf)
        o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v).reshape(B, T, N * H)
        x = x + o @ p["out"]["w"] + p["out"]["b"]
        h = _ln(x, p["ln2"], m.ln_eps)
        x = x + jax.nn.gelu(h @ p["up"]["w"] + p["up"]["b"], approximate=True) @ p["down"]["w"] \
            + p["down"]["b"]
    logits = _ln(x, params["ln_f"], m.ln_eps) @ params["wte"][: m.vocab_size].T
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()


def make_step(cfg: Config):
    """(jitted step (params, opt_state, tokens) -> (params, opt_state, loss), params, opt_state)."""
    t = cfg.train
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(t.lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
    params = init(cfg, t.seed)

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params)
