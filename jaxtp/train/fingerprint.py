"""Exact array fingerprints for checkpoints: two 32-bit sums of a hash of
each element's bit pattern and linear position, computed on device, sharded,
and bit-identical for any layout (integer addition is associative)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fingerprint_one(x: jax.Array) -> jax.Array:
    """Two 32-bit sums, mod 2**32, of a hash of (bit pattern, linear position) per element."""
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    size = jnp.dtype(x.dtype).itemsize
    if size not in (1, 2, 4, 8):
        raise ValueError(f"cannot fingerprint arrays of dtype {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * min(size, 4)}"))
    bits = bits[..., 0] ^ _mix(bits[..., 1]) if size == 8 else bits.astype(jnp.uint32)
    idx, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for d in reversed(range(x.ndim)):  # linear index, wrapping mod 2**32
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
        stride = (stride * x.shape[d]) % 2**32
    return jnp.stack([jnp.sum(_mix(bits ^ _mix(idx + jnp.uint32(seed))), dtype=jnp.uint32)
                      for seed in (0x9E3779B9, 0x7F4A7C15)])


@functools.cache
def _fingerprint_fn(out_sharding) -> Callable:
    # one small program per distinct (shape, dtype, sharding), which jit's
    # cache then reuses: the layers' parameters and Adam's two moments share
    # them (tiny at tp=2: 182 arrays, about 20 programs; one program over
    # every array compiled for 10 s, the first save of each process)
    return jax.jit(_fingerprint_one, out_shardings=out_sharding)


def nbytes(arrays) -> int:
    """The bytes of these (global) arrays: what a checkpoint of them stores."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in arrays)


def fingerprints(arrays: list[jax.Array]) -> list[int]:
    """A 64-bit fingerprint of each array's exact bits (any layout gives the same)."""
    s = arrays[0].sharding if arrays else None
    rep = NamedSharding(s.mesh, P()) if isinstance(s, NamedSharding) else None
    fn = _fingerprint_fn(rep)
    # one program at a time: many small programs with collectives in flight at
    # once can starve XLA's CPU rendezvous of threads (seen at tp=8: a hang)
    out = [jax.device_get(fn(x)) for x in arrays]
    return [int(h[0]) << 32 | int(h[1]) for h in out]
