"""Tensor-parallel building blocks (Flax NNX).

Every weight is created with `nnx.with_partitioning`-style metadata
(`out_sharding=param_spec(...)`), so the parameters themselves carry PartitionSpecs
on the "tp" mesh axis. The `__call__` of each layer is plain local math: it is
correct on global arrays (GSPMD partitions it) and on per-shard arrays inside
`jax.shard_map` (see `jaxtp.manual`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .sharding import param_spec


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=param_spec(*axes))


class ColumnParallelLinear(nnx.Module):
    """Y = X W + b with W: [D, *out] split over tp on its output dim.

    Replicated in, sharded out: no forward collective. Backward, each rank's dX
    is a partial sum over its output slice, so dX is all-reduced (Megatron f).
    """

    def __init__(self, d_in: int, out_shape: tuple[int, ...], out_axes: tuple,
                 *, use_bias: bool, std: float, dtype, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.kernel = _param(rngs, init, (d_in, *out_shape), ("embed", *out_axes),
                             param_dtype)
        self.bias = (_param(rngs, nnx.initializers.zeros, out_shape, out_axes, param_dtype)
                     if use_bias else None)
        self.dtype = dtype

    def __call__(self, x):
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), 1)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class RowParallelLinear(nnx.Module):
    """Y = g(X W) + b with W: [*in, D] split over tp on its input dim.

    Sharded in, partial out: `partial` is each rank's X_i W_i; the sum over tp
    (Megatron g, an all-reduce forward) happens between `partial` and
    `add_bias`, so the replicated bias is added once, not tp times.
    """

    def __init__(self, in_shape: tuple[int, ...], in_axes: tuple, d_out: int,
                 *, use_bias: bool, std: float, dtype, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.kernel = _param(rngs, init, (*in_shape, d_out), (*in_axes, "embed"),
                             param_dtype)
        self.bias = (_param(rngs, nnx.initializers.zeros, (d_out,), ("embed",), param_dtype)
                     if use_bias else None)
        self.n_in = len(in_shape)
        self.dtype = dtype

    def partial(self, x):
        return jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                             self.n_in)

    def add_bias(self, y):
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)

    def __call__(self, x):
        return self.add_bias(self.partial(x))


class Embed(nnx.Module):
    """Lookup table [n, D], laid out by `axes` (positions: replicated)."""

    def __init__(self, n: int, d: int, axes: tuple, *, std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.embedding = _param(rngs, nnx.initializers.normal(std), (n, d), axes,
                                param_dtype)
        self.dtype = dtype

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)



class LayerNorm(nnx.Module):
    """LayerNorm over the model dim, computed in fp32; scale and bias replicated."""

    def __init__(self, d: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((d,), param_dtype), out_sharding=param_spec("embed"))
        self.bias = nnx.Param(jnp.zeros((d,), param_dtype), out_sharding=param_spec("embed"))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(self.dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the model dim, in fp32 (Zhang & Sennrich 2019); replicated."""

    def __init__(self, d: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((d,), param_dtype), out_sharding=param_spec("embed"))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x = x.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(self.dtype)


def make_norm(cfg):
    cls = RMSNorm if cfg.style == "llama" else LayerNorm
    return cls(cfg.d_model, eps=cfg.ln_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)


def rope_inv_freq(H: int, cfg) -> jax.Array:
    """theta^(-2i/H), i < H/2, with Llama 3.1's frequency scaling when
    cfg.rope_scaling_factor > 0 (Meta's reference code / HF
    `_compute_llama3_parameters`)."""
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    if not cfg.rope_scaling_factor:
        return inv_freq
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    long_wave = cfg.rope_original_max_len / lo  # wavelengths above: divided by factor
    short_wave = cfg.rope_original_max_len / hi  # below: kept
    smooth = (cfg.rope_original_max_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelen > long_wave, inv_freq / factor,
                     jnp.where(wavelen < short_wave, inv_freq, blended))


def rope(x_BTNH, positions_T, theta: float, inv_freq_F=None):
    """Rotary position embedding (Su et al. 2021) in the "rotate half" layout of
    Hugging Face's Llama: dim i is paired with dim i + H/2, frequency
    theta^(-2i/H) (or `inv_freq_F`). Applied per head, so any subset of heads
    (a tp rank's) works.
    """
    H = x_BTNH.shape[-1]
    if inv_freq_F is None:
        inv_freq_F = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    angle_TF = positions_T.astype(jnp.float32)[:, None] * inv_freq_F[None]
    shape = (len(positions_T),) + (1,) * (x_BTNH.ndim - 3) + (H // 2,)  # any head dims
    cos, sin = jnp.cos(angle_TF).reshape(shape), jnp.sin(angle_TF).reshape(shape)
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def dropout(x, rate: float, key):
    """Inverted dropout; identity when `key` is None (evaluation) or rate == 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def gelu(x):
    # GPT-2's tanh approximation (Hendrycks & Gimpel 2016).
    return jax.nn.gelu(x, approximate=True)


def init_std_out(std: float, n_layers: int) -> float:
    """GPT-2 scales residual-output projections by 1/sqrt(2 L) (Radford et al. 2019)."""
    return std / math.sqrt(2 * n_layers)
