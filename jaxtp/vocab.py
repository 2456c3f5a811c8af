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

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .layers import _param
from .manual import SEQ_SPLIT, f, f_sp, g, g_sp, gather_seq, run_sharded, tp_rank
from .sharding import constrain, mesh_axis_size, residual_axes

NEG = jnp.finfo(jnp.float32).min


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_VD, ids_BT, dtype):
    """table[ids] in `dtype`, gathered from the table cast to it (every id is a
    valid row: the data is checked against the vocabulary). The gradient is
    scatter-added in the table's dtype, as the plain lookup's would be."""
    return table_VD.astype(dtype).at[ids_BT].get(mode="promise_in_bounds")


def _lookup_fwd(table_VD, ids_BT, dtype):
    return _lookup(table_VD, ids_BT, dtype), (ids_BT, jnp.zeros_like(table_VD))


def _lookup_bwd(dtype, res, dx_BTD):
    ids_BT, zeros_VD = res
    return zeros_VD.at[ids_BT].add(dx_BTD.astype(zeros_VD.dtype)), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def loss_chunks(loss_chunk: int, rows: int, T: int) -> tuple[int, int]:
    """(chunks n, positions per chunk c) of the chunked loss: `loss_chunk`
    tokens of `rows` rows (a dp rank's batch) as whole positions; (1, T) off."""
    c = max(1, loss_chunk // max(1, rows)) if loss_chunk else T
    return (1, T) if c >= T else (-(-T // c), c)


class VocabEmbed(nnx.Module):
    """Token table [V_pad, D] split over tp on V: lookup, LM head, cross-entropy."""

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", sp: bool = False,
                 rngs: nnx.Rngs):
        self.embedding = _param(rngs, nnx.initializers.normal(cfg.init_std),
                                (cfg.padded_vocab, cfg.d_model), ("vocab", "embed"),
                                cfg.param_dtype)
        self.vocab_size = cfg.vocab_size
        self.dtype = cfg.dtype
        self.loss_chunk = cfg.loss_chunk
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
            # GSPMD sums the partial rows (g) right at the gather: rows of the
            # compute dtype, so the sum is in it too. Replicated first, then
            # split along T under SP, which XLA's GPU pipeline turns into one
            # reduce-scatter; pinned straight to the sequence split, GSPMD
            # would rather gather a small table (or shuffle the ids).
            x_BTD = constrain(_lookup(self.embedding[...], ids_BT, self.dtype),
                              *residual_axes(False))
            return constrain(x_BTD, *residual_axes(self.sp))

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
        # named, so a recomputed chunk (`_chunked`) reuses the reduced values
        # instead of reducing again
        max_BT = checkpoint_name(reduce_max(jax.lax.stop_gradient(logits_BTV.max(-1))),
                                 "ce_stats")
        sumexp_BT = checkpoint_name(
            reduce_sum(jnp.exp(logits_BTV - max_BT[..., None]).sum(-1)), "ce_stats")
        target_BT = checkpoint_name(
            reduce_sum(jnp.where(ids_V == targets_BT[..., None], logits_BTV, 0).sum(-1)),
            "ce_stats")
        return jnp.log(sumexp_BT) + max_BT - target_BT

    def _chunked(self, losses_fn, x_BTD, targets_BT):
        """`losses_fn` over chunks of positions, each recomputed in the backward
        pass: one chunk's [B, c, V/tp] logits live at a time, not [B, T, V/tp].

        A chunk holds `loss_chunk` tokens per dp rank as whole positions of
        every row (c = loss_chunk // rows, at least 1); T is padded to a
        multiple of c and the padded losses dropped. The three reductions run
        per chunk; the recomputation keeps their results ("ce_stats"), so it
        adds no collective.
        """
        B, T, D = x_BTD.shape
        n, c = loss_chunks(self.loss_chunk, B // mesh_axis_size("dp"), T)
        if n == 1:
            return losses_fn(x_BTD, targets_BT)
        x_nBcD = jnp.pad(x_BTD, ((0, 0), (0, n * c - T), (0, 0))).reshape(
            B, n, c, D).transpose(1, 0, 2, 3)
        t_nBc = jnp.pad(targets_BT, ((0, 0), (0, n * c - T))).reshape(B, n, c).transpose(1, 0, 2)
        chunk = jax.checkpoint(losses_fn,
                               policy=jax.checkpoint_policies.save_only_these_names("ce_stats"))
        losses_nBc = jax.lax.map(lambda xt: chunk(*xt), (x_nBcD, t_nBc))
        return losses_nBc.transpose(1, 0, 2).reshape(B, n * c)[:, :T]

    def token_losses(self, x_BTD, targets_BT):
        """fp32 cross-entropy [B, T] of next-token targets, from vocab-sharded logits."""
        with jax.named_scope("cross_entropy"):
            if self.impl == "shard_map":
                enter = f_sp if self.sp else f

                def fn(m, x_BTD, targets_BT):
                    pmax = lambda v: jax.lax.pmax(v, "tp")
                    start = tp_rank() * m._rows()
                    # f (or f_sp) once on the whole input: dX is reduced once
                    return m._chunked(lambda x, t: m._token_losses(x, t, start, pmax, g),
                                      enter(x_BTD), targets_BT)
                specs = (SEQ_SPLIT if self.sp else P(), P())
                return run_sharded(self, fn, x_BTD, targets_BT, arg_specs=specs)
            same = lambda v: v
            if self.sp:  # the final norm stays on its shard (see manual.tp_region)
                x_BTD = gather_seq(constrain(x_BTD, *residual_axes(True)))
            return self._chunked(lambda x, t: self._token_losses(x, t, 0, same, same),
                                 x_BTD, targets_BT)

    def logits(self, x_BTD):
        """Full fp32 logits [B, T, vocab_size] (unpadded), for inference."""
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD.astype(jnp.float32),
                                self.embedding[...].astype(jnp.float32))
        return logits_BTV[..., : self.vocab_size]
