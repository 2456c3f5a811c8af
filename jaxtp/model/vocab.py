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
from ..parallel import Layout, constrain, wide
from .layers import param, weight

NEG = jnp.finfo(jnp.float32).min


# top-k / top-p choose among each shard's best max(top_k, TOP_CANDIDATES) tokens
TOP_CANDIDATES = 256


def _gumbel(key, ids_BM, row0=0):
    """Gumbel(0, 1) noise per (row, token id), the same wherever the id lives;
    `row0`: the global index of the first row (a dp rank's offset)."""
    rows_BM = jnp.broadcast_to(row0 + jnp.arange(ids_BM.shape[0])[:, None], ids_BM.shape)
    draw = lambda b, v: jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, b), v))
    return jax.vmap(jax.vmap(draw))(rows_BM, ids_BM)


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
        """This rank's part of the token rows (a partial sum over the vocab shards).
        Under FSDP the table is gathered in its own dtype, here and in the
        head (one gather of a tied table for both; the lookup's gradient is
        scatter-added in that dtype)."""
        return local.vocab_rows(weight(self.embedding), ids_BT, self.dtype)

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
        parts = local.seq_parts()
        n, c = loss_chunks(self.loss_chunk, local.batch_per_dp_rank(B), T // parts)
        chunk_fn = lambda x, t: self._chunk_losses(x, t, local)
        if n == 1:
            return chunk_fn(x_BTD, targets_BT)
        # whole along T (each cp rank's part) before the chunks are cut: under
        # SP's overlap x arrives split along T, for a head that is one chunk
        x_BTD = local.constrain(x_BTD, "batch", "seq", "embed")
        if parts > 1:
            return self._cp_chunks(chunk_fn, x_BTD, targets_BT, parts, n, c)
        x_nBcD = jnp.pad(x_BTD, ((0, 0), (0, n * c - T), (0, 0))).reshape(
            B, n, c, D).transpose(1, 0, 2, 3)
        t_nBc = jnp.pad(targets_BT, ((0, 0), (0, n * c - T))).reshape(B, n, c).transpose(1, 0, 2)
        chunk = jax.checkpoint(chunk_fn,
                               policy=jax.checkpoint_policies.save_only_these_names("ce_stats"))
        losses_nBc = jax.lax.map(lambda xt: chunk(*xt), (x_nBcD, t_nBc))
        return losses_nBc.transpose(1, 0, 2).reshape(B, n * c)[:, :T]

    def _cp_chunks(self, chunk_fn, x_BTD, targets_BT, P: int, n: int, c: int):
        """`losses` on global arrays whose T is split over cp into P parts:
        the chunks are taken within each part ([B, P, n*c] with P over cp),
        so that every chunk is P pieces of c positions, one per cp rank, and
        nothing moves between them."""
        B, T, D = x_BTD.shape
        Tl = T // P
        pad = n * c - Tl
        x_nBPcD = jnp.pad(x_BTD.reshape(B, P, Tl, D), ((0, 0), (0, 0), (0, pad), (0, 0))) \
            .reshape(B, P, n, c, D).transpose(2, 0, 1, 3, 4)
        t_nBPc = jnp.pad(targets_BT.reshape(B, P, Tl), ((0, 0), (0, 0), (0, pad))) \
            .reshape(B, P, n, c).transpose(2, 0, 1, 3)
        x_nBPcD = constrain(x_nBPcD, None, "batch", "seq", None, None)
        t_nBPc = constrain(t_nBPc, None, "batch", "seq", None)
        chunk = jax.checkpoint(lambda x, t: chunk_fn(x.reshape(B, P * c, D), t.reshape(B, P * c)),
                               policy=jax.checkpoint_policies.save_only_these_names("ce_stats"))
        losses_nBT = jax.lax.map(lambda xt: chunk(*xt), (x_nBPcD, t_nBPc))
        losses_nBPc = losses_nBT.reshape(n, B, P, c)
        return losses_nBPc.transpose(1, 2, 0, 3).reshape(B, P, n * c)[:, :, :Tl].reshape(B, T)

    def _chunk_losses(self, x_BTD, targets_BT, local):
        """Cross-entropy per token from this rank's vocab slice; `local`
        completes each of the three statistics over tp (the max, the sum of
        exponentials and the target's logit), so no rank holds all logits."""
        table_VD = weight(self.embedding).astype(self.dtype)
        logits_BTV = local.project(
            x_BTD, lambda x, out_sharding=None: jnp.einsum(
                "BTD,VD->BTV", x.astype(self.dtype), table_VD,
                preferred_element_type=wide(self.dtype), out_sharding=out_sharding), ("vocab",))
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

    def next_token(self, x_BD, key, *, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0):
        """The next token [B] of each row from its last hidden state [B, D]
        (replicated over tp), sampled over the vocab shards (`sample`)."""
        with jax.named_scope("sample"):
            return parallel.vocab_sample(self, x_BD, key, temperature=temperature,
                                         top_k=top_k, top_p=top_p)

    def sample(self, x_BD, key, *, temperature: float, top_k: int, top_p: float, local):
        """Greedy (temperature 0): the arg-max over the shards, a max and a min
        of B values over tp. Else the Gumbel-max trick (Gumbel 1954; Maddison
        et al. 2014): arg-max of logits/temperature + Gumbel noise, which
        samples softmax(logits/temperature) exactly; the noise of token v in
        row b is drawn from fold_in(fold_in(key, b), v), so it depends on the
        token, not on which shard holds it, and tp changes no token. top-k and
        top-p (Holtzman et al. 2020) keep the k most likely tokens / the
        smallest set holding probability p; they choose among the c =
        max(top_k, 256) most likely tokens overall (each shard's best c,
        gathered, then the best c of those: the same set at every tp), so
        top-p is exact when its set has at most c tokens, else cut at c."""
        logits_BV = jnp.einsum("BD,VD->BV", x_BD.astype(wide(self.dtype)),
                               weight(self.embedding).astype(wide(self.dtype)))
        logits_BV = local.constrain(logits_BV, "batch", "vocab")
        ids_V = local.vocab_start(logits_BV.shape[-1]) + jnp.arange(logits_BV.shape[-1],
                                                                   dtype=jnp.int32)
        logits_BV = jnp.where(ids_V < self.vocab_size, logits_BV, NEG)
        if temperature == 0:
            return local.vocab_argmax(logits_BV)
        s_BV = logits_BV / temperature
        row0 = local.row_start(s_BV.shape[0])
        if not (top_k or top_p < 1):
            return local.vocab_argmax(
                s_BV + _gumbel(key, jnp.broadcast_to(ids_V, s_BV.shape), row0))
        c = max(top_k, TOP_CANDIDATES)
        top_BM, ids_BM = local.vocab_top(s_BV, c)
        # the global best c of the shards' candidates (ties: the lower id, as
        # the shards come in id order), the same set at every tp
        order_BM = jnp.argsort(-top_BM, axis=-1, stable=True)[:, :c]
        top_BM = jnp.take_along_axis(top_BM, order_BM, -1)
        ids_BM = jnp.take_along_axis(ids_BM, order_BM, -1)
        keep_BM = jnp.ones(top_BM.shape, bool)
        if top_k:
            keep_BM &= jnp.arange(top_BM.shape[-1]) < top_k
        if top_p < 1:  # probabilities under the whole vocabulary's softmax
            max_B = local.vocab_max(s_BV.max(-1))
            lse_B = jnp.log(local.vocab_sum(jnp.exp(s_BV - max_B[:, None]).sum(-1))) + max_B
            p_BM = jnp.exp(top_BM - lse_B[:, None])
            keep_BM &= jnp.cumsum(p_BM, -1) - p_BM < top_p  # the first token is always kept
        score_BM = jnp.where(keep_BM, top_BM + _gumbel(key, ids_BM, row0), -jnp.inf)
        return jnp.take_along_axis(ids_BM, score_BM.argmax(-1)[:, None], -1)[:, 0]

    def logits(self, x_BTD):
        """Full fp32 logits [B, T, vocab_size] (unpadded), for inference:
        x whole along T (under SP gathered), the vocab gathered before the
        padding is cut (typed shardings type both moves; the partitioner needs them too)."""
        x_BTD = parallel.constrain(x_BTD, "batch", "seq", "embed")
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(wide(self.dtype)),
                                weight(self.embedding).astype(wide(self.dtype)))
        return parallel.constrain(logits_BTV, "batch", "seq", None)[..., : self.vocab_size]
