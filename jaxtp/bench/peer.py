"""A peer to time jaxtp against: a GPT-2 train step in plain JAX.

Written from the GPT-2 equations with none of jaxtp's modules, as fast as a
plain step (autodiff only, no custom derivative rules) runs on XLA's CPU
backend: a dict of arrays, 2-D matmuls, causal attention in query blocks of
32 rows that skip the keys past a block's end, a finite causal mask added
(it fuses into the softmax), the 1/sqrt(H) scale on q, the head against
the whole padded table with the padding logits masked (slicing `wte[:vocab]`
copies the table), optax clip-by-global-norm + AdamW. Same shapes,
optimizer and dtypes as a jaxtp `gpt2` config at tp=1.

What made the earlier form of this file slow (the tiny step, 2-core AMD
EPYC, jaxlib 0.10.2): LayerNorm writing `x - mean` twice (autodiff gives
each its own backward pass: the loss and gradient took 1.6x the time) and
the full [B, N, T, T] scores; `where(mask, s, -inf)` and the [B, T, 3, N, H]
slices cost little. `jaxtp.bench.peer_alt` is a second, independently
written plain step it is checked against (`python -m jaxtp.bench --only peer`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import Config

MASKED = -1e9  # finite: exp underflows to 0 exactly, and no inf - inf
QUERY_ROWS = 32  # causal attention in query blocks: the keys past a block's end skipped


def init(cfg: Config, seed: int = 0) -> dict:
    m = cfg.model
    D, F, V, L, N, H = m.d_model, m.d_ff, m.padded_vocab, m.n_layers, m.n_heads, m.head_dim
    keys = iter(jax.random.split(jax.random.key(seed), 4 * L + 2))
    normal = lambda shape, std=m.init_std: std * jax.random.normal(next(keys), shape)
    out_std = m.init_std / np.sqrt(2 * L)
    layer = lambda: {
        "ln1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
        "qkv": {"w": normal((D, 3, N, H)), "b": jnp.zeros((3, N, H))},
        "out": {"w": normal((N, H, D), out_std), "b": jnp.zeros(D)},
        "ln2": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
        "up": {"w": normal((D, F)), "b": jnp.zeros(F)},
        "down": {"w": normal((F, D), out_std), "b": jnp.zeros(D)},
    }
    return {"wte": normal((V, D)), "wpe": normal((m.seq_len, D)),
            "layers": [layer() for _ in range(L)],
            "ln_f": {"scale": jnp.ones(D), "bias": jnp.zeros(D)}}


def _ln(x, p, eps):
    xc = x - x.mean(-1, keepdims=True)
    return xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + eps) * p["scale"] + p["bias"]


def loss(params: dict, tokens_BT1, cfg: Config):
    m = cfg.model
    x_BT, y_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    B, T = x_BT.shape
    D, N, H = m.d_model, m.n_heads, m.head_dim
    x = params["wte"][x_BT] + params["wpe"][:T]
    causal_TS = np.where(np.tril(np.ones((T, T), bool)), 0.0, MASKED).astype(np.float32)
    for p in params["layers"]:
        h = _ln(x, p["ln1"], m.ln_eps)
        qkv = h @ p["qkv"]["w"].reshape(D, -1) + p["qkv"]["b"].reshape(-1)
        q, k, v = qkv.reshape(B, T, 3, N, H).transpose(2, 0, 3, 1, 4)
        q = q * H ** -0.5
        o = []
        for lo in range(0, T, QUERY_ROWS):  # causal: keys [0, hi) only
            hi = min(lo + QUERY_ROWS, T)
            s = jnp.einsum("bnth,bnsh->bnts", q[:, :, lo:hi], k[:, :, :hi]) + causal_TS[lo:hi, :hi]
            e = jnp.exp(s - s.max(-1, keepdims=True))  # softmax, as written out
            o.append(jnp.einsum("bnts,bnsh->bnth", e / e.sum(-1, keepdims=True), v[:, :, :hi]))
        o = jnp.concatenate(o, 2).transpose(0, 2, 1, 3).reshape(B, T, D) \
            @ p["out"]["w"].reshape(D, D)
        x = x + o + p["out"]["b"]
        h = _ln(x, p["ln2"], m.ln_eps)
        x = x + jax.nn.gelu(h @ p["up"]["w"] + p["up"]["b"], approximate=True) @ p["down"]["w"] \
            + p["down"]["b"]
    logits = _ln(x, params["ln_f"], m.ln_eps) @ params["wte"].T
    if m.padded_vocab > m.vocab_size:  # the padding rows are never predicted
        logits = logits + np.where(np.arange(m.padded_vocab) < m.vocab_size, 0.0, MASKED)
    picked = jnp.take_along_axis(logits, y_BT[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1) - picked).mean()


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
