"""Tensor-parallel building blocks (Flax NNX).

Every weight is created with its PartitionSpec in the metadata
(`out_sharding=layout.param_spec(...)`), so the parameters themselves carry
their split over the mesh. A layer's math is plain local math written as an
einsum over shape letters: correct on global arrays (the SPMD partitioner splits it)
and on per-shard arrays inside a manual region (`jaxtp.parallel.locals`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..parallel import Layout, first_row, wide
from ..parallel.collectives import gathered


def param(rngs: nnx.Rngs | None, init, shape, axes, dtype, layout: Layout) -> nnx.Param:
    """A parameter of `shape` laid out by `layout` (its dims named by `axes`)."""
    value = init(rngs.params(), shape, dtype) if rngs is not None else init(shape, dtype)
    return nnx.Param(value, out_sharding=layout.param_spec(*axes))


def weight(v: nnx.Variable, dtype=None) -> jax.Array:
    """A parameter's value where a module uses it, in `dtype` (default: its
    own), gathered over dp under FSDP after the cast (`gathered`: a bf16 copy
    travels, half the bytes of an fp32 master weight, as PyTorch FSDP's mixed
    precision gathers its param_dtype). The vocab tables are gathered in
    their own dtype (`jaxtp.model.vocab`)."""
    x = v[...] if dtype is None else v[...].astype(dtype)
    return gathered(x, v.get_metadata().get("out_sharding"))


class ColumnParallelLinear(nnx.Module):
    """Y = X W + b with W: [D, *out] split over tp on its output dim.

    Replicated in, sharded out: no forward collective. Backward, each rank's dX
    is a partial sum over its output slice, so dX is all-reduced (Megatron f).
    `letters` name the output dims ("F", "NH", "CKH"): the einsum is
    "...D,D<letters>->...<letters>".
    """

    def __init__(self, d_in: int, out_shape: tuple[int, ...], out_axes: tuple, letters: str,
                 layout: Layout, *, use_bias: bool, std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.kernel = param(rngs, init, (d_in, *out_shape), ("embed", *out_axes),
                            param_dtype, layout)
        self.bias = (param(rngs, nnx.initializers.zeros, out_shape, out_axes, param_dtype,
                           layout) if use_bias else None)
        self.dtype, self.letters = dtype, letters
        self.out_axes = tuple(out_axes)  # the logical axes of the output's dims after "...D"

    def weights(self):
        """(kernel, bias or None) in the compute dtype."""
        b = None if self.bias is None else weight(self.bias, self.dtype)
        return weight(self.kernel, self.dtype), b

    def __call__(self, x, out_sharding=None):
        return self.matmul()(x, out_sharding)

    def matmul(self):
        """x -> X W + b with the weights fetched now (under FSDP gathered
        here, not again in a rematerialised matmul's backward pass).
        `out_sharding` (typed shardings, x split along T) names the output's
        sharding, which the types cannot tell when both operands are split
        over tp (`jaxtp.parallel.Explicit.project`)."""
        w, b = self.weights()

        def mm(x, out_sharding=None):
            y = jnp.einsum(f"...D,D{self.letters}->...{self.letters}", x.astype(self.dtype), w,
                           out_sharding=out_sharding)
            return y if b is None else y + b

        return mm


class RowParallelLinear(nnx.Module):
    """Y = g(X W) + b with W: [*in, D] split over tp on its input dim.

    Sharded in, partial out: `partial` is each rank's X_i W_i; the sum over tp
    (Megatron g, an all-reduce forward) happens between `partial` and
    `add_bias`, so the replicated bias is added once, not tp times. `letters`
    name the input dims: "...<letters>,<letters>D->...D".
    """

    def __init__(self, in_shape: tuple[int, ...], in_axes: tuple, letters: str, d_out: int,
                 layout: Layout, *, use_bias: bool, std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.kernel = param(rngs, init, (*in_shape, d_out), (*in_axes, "embed"), param_dtype,
                            layout)
        self.bias = (param(rngs, nnx.initializers.zeros, (d_out,), ("embed",), param_dtype,
                           layout) if use_bias else None)
        self.dtype, self.letters = dtype, letters

    def partial(self, x, out_sharding=None):
        """X W; `out_sharding` (typed shardings) names the summed output's
        sharding, which makes the contraction over tp a reduction."""
        return jnp.einsum(f"...{self.letters},{self.letters}D->...D", x.astype(self.dtype),
                          weight(self.kernel, self.dtype), out_sharding=out_sharding)

    def add_bias(self, y):
        return y if self.bias is None else y + weight(self.bias, self.dtype)


class Embed(nnx.Module):
    """Lookup table [n, D], replicated over tp (learned positions)."""

    def __init__(self, n: int, d: int, layout: Layout, *, std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.embedding = param(rngs, nnx.initializers.normal(std), (n, d), (None, "embed"),
                               param_dtype, layout)
        self.dtype = dtype

    def __call__(self, ids):
        return jnp.take(weight(self.embedding, self.dtype), ids, axis=0)


class LayerNorm(nnx.Module):
    """LayerNorm over the model dim, computed in fp32; scale and bias replicated."""

    def __init__(self, d: int, layout: Layout, *, eps: float, dtype, param_dtype,
                 autodiff: bool = False):
        self.scale = param(None, jnp.ones, (d,), ("embed",), param_dtype, layout)
        self.bias = param(None, jnp.zeros, (d,), ("embed",), param_dtype, layout)
        self.eps = eps
        self.dtype = dtype
        self.autodiff = autodiff  # the backward left to autodiff (`normalised`)

    def __call__(self, x):
        y = normalised(x.astype(wide(x)), self.eps, True, self.autodiff)
        return (y * weight(self.scale) + weight(self.bias)).astype(self.dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last dim, in fp32 (Zhang & Sennrich 2019);
    replicated. `axis`: the scale's logical axis ("embed", the model dim;
    "head_dim" for a per-head norm, which no rule splits)."""

    def __init__(self, d: int, layout: Layout, *, eps: float, dtype, param_dtype,
                 axis: str = "embed", autodiff: bool = False):
        self.scale = param(None, jnp.ones, (d,), (axis,), param_dtype, layout)
        self.eps = eps
        self.dtype = dtype
        self.autodiff = autodiff  # the backward left to autodiff (`normalised`)

    def __call__(self, x):
        y = normalised(x.astype(wide(x)), self.eps, False, self.autodiff)
        return (y * weight(self.scale)).astype(self.dtype)


def normalised(x, eps: float, centre: bool, autodiff: bool = False):
    """(x - mean) / sigma over the last dim (`centre`: LayerNorm), else x / rms.

    Its backward pass is written out (the standard formula: Ba et al. 2016;
    Zhang & Sennrich 2019) from the normalised input and 1/sigma the forward
    keeps; scale and bias stay with autodiff (inside a manual region their
    cotangents' psums are autodiff's). Left to autodiff, XLA:CPU fused each
    residual-stream gradient with the sums of every later layer's norm terms
    and recomputed those sums per layer, transposed for the weight gradients'
    dots: the tiny step at tp=1 took 1.16x the time (171 against 147 ms on
    one device, alternated with PyTorch's; jaxlib 0.10.2). `autodiff` (`autodiff_norms`: under
    a remat policy or SP) leaves the backward to autodiff."""
    return _normalise(x, eps, centre)[0] if autodiff else _normalised(x, eps, centre)


def autodiff_norms(cfg, layout: Layout) -> bool:
    """Whether the norms leave their backward to autodiff: under a remat policy
    (jax.checkpoint keeps a custom VJP's residuals whatever the policy:
    measured, minimal remat under SP then kept the norms' outputs and dropped
    the re-gathered region inputs; what the policy recomputes is the point
    there) and under SP (the step held 1.4 MB more temporaries, tiny at tp=8:
    22.7 against 21.3 MB)."""
    return cfg.remat != "none" or layout.sp


def _normalise(x, eps, centre):
    """(x-hat, 1/sigma)."""
    xc = x - x.mean(-1, keepdims=True) if centre else x
    r = jax.lax.rsqrt(jnp.square(xc).mean(-1, keepdims=True) + eps)
    return xc * r, r


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _normalised(x, eps, centre):
    return _normalise(x, eps, centre)[0]


def _normalised_fwd(x, eps, centre):
    xh, r = _normalise(x, eps, centre)
    return xh, (xh, r)


def _normalised_bwd(eps, centre, res, g):
    xh, r = res
    dx = g - xh * (g * xh).mean(-1, keepdims=True)
    return (r * (dx - g.mean(-1, keepdims=True) if centre else dx),)


_normalised.defvjp(_normalised_fwd, _normalised_bwd)


def make_norm(cfg, layout: Layout):
    cls = RMSNorm if cfg.style == "llama" else LayerNorm
    return cls(cfg.d_model, layout, eps=cfg.ln_eps, dtype=cfg.dtype,
               param_dtype=cfg.param_dtype, autodiff=autodiff_norms(cfg, layout))


def rope_inv_freq(H: int, cfg) -> jax.Array:
    """theta^(-2i/H), i < H/2, with Llama 3.1's frequency scaling when
    cfg.rope_scaling_factor > 0 (Meta's reference code / HF
    `_compute_llama3_parameters`)."""
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=wide(cfg.dtype)) / H)
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


def rope(x_BTNH, positions, theta: float, inv_freq_F=None):
    """Rotary position embedding (Su et al. 2021) in the "rotate half" layout of
    Hugging Face's Llama: dim i is paired with dim i + H/2, frequency
    theta^(-2i/H) (or `inv_freq_F`). Applied per head, so any subset of heads
    (a tp rank's) works. `positions`: [T], or [B, T] (each row its own, as in
    decoding a batch of prompts).
    """
    H = x_BTNH.shape[-1]
    if inv_freq_F is None:
        inv_freq_F = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=wide(x_BTNH)) / H)
    angle = positions.astype(wide(x_BTNH))[..., None] * inv_freq_F
    shape = positions.shape + (1,) * (x_BTNH.ndim - 3) + (H // 2,)  # any head dims
    cos, sin = jnp.cos(angle).reshape(shape), jnp.sin(angle).reshape(shape)
    x = x_BTNH.astype(wide(x_BTNH))
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def dropout(x, rate: float, key):
    """Inverted dropout; identity when `key` is None (evaluation) or rate == 0.

    Each row (batch index b) draws its mask from `fold_in(key, b)`, b global
    (`first_row`): the mask of a row is the same however the batch is split,
    on global arrays and on a dp rank's rows inside `jaxtp.train.step`'s
    slices over dp."""
    if key is None or rate == 0.0:
        return x
    B = x.shape[0]
    rows = jnp.arange(B) + first_row(B)
    keep = jax.vmap(lambda r: jax.random.bernoulli(jax.random.fold_in(key, r), 1.0 - rate,
                                                   x.shape[1:]))(rows)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def gelu(x):
    # GPT-2's tanh approximation (Hendrycks & Gimpel 2016).
    return jax.nn.gelu(x, approximate=True)


def init_std_out(std: float, n_layers: int) -> float:
    """GPT-2 scales residual-output projections by 1/sqrt(2 L) (Radford et al. 2019)."""
    return std / math.sqrt(2 * n_layers)
