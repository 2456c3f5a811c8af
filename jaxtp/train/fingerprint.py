"""Exact array fingerprints for checkpoints: two 32-bit sums of a hash of
each element's bit pattern and linear position, bit-identical for any layout
(integer addition is associative). Computed on the devices, sharded; an
array of at most `HOST_BYTES` that this process holds whole is fetched and
hashed by numpy instead, by the same formula (no program to compile: the
device path compiles about 20 small programs in each process's first save,
0.5 s of a small run's 4)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

HOST_BYTES = 16 * 2**20
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _mix(h, u32=jnp.uint32):
    """murmur3's 32-bit finalizer: every input bit flips about half the output
    bits (`u32`: np.uint32 for host arrays)."""
    h = (h ^ (h >> 16)) * u32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * u32(0xC2B2AE35)
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
                      for seed in _SEEDS])


def _fingerprint_host(x: np.ndarray) -> tuple[int, int]:
    """`_fingerprint_one` in numpy (uint32 arithmetic wraps mod 2**32 as XLA's)."""
    x = x.astype(np.uint8) if x.dtype == np.bool_ else x
    size = x.dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise ValueError(f"cannot fingerprint arrays of dtype {x.dtype}")
    flat = np.ascontiguousarray(x).reshape(-1)
    if size == 8:  # XLA's bitcast to u32[..., 2]: the low word first (little-endian)
        words = flat.view(np.uint32).reshape(-1, 2)
        bits = words[:, 0] ^ _mix(words[:, 1], np.uint32)
    else:
        bits = flat.view(np.dtype(f"uint{8 * size}")).astype(np.uint32)
    idx = (np.arange(flat.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    with np.errstate(over="ignore"):
        return tuple(int(np.sum(_mix(bits ^ _mix(idx + np.uint32(seed), np.uint32), np.uint32),
                                dtype=np.uint32)) for seed in _SEEDS)


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


def fingerprints(arrays: list[jax.Array], host_bytes: int = HOST_BYTES) -> list[int]:
    """A 64-bit fingerprint of each array's exact bits (any layout gives the
    same); arrays of at most `host_bytes` held whole here hashed on the host."""
    s = arrays[0].sharding if arrays else None
    rep = NamedSharding(s.mesh, P()) if isinstance(s, NamedSharding) else None
    fn = _fingerprint_fn(rep)
    host = lambda x: x.is_fully_addressable and x.size * x.dtype.itemsize <= host_bytes
    # one program at a time: many small programs with collectives in flight at
    # once can starve XLA's CPU rendezvous of threads (seen at tp=8: a hang)
    out = [_fingerprint_host(np.asarray(jax.device_get(x))) if host(x) else
           jax.device_get(fn(x)) for x in arrays]
    return [int(h[0]) << 32 | int(h[1]) for h in out]
