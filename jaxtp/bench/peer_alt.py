"""A second, independently written plain-JAX GPT-2 training step (one device,
float32): the check on `jaxtp.bench.peer` (the two must agree within 5%), and,
with `tuned=True`, the strongest plain step we could write for XLA's CPU
backend. Its causal attention runs in 4 query chunks, chunk c meeting only
keys [0, (c+1)C) (the blocks above the diagonal are skipped, in both forms).
Tuned, attention and LayerNorm get hand-written backward passes (custom VJPs:
FlashAttention-2's rowsum(dO o) instead of autodiff's softmax chain, fewer
passes over the [B, N, C, L] scores); plain, autodiff differentiates the same
forward.
"""
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def tuned_attention(qkv_BT3D: jax.Array, n_heads: int) -> jax.Array:
    """Causal multi-head attention of a fused [q|k|v] projection [B,T,3D] -> [B,T,D]."""
    return _attention_fwd(qkv_BT3D, n_heads)[0]

def _attention_fwd(qkv_BT3D, n_heads):
    B, T, D3 = qkv_BT3D.shape
    H, C = D3 // (3 * n_heads), (T // 4 if T % 4 == 0 else T)  # 4 chunks: fastest at T=128
    q_BNTH, k_BNTH, v_BNTH = qkv_BT3D.reshape(B, T, 3, n_heads, H).transpose(2, 0, 3, 1, 4)
    q_BNTH = q_BNTH * (1.0 / math.sqrt(H))  # scale the small tensor, not the scores
    probs, outs = [], []  # per chunk: probabilities [B,N,C,L], outputs [B,N,C,H]
    for c in range(T // C):
        L = (c + 1) * C
        t_C1, s_L = np.arange(c * C, L)[:, None], np.arange(L)
        mask_CL = np.where(s_L <= t_C1, 0.0, -1e9).astype(np.float32)  # finite, added: fuses
        s_BNCL = q_BNTH[:, :, c * C:L] @ k_BNTH[:, :, :L].swapaxes(-1, -2) + mask_CL
        e_BNCL = jnp.exp(s_BNCL - s_BNCL.max(-1, keepdims=True))
        p_BNCL = e_BNCL / e_BNCL.sum(-1, keepdims=True)
        probs.append(p_BNCL)
        outs.append(p_BNCL @ v_BNTH[:, :, :L])
    o_BNTH = jnp.concatenate(outs, 2)
    o_BTD = o_BNTH.transpose(0, 2, 1, 3).reshape(B, T, D3 // 3)
    return o_BTD, (q_BNTH, k_BNTH, v_BNTH, probs, o_BNTH)

def _attention_bwd(n_heads, res, do_BTD):
    q_BNTH, k_BNTH, v_BNTH, probs, o_BNTH = res
    B, N, T, H = q_BNTH.shape
    C = T // len(probs)
    do_BNTH = do_BTD.reshape(B, T, N, H).transpose(0, 2, 1, 3)
    delta_BNT1 = (do_BNTH * o_BNTH).sum(-1, keepdims=True)  # = rowsum(dP * P)
    dqs, dk_BNTH, dv_BNTH = [], 0.0, 0.0
    for c, p_BNCL in enumerate(probs):
        L, rows = (c + 1) * C, slice(c * C, (c + 1) * C)
        pad = ((0, 0), (0, 0), (0, T - L), (0, 0))
        dv_BNTH = dv_BNTH + jnp.pad(p_BNCL.swapaxes(-1, -2) @ do_BNTH[:, :, rows], pad)
        dp_BNCL = do_BNTH[:, :, rows] @ v_BNTH[:, :, :L].swapaxes(-1, -2)
        ds_BNCL = p_BNCL * (dp_BNCL - delta_BNT1[:, :, rows])
        dqs.append(ds_BNCL @ k_BNTH[:, :, :L] * (1.0 / math.sqrt(H)))
        dk_BNTH = dk_BNTH + jnp.pad(ds_BNCL.swapaxes(-1, -2) @ q_BNTH[:, :, rows], pad)
    d_3BNTH = jnp.stack([jnp.concatenate(dqs, 2), dk_BNTH, dv_BNTH])
    return (d_3BNTH.transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * N * H),)

tuned_attention.defvjp(_attention_fwd, _attention_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def tuned_layer_norm(x_BTD, g_D, b_D, eps):
    """LayerNorm over the last axis, with scale and bias."""
    return _layer_norm_fwd(x_BTD, g_D, b_D, eps)[0]

def _layer_norm_fwd(x_BTD, g_D, b_D, eps):
    xc_BTD = x_BTD - x_BTD.mean(-1, keepdims=True)
    r_BT1 = jax.lax.rsqrt((xc_BTD * xc_BTD).mean(-1, keepdims=True) + eps)
    xh_BTD = xc_BTD * r_BT1
    return xh_BTD * g_D + b_D, (xh_BTD, r_BT1, g_D)

def _layer_norm_bwd(eps, res, dy_BTD):
    xh_BTD, r_BT1, g_D = res
    gd_BTD = dy_BTD * g_D
    dx_BTD = r_BT1 * (gd_BTD - gd_BTD.mean(-1, keepdims=True)
                      - xh_BTD * (gd_BTD * xh_BTD).mean(-1, keepdims=True))
    return dx_BTD, (dy_BTD * xh_BTD).sum((0, 1)), dy_BTD.sum((0, 1))

tuned_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def init(cfg, seed: int = 0) -> dict:
    """Parameters: normal(init_std), residual outputs init_std/sqrt(2L), zero biases."""
    m = cfg.model
    D, F, L, std = m.d_model, m.d_ff, m.n_layers, m.init_std
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 4 * L))
    w = lambda *shape, s=std: s * jax.random.normal(next(keys), shape, jnp.float32)
    z, o = (lambda n: jnp.zeros((n,), jnp.float32)), (lambda n: jnp.ones((n,), jnp.float32))
    rs = std / math.sqrt(2 * L)  # the residual-output projections
    blocks = [dict(ln1_g=o(D), ln1_b=z(D), w_qkv=w(D, 3 * D), b_qkv=z(3 * D),
                   w_o=w(D, D, s=rs), b_o=z(D), ln2_g=o(D), ln2_b=z(D), w_up=w(D, F),
                   b_up=z(F), w_down=w(F, D, s=rs), b_down=z(D)) for _ in range(L)]
    return dict(wte=w(m.padded_vocab, D), wpe=w(m.seq_len, D), lnf_g=o(D), lnf_b=z(D),
                blocks=blocks)


def loss(params: dict, tokens_BT1: jax.Array, cfg, tuned: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of int32 tokens [B, T+1]."""
    m = cfg.model
    if tuned:
        attention, layer_norm = tuned_attention, tuned_layer_norm
    else:  # autodiff through the same forward
        attention = lambda qkv, n: _attention_fwd(qkv, n)[0]
        layer_norm = lambda x, g, b, eps: _layer_norm_fwd(x, g, b, eps)[0]
    x_BT, y_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    x_BTD = params["wte"][x_BT] + params["wpe"][:x_BT.shape[1]]
    for blk in params["blocks"]:
        h_BTD = layer_norm(x_BTD, blk["ln1_g"], blk["ln1_b"], m.ln_eps)
        a_BTD = attention(h_BTD @ blk["w_qkv"] + blk["b_qkv"], m.n_heads)
        x_BTD = x_BTD + a_BTD @ blk["w_o"] + blk["b_o"]
        h_BTD = layer_norm(x_BTD, blk["ln2_g"], blk["ln2_b"], m.ln_eps)
        u_BTF = jax.nn.gelu(h_BTD @ blk["w_up"] + blk["b_up"], approximate=True)
        x_BTD = x_BTD + u_BTF @ blk["w_down"] + blk["b_down"]
    x_BTD = layer_norm(x_BTD, params["lnf_g"], params["lnf_b"], m.ln_eps)
    logits_BTV = x_BTD @ params["wte"].T
    if m.padded_vocab > m.vocab_size:  # padding rows of the table are never predicted
        logits_BTV = jnp.where(jnp.arange(m.padded_vocab) < m.vocab_size, logits_BTV, -1e9)
    picked_BT = jnp.take_along_axis(logits_BTV, y_BT[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits_BTV, -1) - picked_BT).mean()


def make_step(cfg, tuned: bool = False):
    """(step, params, opt_state): jitted step(params, opt_state, tokens) -> (params,
    opt_state, loss), donating params and opt_state."""
    t = cfg.train
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    opt = optax.chain(clip, optax.adamw(t.lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
    params = init(cfg, t.seed)
    def step(params, opt_state, tokens_BT1):
        value, grads = jax.value_and_grad(loss)(params, tokens_BT1, cfg, tuned)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return jax.jit(step, donate_argnums=(0, 1)), params, opt.init(params)
