"""Decoder-only Transformer: pre-norm blocks of attention and MLP, GPT-2 or Llama style.

Dimension alphabet used in variable names throughout jaxtp:
B batch, T (and S) sequence, D model, N query heads, K kv heads (groups),
G query heads per group, H head dim, F mlp hidden, V vocab, C a small stacked
axis (gate/up, k/v, or per group the G queries, k and v).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..parallel import Layout, Schedule, constrain, wide
from ..parallel.stack import scan_layers, stack, stack_loss
from .block import Block, Group, block_fn, layers_of, unit_of
from .layers import Embed, dropout, make_norm
from .moe import LOSSES, add_stats, balance_weight, n_stats
from .vocab import VocabEmbed


class Transformer(nnx.Module):
    """Vocab-parallel token embedding (+ learned positions for GPT-2), L blocks,
    final norm, vocab-parallel LM head (tied to the embedding or not)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs,
                 schedule: Schedule | None = None):
        # (`schedule`: how the stack runs, `jaxtp.parallel.stack`; default one batch)
        if schedule is None and layout.pp > 1:
            raise ValueError("a pipelined layout (pp > 1) needs its Schedule: build the model "
                             "with jaxtp.model.build_model, or pass schedule=Schedule.of(cfg, "
                             "layout)")
        # (a leading run of dense layers, `moe_first_dense`: a list before the stack)
        lead = cfg.n_layers - cfg.stacked_layers
        schedule = schedule or Schedule(layers=cfg.n_layers, scan=cfg.scan_layers,
                                        period=cfg.layer_group, lead=lead)
        self.wte = VocabEmbed(cfg, layout, rngs=rngs)
        self.wpe = None if cfg.style == "llama" else Embed(
            cfg.seq_len, cfg.d_model, layout, std=cfg.init_std, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, rngs=rngs)
        # the blocks draw their parameters in order, kept as a list or stacked: a
        # scanned or pipelined model starts from the values of the plain one
        blocks = [Block(cfg, layout, rngs=rngs, moe=cfg.is_moe_layer(i))
                  for i in range(cfg.n_layers)]
        self.dense = nnx.List(blocks[:lead]) if lead else None
        self.blocks = (_stacked(blocks[lead:], cfg, layout, schedule) if schedule.stacked
                       else nnx.List(blocks[lead:]))
        self.ln_f = make_norm(cfg, layout)
        self.lm_head = None if cfg.tie_embeddings else VocabEmbed(cfg, layout, rngs=rngs)
        self.cfg, self.layout, self.schedule = cfg, layout, schedule
        self.monitor = False  # the MoE layers' statistics for monitoring (`hidden_and_stats`)
        self.mesh = None  # the mesh the parameters live on, where a loader knows it

    def hidden(self, tokens_BT, *, dropout_key=None):
        """int tokens [B, T] -> final-norm hidden states [B, T, D]."""
        return self.hidden_and_stats(tokens_BT, dropout_key=dropout_key)[0]

    def hidden_and_stats(self, tokens_BT, *, dropout_key=None, shares=None):
        """(final-norm hidden states [B, T, D], the MoE layers' router
        statistics summed over the layers (`jaxtp.model.moe.moe`; with
        `monitor` set, `model.set_attributes(monitor=True)`, the dropped share
        and loads too, per MoE layer [L_moe, n]); zeros
        without experts). `shares` ("global_aux"): the step's earlier
        microbatches' assignment shares per MoE layer [L_moe, E]; then the
        statistics are (their sums, this microbatch's shares [L_moe, E])."""
        L, k, S = self.cfg.n_layers, self.cfg.layer_group, self.cfg.stacked_layers
        keys = (None if dropout_key is None else jax.random.split(dropout_key, L + 1))
        x_BTD = self._embed(tokens_BT, None if keys is None else keys[0])
        rows = (self.cfg.n_moe_layers,) * self.monitor
        stats = jnp.zeros((*rows, n_stats(self.cfg.n_experts, self.monitor)), wide(x_BTD))
        stats = stats if shares is None else (stats, shares)
        carry, layer = (x_BTD, stats if self.cfg.n_experts else None), self._layer()
        for i, block in enumerate(self.dense or ()):  # (the leading dense run)
            carry = layer(block, carry, None if keys is None else keys[1 + i])
        keys = None if keys is None else keys[1 + L - S:]
        # (a stacked stack's keys per unit: [S/k, k, ...] for a Group's layers)
        unit_keys = keys if keys is None or k == 1 or not self.schedule.stacked \
            else keys.reshape(S // k, k, *keys.shape[1:])
        if self.monitor and self.schedule.stages > 1:
            # per layer under a pipeline: the stack in one loop on every rank,
            # in model order (circular stores it otherwise: `Schedule.layer_order`),
            # each layer's weights gathered from its stage; forward only, for metrics
            order = np.argsort(self.schedule.layer_order())
            graphdef, state = nnx.split(self.blocks)
            blocks = nnx.merge(graphdef, jax.tree.map(lambda a: a[order], state))
            x_BTD, aux = scan_layers(self.schedule, layer, blocks, carry)
        else:
            x_BTD, aux = stack(self.schedule, self.layout, layer, self.blocks, *carry, unit_keys)
        return self.ln_f(x_BTD), stats if aux is None else aux

    def _layer(self):
        """One unit of the stack (a block, or a Group's blocks in order) on
        (x, the router statistics so far, or None), each block's activations
        rematerialised by `model.remat`'s policy."""
        run = block_fn(self.cfg.remat, self.cfg.moe_slots)

        def layer(unit, carry, key):
            x_BTD, stats = carry
            grouped = isinstance(unit, Group)
            for j, block in enumerate(layers_of(unit)):
                k = key[j] if grouped and key is not None else key
                if not block.moe:
                    x_BTD = run(block, x_BTD, k)
                elif isinstance(stats, tuple):  # (sums, running shares: `hidden_and_stats`)
                    x_BTD, layer_stats = run(block, x_BTD, k, stats[1][0])
                    n = len(LOSSES)
                    stats = (stats[0] + layer_stats[:n], add_stats(stats[1], layer_stats[n:]))
                else:
                    x_BTD, layer_stats = run(block, x_BTD, k)
                    stats = add_stats(stats, layer_stats)
            return x_BTD, stats
        return layer

    def _lead(self, x_BTD):
        """The leading dense run (`model.moe_first_dense`) on `x_BTD`, as
        `hidden_and_stats` runs it (where the schedule runs the head: 1F1B)."""
        layer = self._layer()
        for block in self.dense or ():
            x_BTD = layer(block, (x_BTD, None), None)[0]
        return x_BTD

    def _embed(self, tokens_BT, key):
        """int tokens [B, T] -> the residual stream entering the first block."""
        T = tokens_BT.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.cfg.seq_len}")
        x_BTD = self.wte(tokens_BT)
        if self.wpe is not None:
            pos_1TD = self.wpe(jnp.asarray(self.layout.positions(T)))[None]
            if self.layout.sp:  # on the token rows' sequence shard, so the partitioner adds
                # them after the embedding's reduce-scatter, not before it
                pos_1TD = constrain(pos_1TD, None, *self.layout.residual[1:])
            x_BTD = x_BTD + pos_1TD
        return constrain(dropout(x_BTD, self.cfg.dropout, key), *self.layout.residual)

    def extend(self, tokens_BT, pos_BT, k_LBSKH, v_LBSKH, prefill: bool):
        """Inference over new positions with per-layer KV caches [L, B, S, Kc, H]
        (`jaxtp.generate`): final-norm hidden states [B, T, D] and the caches.
        `prefill`: the prompts from position 0, else one token per row."""
        x_BTD = self.wte(tokens_BT)
        if self.wpe is not None:
            x_BTD = x_BTD + self.wpe(pos_BT)
        x_BTD = constrain(x_BTD, *self.layout.residual)
        lead = len(self.dense or ())  # (the leading dense run's caches first)
        for i, block in enumerate(self.dense or ()):
            x_BTD, k_BSKH, v_BSKH = block.extend(x_BTD, k_LBSKH[i], v_LBSKH[i], pos_BT, prefill)
            k_LBSKH, v_LBSKH = k_LBSKH.at[i].set(k_BSKH), v_LBSKH.at[i].set(v_BSKH)
        k_all, v_all, k_LBSKH, v_LBSKH = k_LBSKH, v_LBSKH, k_LBSKH[lead:], v_LBSKH[lead:]
        if self.schedule.stacked:
            k, shape = self.cfg.layer_group, k_LBSKH.shape

            @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0, 0),
                      transform_metadata={nnx.PARTITION_NAME: self.schedule.stack_axis})
            def body(x_BTD, unit, k_kBSKH, v_kBSKH):
                ks, vs = [], []
                for j, block in enumerate(layers_of(unit)):
                    x_BTD, kj, vj = block.extend(x_BTD, k_kBSKH[j], v_kBSKH[j], pos_BT, prefill)
                    ks.append(kj)
                    vs.append(vj)
                return x_BTD, jnp.stack(ks), jnp.stack(vs)

            # (the caches per unit: [L/k, k, ...])
            x_BTD, k_LBSKH, v_LBSKH = body(x_BTD, self.blocks,
                                           k_LBSKH.reshape(shape[0] // k, k, *shape[1:]),
                                           v_LBSKH.reshape(shape[0] // k, k, *shape[1:]))
            k_LBSKH, v_LBSKH = k_LBSKH.reshape(shape), v_LBSKH.reshape(shape)
        else:
            for i, block in enumerate(self.blocks):
                x_BTD, k_BSKH, v_BSKH = block.extend(x_BTD, k_LBSKH[i], v_LBSKH[i], pos_BT,
                                                     prefill)
                k_LBSKH, v_LBSKH = k_LBSKH.at[i].set(k_BSKH), v_LBSKH.at[i].set(v_BSKH)
        if lead:
            k_LBSKH = k_all.at[lead:].set(k_LBSKH)
            v_LBSKH = v_all.at[lead:].set(v_LBSKH)
        return self.ln_f(x_BTD), k_LBSKH, v_LBSKH

    @property
    def head(self) -> VocabEmbed:
        return self.wte if self.lm_head is None else self.lm_head

    def __call__(self, tokens_BT, *, dropout_key=None):
        """int tokens [B, T] -> fp32 logits [B, T, vocab_size], for inference.

        Training uses `loss`, which never materialises the full logits.
        """
        return self.head.logits(self.hidden(tokens_BT, dropout_key=dropout_key))

    def loss(self, tokens_BT, targets_BT, *, dropout_key=None, forward_only: bool = False,
             shares=None):
        """Mean next-token cross-entropy, from vocab-sharded logits.
        `forward_only` (evaluation): where the schedule runs the head, the loss
        by a forward alone, not by the one that computes the gradients too.
        `shares` ("global_aux" over microbatches, `hidden_and_stats`): (the
        loss, this microbatch's shares [L_moe, E])."""
        if self.schedule.runs_head and not forward_only:
            # MoE: each stage's router statistics weighted into the loss in
            # the schedule, per microbatch (as `hidden_and_stats`'s pipeline)
            n = n_stats(self.cfg.n_experts, self.monitor) if self.cfg.n_experts else 0
            weights = np.zeros(n, wide(self.cfg.dtype))
            if n:
                weights[:2] = balance_weight(self.cfg), self.cfg.moe_z_coef
            return stack_loss(
                self.schedule, self.layout, self._layer(), self.blocks,
                lambda mods, y, t: mods[1].token_losses(mods[0](y), t).sum(),
                nnx.List([self.ln_f, self.head]), self._lead(self._embed(tokens_BT, None)),
                targets_BT,
                jnp.zeros(n, weights.dtype) if n else None, weights if n else None)
        x_BTD, stats = self.hidden_and_stats(tokens_BT, dropout_key=dropout_key, shares=shares)
        stats, own = stats if shares is not None else (stats, None)
        stats = stats.sum(0) if stats.ndim == 2 else stats  # (monitored: per layer)
        loss = self.head.token_losses(x_BTD, targets_BT).mean()
        if not self.cfg.n_experts:
            return loss
        # the router losses, summed over the MoE layers (`jaxtp.model.moe`)
        loss = loss + balance_weight(self.cfg) * stats[0] + self.cfg.moe_z_coef * stats[1]
        return loss if own is None else (loss, own)


def _stacked(blocks: list[Block], cfg: ModelConfig, layout: Layout, schedule: Schedule):
    """One unit (a Block, or a Group: `unit_of`) whose every parameter is the
    `blocks`' stacked on a leading axis over the units [L/k, ...] (in
    `Schedule.layer_order`), split over the schedule's stack axis (None:
    replicated). Its structure comes from an `nnx.vmap`ped construction
    whose own draws are discarded (unused under jit)."""
    k = cfg.layer_group

    @nnx.split_rngs(splits=len(blocks) // k)
    @nnx.vmap(in_axes=0, out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: schedule.stack_axis})
    def stack(rngs):
        return unit_of(cfg, layout, rngs)

    stacked = stack(nnx.Rngs(0))
    state = nnx.state(stacked)
    # (an interleaved pipeline stores its units out of order)
    order = [u * k + j for u in schedule.layer_order() for j in range(k)]
    pure = stack_layers({"blocks": dict(enumerate(nnx.to_pure_dict(nnx.state(blocks[i]))
                                                  for i in order))}, k)["blocks"]
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(stacked, state)
    return stacked


def stack_layers(pure: dict, period: int = 1) -> dict:
    """Per-layer parameters {"blocks": {0: tree, 1: tree, ...}} (a pure dict,
    `nnx.to_pure_dict`) -> the scanned layout {"blocks": tree of [L, ...]};
    in units of `period` layers (`Group`), {"blocks": {"layers": {j: tree of
    [L/period, ...]}}}, position j holding layers j, j + period, ..."""
    blocks = pure["blocks"]
    layers = [blocks[i] for i in range(len(blocks))]
    stack = lambda *xs: np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)
    if period == 1:
        return {**pure, "blocks": jax.tree.map(stack, *layers)}
    return {**pure, "blocks": {"layers": {j: jax.tree.map(stack, *layers[j::period])
                                          for j in range(period)}}}


def unstack_layers(pure: dict) -> dict:
    """The inverse of `stack_layers` (the period read off the tree)."""
    blocks = pure["blocks"]
    if "layers" not in blocks:
        L = jax.tree.leaves(blocks)[0].shape[0]
        return {**pure, "blocks": {i: jax.tree.map(lambda x: x[i], blocks) for i in range(L)}}
    k = len(blocks["layers"])
    G = jax.tree.leaves(blocks["layers"][0])[0].shape[0]
    return {**pure, "blocks": {g * k + j: jax.tree.map(lambda x: x[g], blocks["layers"][j])
                               for g in range(G) for j in range(k)}}


def reorder_layers(pure: dict, order) -> dict:
    """{"blocks": tree of [L, ...]} (a pure dict) with stack position j
    holding what position order[j] held: `Schedule.layer_order` puts model
    order into an interleaved pipeline's storage, its inverse (np.argsort) takes
    it back. The same dict where the order is the identity."""
    idx = np.asarray(order)
    if (idx == np.arange(idx.size)).all():
        return pure
    return {**pure, "blocks": jax.tree.map(lambda x: x[idx], pure["blocks"])}
