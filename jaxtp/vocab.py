"""Vocab-parallel embedding, LM head and cross-entropy (Megatron-LM's
VocabParallelEmbedding and vocab_parallel_cross_entropy, Shoeybi et al. 2019,
Sec. 3).

The table [V, D] is split over tp along the (padded) vocabulary; rank r holds
rows [r V/tp, (r+1) V/tp).

- Lookup: each rank looks up the ids in its slice and zeros the others; the
  sum over tp (one forward all-reduce of b*s*h) completes every row. Rows no
  id hits receive exactly zero gradient.
- LM head: logits = x E^T is column-parallel over V (no forward collective;
  the backward all-reduces dX, Megatron's f).
- Cross-entropy on vocab-sharded logits: the max, the sum of exponentials
  and the target's logit are each reduced over tp (three all-reduces of b*s
  fp32 values), so no rank ever holds the full [b, s, V] logits.

Padded entries (ids >= vocab_size) get logit -inf: no probability, no loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .layers import _param
from .manual import SEQ_SPLIT, f, f_sp, g, g_sp, gather_seq, run_sharded, tp_rank
from .sharding import constrain, residual_axes

NEG = jnp.finfo(jnp.float32).min


class VocabEmbed(nnx.Module):
    """Token table [V_pad, D] split over tp on V: lookup, LM head, cross-entropy."""

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", sp: bool = False,
                 rngs: nnx.Rngs):
        self.embedding = _param(rngs, nnx.initializers.normal(cfg.init_std),
                                (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"),
                                cfg.param_dtype)
        self.vocab_size = cfg.vocab_size
        self.dtype = cfg.dtype
        self.impl, self.sp = impl, sp

    def _rows(self) -> int:
        return self.embedding[...].shape[0]  # V/tp inside shard_map, V_pad outside

    def _lookup(self, ids_BT, start):
        local_BT = ids_BT - start
        hit_BT = (local_BT >= 0) & (local_BT < self._rows())
        x_BTD = jnp.take(self.embedding[...], jnp.where(hit_BT, local_BT, 0), axis=0)
        return jnp.where(hit_BT[..., None], x_BTD, 0).astype(self.dtype)

    def __call__(self, ids_BT):
        """int ids [B, T] -> embeddings [B, T, D], replicated over tp (under
        sequence parallelism split along T: a reduce-scatter, not an all-reduce)."""
        with jax.named_scope("embed"):
            if self.impl == "shard_map":
                reduce, out = (g_sp, SEQ_SPLIT) if self.sp else (g, P())
                return run_sharded(
                    self, lambda m, ids: reduce(m._lookup(ids, tp_rank() * m._rows())),
                    ids_BT, out_specs=out)
            return constrain(self._lookup(ids_BT, 0), *residual_axes(self.sp))

    def _token_losses(self, x_BTD, targets_BT, start, reduce_max, reduce_sum):
        """Cross-entropy per token from this rank's vocab slice; `reduce_*`
        complete each of the three statistics over tp (identity under GSPMD,
        where the arrays are global)."""
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(self.dtype),
                                self.embedding[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        logits_BTV = constrain(logits_BTV, "batch", "seq", "vocab")
        ids_V = start + jnp.arange(logits_BTV.shape[-1])
        logits_BTV = jnp.where(ids_V < self.vocab_size, logits_BTV, NEG)
        max_BT = reduce_max(jax.lax.stop_gradient(logits_BTV.max(-1)))
        sumexp_BT = reduce_sum(jnp.exp(logits_BTV - max_BT[..., None]).sum(-1))
        target_BT = reduce_sum(jnp.where(ids_V == targets_BT[..., None], logits_BTV, 0).sum(-1))
        return jnp.log(sumexp_BT) + max_BT - target_BT

    def token_losses(self, x_BTD, targets_BT):
        """fp32 cross-entropy [B, T] of next-token targets, from vocab-sharded logits."""
        with jax.named_scope("cross_entropy"):
            if self.impl == "shard_map":
                enter = f_sp if self.sp else f

                def fn(m, x_BTD, targets_BT):
                    pmax = lambda v: jax.lax.pmax(v, "tp")
                    return m._token_losses(enter(x_BTD), targets_BT, tp_rank() * m._rows(),
                                           pmax, g)
                specs = (SEQ_SPLIT if self.sp else P(), P())
                return run_sharded(self, fn, x_BTD, targets_BT, arg_specs=specs)
            same = lambda v: v
            if self.sp:  # the final norm stays on its shard (see manual.tp_region)
                x_BTD = gather_seq(constrain(x_BTD, *residual_axes(True)))
            return self._token_losses(x_BTD, targets_BT, 0, same, same)

    def logits(self, x_BTD):
        """Full fp32 logits [B, T, vocab_size] (unpadded), for inference."""
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(jnp.float32),
                                self.embedding[...].astype(jnp.float32))
        return logits_BTV[..., : self.vocab_size]
