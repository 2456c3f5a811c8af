"""Tensor-parallel generation: a KV cache split over tp, one prefill, one
jitted decode step per token, sampling over the vocab shards.

- The cache: per layer k and v of [B, S, Kc, H], S = longest prompt +
  max_new_tokens (at most model.seq_len), preallocated; Kc = K split over tp
  like the kv weights, or when K < tp, tp copies split over tp: each rank
  keeps only the kv head its query heads use. Bytes per device:
  2 * L * B * S * max(K, tp)/tp * H * bytes (`cache_bytes_per_device`).
- Prompts of different lengths are left-aligned (right-padded): row b's
  prompt fills slots [0, len_b) and its generated tokens the slots after it,
  so slot s always holds position s. Prefill runs the padded prompts through
  the configured attention kernel (causal: no real token sees a pad) and
  writes their k, v; each decode step writes one token per row at its own
  position and attends over the slots up to it, so the pads a prompt left
  are overwritten before any query can see them.
- The next token comes from `VocabEmbed.next_token`: an arg-max (greedy) or
  Gumbel-max over the vocab shards, so no device holds the [B, V] logits and
  tp changes no token.
- A mixture of experts generates at ep 1 (every expert whole on each rank,
  tp inside each) and dropless: every token goes to all of its top-k
  experts, whatever `model.capacity_factor` it trained at. A capacity
  queue per sequence (`jaxtp.model.moe.capacity`) takes every token's
  first choice before any second choice, so whether a token keeps an
  expert depends on the tokens after it: no causal cache can reproduce it,
  and a padded prompt's pads would compete for the slots. Dropless, a
  decode step's group of one token (C = 1) and a prompt's prefill route
  each token as the training forward does at capacity factor 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..config import Config
from ..model.moe import MoE
from ..parallel import Layout, cache_spec, keep_axes, named
from ..parallel.distributed import global_batch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1: off)")


def cache_heads(layout: Layout, m) -> int:
    """Kc: the kv heads a cache holds over all tp ranks: K, or when K < tp one
    per rank (the kv head its query heads use)."""
    return m.kv_heads if layout.kv_sharded else layout.tp


def cache_bytes_per_device(cfg: Config, batch: int, length: int) -> int:
    """2 * L * B * S * (Kc / tp) * H * bytes: k and v of every layer."""
    m, layout = cfg.model, Layout.of(cfg)
    per_rank = cache_heads(layout, m) // layout.tp
    return 2 * m.n_layers * batch * length * per_rank * m.head_dim * \
        jnp.dtype(m.dtype).itemsize


def _dropless(model):
    """`model` (or a copy sharing its arrays) whose MoE layers keep every
    token's top-k experts: capacity factor 0 (see the module docstring)."""
    if not model.cfg.n_experts or not model.cfg.capacity_factor:
        return model
    copy = nnx.merge(*nnx.split(model))
    copy.set_attributes(MoE, factor=0.0)
    return copy


class Generator:
    """Generates from a model (`jaxtp.model.Transformer`) placed on `mesh`."""

    def __init__(self, model, mesh, sampling: Sampling = Sampling()):
        self.cfg = model.cfg
        self.layout: Layout = model.layout
        if self.layout.sp:
            raise ValueError("generation runs without sequence parallelism (one token "
                             "per step cannot be split over tp): build the model with sp off")
        if self.layout.ep > 1:
            raise ValueError(f"generation runs at ep 1, not ep={self.layout.ep} (each rank "
                             "holds every expert, tp inside each): build the model at ep 1, "
                             "the checkpoint reshards (jaxtp.generate.load does)")
        self.mesh, self.sampling = mesh, sampling
        self.graphdef, self.params = nnx.split(_dropless(model))
        self.cfg = dataclasses.replace(self.cfg, capacity_factor=0.0)
        # closures over this generator's graphdef, not jitted bound methods:
        # JAX keys its trace cache on the function, and a later generator's
        # method could be served an earlier one's trace
        graphdef, s = self.graphdef, sampling

        def next_token(model, x_BD, key):
            return model.head.next_token(x_BD, key, temperature=s.temperature, top_k=s.top_k,
                                         top_p=s.top_p)

        def prefill(params, tokens_BP, lens_B, k, v, key):
            model = nnx.merge(graphdef, params)
            pos_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
            x_BPD, k, v = model.extend(tokens_BP, pos_BP, k, v, prefill=True)
            last_BD = jnp.take_along_axis(x_BPD, (lens_B - 1)[:, None, None], 1)[:, 0]
            return next_token(model, last_BD, key), k, v

        def decode(params, tok_B, pos_B, k, v, key):
            model = nnx.merge(graphdef, params)
            x_B1D, k, v = model.extend(tok_B[:, None], pos_B[:, None], k, v, prefill=False)
            return next_token(model, x_B1D[:, 0], key), k, v

        # the token comes back replicated: every process of a multi-process
        # run reads the whole batch's tokens (B values)
        cache = NamedSharding(mesh, P(None, *keep_axes(cache_spec(), mesh.axis_names)))
        outs = (NamedSharding(mesh, P()), cache, cache)
        self._prefill = jax.jit(prefill, out_shardings=outs)
        self._decode = jax.jit(decode, out_shardings=outs, donate_argnums=(3, 4))  # in place
        self._zeros = {}

    def empty_cache(self, batch: int, length: int):
        m = self.cfg
        shape = (m.n_layers, batch, length, cache_heads(self.layout, m), m.head_dim)
        if shape not in self._zeros:  # compiled once per shape
            sharding = NamedSharding(self.mesh, P(None, *cache_spec()))
            self._zeros[shape] = jax.jit(lambda: jnp.zeros(shape, m.dtype),
                                         out_shardings=sharding)
        return self._zeros[shape](), self._zeros[shape]()

    def stream(self, prompts: list[list[int]], max_new_tokens: int, seed: int = 0,
               eos: Iterable[int] = ()) -> Iterator[np.ndarray]:
        """Yield the next token of every row [B] per step, max_new_tokens times
        (or until every row has produced one of the `eos` ids). Past model.seq_len the
        context slides: the last seq_len/2 tokens of each row are prefilled
        again (positions from 0, as nanoGPT crops to its block) and decoding
        goes on, one prefill per seq_len/2 tokens."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lens = np.array([len(p) for p in prompts], np.int32)
        top = max(max(p) for p in prompts)
        if top >= self.cfg.vocab_size or min(min(p) for p in prompts) < 0:
            raise ValueError(f"a prompt holds token id {top}, outside the model's vocabulary "
                             f"(model.vocab_size={self.cfg.vocab_size}): another tokenizer?")
        if lens.max() > self.cfg.seq_len:
            raise ValueError(f"a prompt of {lens.max()} tokens is longer than model.seq_len="
                             f"{self.cfg.seq_len}, the longest sequence the model was built for")
        length = min(int(lens.max()) + max_new_tokens, self.cfg.seq_len)  # the cache's slots
        history = [list(p) for p in prompts]
        key = jax.random.PRNGKey(seed)  # step n samples with fold_in(key, n)
        with jax.set_mesh(self.mesh):
            k, v = self.empty_cache(len(prompts), length)
            tok, k, v = self._prefill_rows(history, k, v, jax.random.fold_in(key, 0))
            pos, done = lens, np.zeros(len(prompts), bool)
            for step in range(1, max_new_tokens + 1):
                host = np.asarray(tok)
                yield host
                done |= np.isin(host, list(eos)) if eos else False
                if step == max_new_tokens or done.all():
                    return
                for row, t in zip(history, host):
                    row.append(int(t))
                step_key = jax.random.fold_in(key, step)
                if pos.max() >= length:  # no slot left: slide the context
                    window = [row[-(length // 2 or 1):] for row in history]
                    tok, k, v = self._prefill_rows(window, k, v, step_key)
                    pos = np.array([len(w) for w in window], np.int32)
                else:
                    tok, k, v = self._decode(self.params, tok, self._put(pos), k, v, step_key)
                    # a new array: on CPU device_put may share the host buffer with
                    # the step still queued, so it must not be changed in place
                    pos = pos + 1

    def _put(self, a: np.ndarray):
        """A host array [B, ...] the same in every process, split over dp."""
        return global_batch(a, self.mesh, named(self.mesh, "batch", *[None] * (a.ndim - 1)))

    def _prefill_rows(self, rows: list[list[int]], k, v, key):
        """Prefill right-padded rows from position 0: (next token, k, v)."""
        lens = np.array([len(r) for r in rows], np.int32)
        tokens = np.zeros((len(rows), int(lens.max())), np.int32)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
        return self._prefill(self.params, self._put(tokens), self._put(lens), k, v, key)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int = 0,
                 eos: int | Iterable[int] = (),
                 on_token: Callable | None = None) -> list[list[int]]:
        """The generated tokens of every row (up to and including an `eos` id)."""
        eos = {eos} if isinstance(eos, int) else set(eos)
        out = [[] for _ in prompts]
        for toks in self.stream(prompts, max_new_tokens, seed, eos):
            for b, t in enumerate(toks):
                if not (out[b] and out[b][-1] in eos):
                    out[b].append(int(t))
            if on_token is not None:
                on_token(toks)
        return out


__all__ = ["Generator", "Sampling", "cache_bytes_per_device", "cache_heads"]
