"""The optimizer: AdamW with warmup and cosine decay, and clipping by the
global gradient norm that is also logged (one reduction over the mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import TrainConfig
from ..parallel import global_norm


def lr_schedule(t: TrainConfig, dtype=np.float32) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, cosine decay to `lr * min_lr_ratio` at `steps`.

    Step 1 runs at lr 0 (it only seeds Adam's moments). Its update would be
    lr * g / (|g| + eps) ~ lr * sign(g): round-off-sized gradients would get
    lr-sized steps of arbitrary sign, and parallel runs would drift ~100x
    further from a single device (measured: 1e-5 vs 1e-7 after 10 steps).

    `dtype`: float32 (optax's schedule), or float64 for a float64 run
    (`--float64`): optax's warmup is computed in float32 whatever its inputs
    (its linear schedule casts), and its `lr - lr * (1 - n/w)` rounds
    apart by compile (measured on XLA:CPU: 2.2e-7 relative at n = 1 between
    -O0 and the default), which parted two layouts' float64 runs by 7e-9
    within 4 steps; the same formula in float64 instead.
    """
    steps = max(t.steps, t.warmup_steps + 1)
    if np.dtype(dtype) != np.float64:
        return optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, steps,
                                                  t.lr * t.min_lr_ratio)
    w, decay = t.warmup_steps, steps - t.warmup_steps

    def schedule(count):
        n = jnp.asarray(count, jnp.float64)
        # optax.cosine_decay_schedule: alpha = min_lr_ratio, exponent 1
        done = jnp.minimum(jnp.maximum(n - w, 0.0), decay) / decay
        cosine = t.lr * ((1 - t.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * done))
                         + t.min_lr_ratio)
        return jnp.where(n < w, t.lr * n / max(w, 1), cosine)

    return schedule


def _decays(path, _) -> bool:
    """Weight decay applies to matrices (kernels, embedding tables), not to
    norm scales or biases, whatever their rank (a q bias is [N, H])."""
    return _names(path)[-1] in ("kernel", "embedding")


def _names(path) -> list:
    return [k.key for k in path if hasattr(k, "key")]


def is_bias(path, _=None) -> bool:
    """Whether a parameter is a MoE layer's loss-free balance bias
    (`jaxtp.model.moe.MoE.router_bias`), which no gradient trains."""
    return "router_bias" in _names(path)


def without_bias(grads):
    """`grads` with the biases' (their layers' expert counts, `routing.counted`)
    zero: what the gradient norm and its clipping read."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_bias(path) else g, grads)


def loss_free_bias(counts):
    """The auxiliary-loss-free balance's update of a layer's bias, per unit
    `rate` (DeepSeek-V3, arXiv 2412.19437 Sec. 2.1.2): up where its expert's
    load is below the layer's mean, down where above, from that step's counts
    [..., E] (the bias's "gradient", summed over microbatches and ranks);
    then re-centred to zero mean per layer as torchtitan does (its PR 1506),
    which moves no choice (a layer's every score shifts alike, and so every
    group's sum)."""
    u = jnp.sign(counts.mean(-1, keepdims=True) - counts)
    return u - u.mean(-1, keepdims=True)


def make_optimizer(t: TrainConfig, dtype=np.float32,
                   bias_rate: float = 0.0) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with the schedule above (in `dtype`);
    where `bias_rate`, each MoE bias moved by `bias_rate * loss_free_bias`
    instead (AdamW's state keeps its slot, so the state's layout is AdamW's).
    Clipping is in the step."""
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decays, params)
    adamw = optax.adamw(lr_schedule(t, dtype), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                        mask=decay_mask)
    if not bias_rate:
        return adamw

    def update(grads, state, params=None):
        updates, state = adamw.update(grads, state, params)
        return jax.tree_util.tree_map_with_path(
            lambda path, u, g: (bias_rate * loss_free_bias(g)).astype(u.dtype)
            if is_bias(path) else u, updates, grads), state

    return optax.GradientTransformation(adamw.init, update)


def clip_by_global_norm(grads, max_norm: float, specs, biased: bool = False):
    """(clipped grads, pre-clip global norm), as optax.clip_by_global_norm;
    `biased`: the norm of the gradients `without_bias` (a bias's counts only
    scaled, which moves no sign).

    Done here rather than in the optax chain so that one norm both clips and is
    logged (a second norm would be a second reduction over tp).
    """
    norm = global_norm(without_bias(grads) if biased else grads, specs)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm
