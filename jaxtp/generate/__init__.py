"""Generation: a KV cache split over tp by kv heads, prefill and decode steps,
sampling over the vocab shards (tp changes no token)."""

from .engine import Generator, Sampling, cache_bytes_per_device, cache_heads

__all__ = ["Generator", "Sampling", "cache_bytes_per_device", "cache_heads"]
