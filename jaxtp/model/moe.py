"""Mixture of experts: a router picks each token's top-k of E expert MLPs
(its decisions and losses: `jaxtp.model.routing`); the experts' inputs are
`einsum("GTEC,GTD->EGCD")` of the dispatch, their outputs combined by the
kept routing weights, or the ragged path's rows sorted by expert."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ..config import ModelConfig
from ..sizes import capacity  # (pure arithmetic: `--plan` and the ledgers read it too)
from .. import parallel
from ..parallel import Layout, constrain, spec
from ..parallel.collectives import f, g, wide
from ..parallel.ep import Slots, over_tokens
from ..parallel.ep import ragged as ragged_rows
from .layers import gelu, init_std_out, param, weight
from .mlp import MLP
from .routing import (Routing, balance_loss, combine, counted, dispatch, load, route, running,
                      shares, z_loss)

__all__ = ["LOSSES", "STATS", "MoE", "Experts", "Routing", "add_stats", "balance_loss",
           "balance_weight", "capacity", "combine", "counted", "dispatch", "load", "moe",
           "n_stats", "route", "z_loss"]

# the router statistics a MoE layer returns: the two losses; monitored
# (`moe(monitor=True)`), the dropped share too, then the share of its
# assignments each expert gets ([E], `load`); summed over the layers
LOSSES = ("moe_balance", "moe_z")
STATS = (*LOSSES, "moe_dropped")


def n_stats(E: int, monitor: bool) -> int:
    """The length of a MoE layer's statistics vector."""
    return len(STATS) + E if monitor else len(LOSSES)


def add_stats(stats, layer_stats):
    """The statistics so far after a MoE layer's: summed [n], or per layer
    [L, n] (monitoring) as a shift register: every row moves up one and the
    layer's becomes the last, so after the L layers in order row i is layer
    i's, whatever loop ran them."""
    if stats.ndim == 1:
        return stats + layer_stats
    return jnp.roll(stats, -1, 0).at[-1].set(layer_stats)


def balance_weight(cfg: ModelConfig) -> float:
    """The loss's weight on a MoE layer's first statistic: the balance loss's
    coefficient, or under "bias" alone 1 (the statistic is then `counted`'s
    0, there for its gradient)."""
    return 1.0 if cfg.moe_balance == "bias" else cfg.moe_balance_coef


def moe(x_GTD, logits_GTE, experts: Callable, *, routing: Routing, factor: float,
        balance: str = "aux", parts: int = 0, bias_E=None,
        place: Callable = lambda x, to_experts: x, pin: Callable = lambda x: x,
        monitor: bool = False, ragged: Callable | None = None, mean: Callable = lambda x, **_: x,
        prior_E=None):
    """(y [G, T, D], stats: balance loss, z-loss, and where `monitor` the
    dropped share and the experts' loads [E] (`n_stats`)): each token
    through its kept top-k experts (`routing`, `route`), weighted;
    `experts(x_EGCD)` maps every expert's slots [E, G, C, D] to its outputs
    (the expert MLPs batched over E); `place(x_EGCD, to_experts)` lays the slots out for the experts
    (True) and back for the combine (False): ep's all-to-alls; `pin(a)`
    keeps a group-leading routing array [G, ...] split as the tokens are
    (else the partitioner may gather the routing over ep to meet the
    experts' split). `ragged(x_GTD, experts_GTk, weights_GTk)`, where given,
    is the dropless ragged path instead (`jaxtp.parallel.ep.ragged`): no
    slots, `factor` must be 0. `mean(a, reduce=lax.pmean)`: the statistics'
    means over the tokens of every rank (`over_tokens`). `balance`: the balance loss's reach
    (`parts`, `balance_loss`), or "bias": none; `bias_E`, where given, moves
    the choice (`route`) and carries the counts to its gradient (`counted`).
    `prior_E` ("global_aux" over a step's microbatches): the earlier
    microbatches' assignment shares, summed; the balance loss weighs P by
    the shares so far (`running`), and the statistics end with this
    microbatch's own shares [E]."""
    G, T, D = x_GTD.shape
    E = logits_GTE.shape[-1]
    C = capacity(T, routing.k, E, factor)
    weights_GTk, experts_GTk, probs_GTE = map(pin, route(pin(logits_GTE), routing, bias_E))
    if ragged is not None:
        if factor:
            raise ValueError(f"the ragged dispatch is dropless: capacity_factor={factor}, "
                             "not 0")
        y_GTD, kept_GTk = ragged(x_GTD, experts_GTk, weights_GTk), True
    else:
        by = weights_GTk if routing.drop == "probs" else None
        d_GTEC, kept_GTk = map(pin, dispatch(experts_GTk, E, C, probs_GTE.dtype, by))
        c_GTEC = pin(combine(experts_GTk, weights_GTk, kept_GTk, E, C, d_GTEC))
        x_EGCD = jnp.einsum("GTEC,GTD->EGCD", d_GTEC.astype(x_GTD.dtype), x_GTD)
        y_EGCD = place(experts(place(x_EGCD, True)), False)
        y_GTD = jnp.einsum("GTEC,EGCD->GTD", c_GTEC.astype(y_EGCD.dtype), y_EGCD)
    balanced = jnp.zeros((), probs_GTE.dtype)
    if prior_E is not None:  # (global_aux over slices: the shares and P kept by every
        # remat policy, so that none is summed again in the backward: `SHARES`)
        own_E = checkpoint_name(shares(experts_GTk, E, probs_GTE.dtype, mean), "moe_shares")
        balanced = balance_loss(probs_GTE, experts_GTk, mean, parts,
                                running(prior_E.astype(own_E.dtype), own_E), "moe_shares")
    elif balance != "bias":
        balanced = balance_loss(probs_GTE, experts_GTk, mean, parts)
    if bias_E is not None:  # (its value 0: the loss and its logged value unchanged)
        # (summed where manual: each rank's gradient its own counts, summed as a weight's)
        balanced = balanced + mean(counted(bias_E.astype(balanced.dtype), experts_GTk),
                                   reduce=jax.lax.psum)
    losses = jnp.stack([balanced, z_loss(logits_GTE, mean)])
    if prior_E is not None:  # (the step's running shares: this microbatch's for the next)
        return y_GTD.astype(x_GTD.dtype), jnp.concatenate([losses, own_E])
    if not monitor:  # (training: only what the loss reads, so the step computes no more)
        return y_GTD.astype(x_GTD.dtype), losses
    dropped = 1.0 - mean(jnp.mean(jnp.asarray(kept_GTk, losses.dtype)))
    return y_GTD.astype(x_GTD.dtype), jnp.concatenate([losses, dropped[None],
                                                       mean(load(experts_GTk, E, losses.dtype))])


class Experts(nnx.Module):
    """E expert MLPs batched over E (GELU, or SwiGLU for llama style), without
    biases (Mixtral, Qwen3-MoE, Switch). Inside an expert tp splits the
    hidden units as Megatron's MLP does: up [E, D, (2,) F] column-parallel,
    down [E, F, D] row-parallel; one all-reduce of the slots forward (g)
    and one backward (f)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        E, D, F = cfg.n_experts, cfg.d_model, cfg.expert_d_ff
        self.swiglu = cfg.style == "llama"
        up = ((E, D, 2, F), ("expert", "embed", None, "mlp")) if self.swiglu else \
            ((E, D, F), ("expert", "embed", "mlp"))
        self.up = param(rngs, nnx.initializers.normal(cfg.init_std), *up, cfg.param_dtype,
                        layout)
        self.down = param(rngs, nnx.initializers.normal(init_std_out(cfg.init_std, cfg.n_layers)),
                          (E, F, D), ("expert", "mlp", "embed"), cfg.param_dtype, layout)
        self.dtype, self.layout = cfg.dtype, layout
        self.slots = Slots(layout.sp)

    def __call__(self, x_EGCD):
        """Every expert's slots [E, G, C, D] -> its outputs, summed over tp
        (under SP reduce-scattered over it). Partitioned: the slots as the
        experts take them (`Slots.experts`, placed by `jaxtp.parallel.ep.placed`); written: as
        the dispatch made them (`Slots.tokens`), sent to the experts' ranks
        and back in the region (`jaxtp.parallel.ep.over_ep`), there gathered
        over tp and reduce-scattered back under SP (`f_sp`, `g_sp`), else
        f and g. (`jaxtp.parallel.experts`: the impl's `Local` decides.)"""
        return parallel.experts(self, x_EGCD)

    def local(self, x_EGCD, out_sharding=None):
        """The experts' math on whatever part of F this rank holds
        (`out_sharding`: typed shardings', which makes the contraction over
        tp a reduction)."""
        w_up, w_down = weight(self.up, self.dtype), weight(self.down, self.dtype)
        x_EGCD = x_EGCD.astype(self.dtype)
        if self.swiglu:
            h_EGCXF = jnp.einsum("EGCD,EDXF->EGCXF", x_EGCD, w_up)
            h_EGCF = jax.nn.silu(h_EGCXF[..., 0, :]) * h_EGCXF[..., 1, :]
        else:
            h_EGCF = gelu(jnp.einsum("EGCD,EDF->EGCF", x_EGCD, w_up))
        # F over tp, as the weights (else the partitioner may trade the down-projection's
        # partial sum for an all-to-all of h and the gathered weight)
        h_EGCF = constrain(h_EGCF, "expert", "expert_batch", None, "mlp")
        return jnp.einsum("EGCF,EFD->EGCD", checkpoint_name(h_EGCF, "mlp_up"), w_down,
                          out_sharding=out_sharding)

    def ragged_local(self, x_RD, sizes_E):
        """The same math on rows grouped by expert (`sizes_E` rows each, the
        rest of the R rows zero out): two or three `jax.lax.ragged_dot`s."""
        w_up, w_down = weight(self.up, self.dtype), weight(self.down, self.dtype)
        E, D = w_up.shape[:2]
        h_RF = jax.lax.ragged_dot(x_RD.astype(self.dtype), w_up.reshape(E, D, -1), sizes_E)
        if self.swiglu:
            h_RXF = h_RF.reshape(h_RF.shape[0], 2, -1)
            h_RF = jax.nn.silu(h_RXF[:, 0]) * h_RXF[:, 1]
        else:
            h_RF = gelu(h_RF)
        return jax.lax.ragged_dot(checkpoint_name(h_RF, "mlp_up"), w_down, sizes_E)

    def ragged(self, x_GTD, experts_GTk, weights_GTk):
        """The dropless ragged path (`jaxtp.parallel.ep.ragged`) in a region
        manual over every axis, under both impls: each rank routes its own
        tokens; tp splits F inside the experts and sums the layer's output
        over tp once (g), after the weighted sum, on [G, T, D] rather than
        on the rows."""
        G, T, k = experts_GTk.shape
        n = self.up.shape[0]

        def local(m, x_GTD, e_GTk, w_GTk):
            flat = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
            # f on the tokens, before they travel: its backward sums [N, D] over
            # tp, not the rows (k times as many, ep*min(k, E/ep) over ep)
            y_ND = ragged_rows(m.ragged_local, flat(f(x_GTD)), flat(e_GTk), flat(w_GTk), n)
            return g(y_ND.reshape(x_GTD.shape))

        tokens, routing = spec("batch", None, "embed"), spec("batch", None, None)
        return parallel.ragged_experts(self, local, x_GTD, experts_GTk, weights_GTk,
                                       arg_specs=(tokens, routing, routing), out_specs=tokens)


def _pin_groups(a, slots: Slots):
    """A routing array [G, ...] split over the groups as the tokens are."""
    return constrain(a, slots.groups, *(None,) * (a.ndim - 1))


class MoE(nnx.Module):
    """The router (replicated, fp32 logits) and the experts, and where
    `model.moe_shared_d_ff` a shared expert (a dense `MLP` every token takes,
    tp's column -> row rule, its own g and f on the tp ledger; gated by a
    sigmoid of the token where `model.moe_shared_gate`, Qwen2-MoE's); `__call__`
    returns the output [B, T, D] and the layer's router statistics
    (`STATS`). Each sequence is a routing group; under cp (and SP) each
    rank's part of one, n = cp (x tp) groups per sequence, so that a rank
    routes the tokens it holds (T/n of each sequence, as Megatron-Core's
    dispatchers route a rank's tokens) and sends 1/n of the slots. Only
    dropless routing (`model.capacity_factor` 0, held by `jaxtp.checks`)
    gives one device's result so: a capacity would count per part."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        self.router = param(rngs, nnx.initializers.normal(cfg.init_std),
                            (cfg.d_model, cfg.n_experts), ("embed", None), cfg.param_dtype,
                            layout)
        self.experts = Experts(cfg, layout, rngs=rngs)
        self.shared = MLP(dataclasses.replace(cfg, d_ff=cfg.moe_shared_d_ff), layout,
                          rngs=rngs) if cfg.moe_shared_d_ff else None
        # (Qwen2-MoE's gate on it: one logit a token, replicated as the router)
        self.shared_gate = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.d_model, 1),
                                 ("embed", None), cfg.param_dtype, layout) \
            if cfg.moe_shared_gate else None
        self.routing, self.factor = Routing.of(cfg), cfg.capacity_factor
        self.ragged = cfg.moe_dispatch == "ragged"
        self.layout, self.slots = layout, self.experts.slots
        self.splits = layout.cp * (layout.tp if layout.sp else 1)  # groups per sequence
        self.balance = cfg.moe_balance.replace("bias+", "")  # (the loss's part)
        self.parts = self.splits if self.balance == "seq_aux" else 0
        # the loss-free balance's bias [E] (DeepSeek-V3 Eq. 16): a parameter the
        # optimizer moves by the sign of each expert's load (`jaxtp.train.optim`)
        self.router_bias = param(None, jnp.zeros, (cfg.n_experts,), (None,),
                                 wide(cfg.param_dtype), layout) \
            if cfg.moe_balance.startswith("bias") else None
        self.tag = "mlp_out"
        self.monitor = False  # also the dropped share and the loads (`moe`)

    def __call__(self, x_BTD, prior_E=None):
        """(y [B, T, D], the router statistics: `moe`; `prior_E` its own)."""
        B, T, D = x_BTD.shape
        with jax.named_scope("moe"):
            # each rank's part of a sequence its own group (the sequence is
            # split over cp, and tp under SP, in that order: a reshape moves
            # nothing)
            x_GSD = self._groups(x_BTD)
            logits_GSE = jnp.einsum("GSD,DE->GSE", x_GSD.astype(wide(x_GSD)),
                                    weight(self.router, wide(x_GSD)))
            y_GSD, stats = moe(x_GSD, logits_GSE, self.experts, routing=self.routing,
                               factor=self.factor, balance=self.balance, parts=self.parts,
                               bias_E=None if self.router_bias is None else self.router_bias[...],
                               place=functools.partial(parallel.place_slots, self),
                               pin=functools.partial(_pin_groups, slots=self.slots),
                               monitor=self.monitor,
                               ragged=self.experts.ragged if self.ragged else None,
                               mean=functools.partial(over_tokens, sp=self.layout.sp),
                               prior_E=prior_E)
            y_BTD = checkpoint_name(self._groups(y_GSD, (B, T, D)), self.tag)
        if self.shared is not None:  # (in the "mlp" scope, as a dense block's MLP)
            shared_BTD = self.shared(x_BTD)
            if self.shared_gate is not None:
                w_D1 = weight(self.shared_gate, x_BTD.dtype)
                shared_BTD = jax.nn.sigmoid(jnp.einsum("BTD,DO->BTO", x_BTD, w_D1)) * shared_BTD
            y_BTD = y_BTD + shared_BTD
        return y_BTD, stats

    def _groups(self, a, to: tuple | None = None):
        """The residual stream [B, T, D] as routing groups [n*B, T/n, D], or
        (`to`: its shape) back: through [n, B, T/n, D], the part of each
        sequence major, so that a rank's groups are one tile (`Slots`:
        split over cp (x tp), then the batch's axes) and no token moves
        (a group index b*n + j would tile a rank's tokens apart: the partitioner moves
        them, an all-to-all over tp)."""
        n, (_, seq, _) = self.splits, self.layout.residual
        if n == 1:  # the sequences are the groups
            return a if to is None else constrain(a, *self.layout.residual)
        if to is None:
            B, T, D = a.shape
            a = constrain(a, *self.layout.residual).reshape(B, n, T // n, D)
            a = constrain(a, "batch", seq, None, "embed").transpose(1, 0, 2, 3)
            return constrain(a.reshape(n * B, T // n, D), self.slots.groups, None, "embed")
        B, T, D = to
        a = constrain(a, self.slots.groups, None, "embed").reshape(n, B, T // n, D)
        a = constrain(a.transpose(1, 0, 2, 3), "batch", seq, None, "embed")
        return constrain(a.reshape(B, T, D), *self.layout.residual)
