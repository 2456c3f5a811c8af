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
from jax.ad_checkpoint import checkpoint_name

from .. import parallel
from ..config import ModelConfig
from ..parallel import Layout
from .layers import param

NEG = jnp.finfo(jnp.float32).min


def loss_chunks(loss_chunk: int, rows: int, T: int) -> tuple[int, int]:
    """(chunks n, positions per chunk c) of the chunked loss: `loss_chunk`
    tokens of `rows` rows (a dp rank's batch) as whole positions; (1, T) off."""
    c = max(1, loss_chunk // max(1, rows)) if loss_chunk else T
    return (1, T) if c >= T else (-(-T // c), c)


class VocabEmbed(nnx.Module):
    """Token table [V_pad, D] split over tp on V: lookup, LM head, cross-entropy."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        self.embedding = param(rngs, nnx.initializers.normal(cfg.init_std),
                               (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"),
                               cfg.param_dtype, layout)
        self.vocab_size, self.loss_chunk = cfg.vocab_size, cfg.loss_chunk
        self.dtype, self.layout = cfg.dtype, layout

    def __call__(self, ids_BT):
        """int ids [B, T] -> embeddings [B, T, D], replicated over tp (under
        sequence parallelism split along T: a reduce-scatter, not an all-reduce)."""
        with jax.named_scope("embed"):
            return parallel.embed(self, ids_BT)

    def rows(self, ids_BT, local):
        """This rank's part of the token rows (a partial sum over the vocab shards)."""
        return local.vocab_rows(self.embedding[...], ids_BT, self.dtype)

    def token_losses(self, x_BTD, targets_BT):
        """fp32 cross-entropy [B, T] of next-token targets, from vocab-sharded logits."""
        with jax.named_scope("cross_entropy"):
            return parallel.vocab_losses(self, x_BTD, targets_BT)

    def losses(self, x_BTD, targets_BT, local):
        """Cross-entropy per token over chunks of positions, each recomputed in the
        backward pass: one chunk's [B, c, V/tp] logits live at a time, not [B, T, V/tp].

        A chunk holds `loss_chunk` tokens per dp rank as whole positions of
        every row (`loss_chunks`); T is padded to a multiple of c and the
        padded losses dropped. The three reductions run per chunk; the
        recomputation keeps their results ("ce_stats"), so it adds no
        collective.
        """
        B, T, D = x_BTD.shape
        n, c = loss_chunks(self.loss_chunk, local.batch_per_dp_rank(B), T)
        chunk_fn = lambda x, t: self._chunk_losses(x, t, local)
        if n == 1:
            return chunk_fn(x_BTD, targets_BT)
        x_nBcD = jnp.pad(x_BTD, ((0, 0), (0, n * c - T), (0, 0))).reshape(
            B, n, c, D).transpose(1, 0, 2, 3)
        t_nBc = jnp.pad(targets_BT, ((0, 0), (0, n * c - T))).reshape(B, n, c).transpose(1, 0, 2)
        chunk = jax.checkpoint(chunk_fn,
                               policy=jax.checkpoint_policies.save_only_these_names("ce_stats"))
        losses_nBc = jax.lax.map(lambda xt: chunk(*xt), (x_nBcD, t_nBc))
        return losses_nBc.transpose(1, 0, 2).reshape(B, n * c)[:, :T]

    def _chunk_losses(self, x_BTD, targets_BT, local):
        """Cross-entropy per token from this rank's vocab slice; `local`
        completes each of the three statistics over tp (the max, the sum of
        exponentials and the target's logit), so no rank holds all logits."""
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(self.dtype),
                                self.embedding[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        logits_BTV = local.constrain(logits_BTV, "batch", "seq", "vocab")
        ids_V = local.vocab_start(logits_BTV.shape[-1]) + jnp.arange(logits_BTV.shape[-1])
        logits_BTV = jnp.where(ids_V < self.vocab_size, logits_BTV, NEG)
        # named, so a recomputed chunk (`losses`) reuses the reduced values
        # instead of reducing again
        stat = lambda v: checkpoint_name(v, "ce_stats")
        max_BT = stat(local.vocab_max(jax.lax.stop_gradient(logits_BTV.max(-1))))
        sumexp_BT = stat(local.vocab_sum(jnp.exp(logits_BTV - max_BT[..., None]).sum(-1)))
        target_BT = stat(local.vocab_sum(
            jnp.where(ids_V == targets_BT[..., None], logits_BTV, 0).sum(-1)))
        return jnp.log(sumexp_BT) + max_BT - target_BT

    def logits(self, x_BTD):
        """Full fp32 logits [B, T, vocab_size] (unpadded), for inference."""
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(jnp.float32),
                                self.embedding[...].astype(jnp.float32))
        return logits_BTV[..., : self.vocab_size]
