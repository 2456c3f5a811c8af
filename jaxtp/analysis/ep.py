"""The expert-parallel ledger's all-to-alls (`jaxtp.model.moe` over an ep axis).

Per MoE layer and microbatch each rank routes the T_r = B/(dp*ep) * s tokens
of its G_r = B/(dp*ep) groups (sequences of s tokens). Its dispatch builds
every expert's slots for those groups, a buffer of E * G_r * C * D elements
(C = ceil(cf * s * k / E) slots per expert and group: about cf * T_r * k * D,
GShard's expert capacity, Lepikhin et al. 2020, Sec. 2.2; dropless, C = s:
E/k times cf = 1's). The buffer is resharded from the tokens' split (groups
over dp x ep) to the experts' (E over ep): one all-to-all over ep, which
keeps 1/ep of it and sends (ep-1)/ep; the combine brings the experts'
outputs back by the same all-to-all reversed. Forward: 2 all-to-alls
(dispatch, combine); backward: their transposes, 2 more (Fedus et al. 2021,
Switch, Sec. 2.2, counts the same two per layer). Under remat "full" the
backward runs the forward's two again; every other policy keeps what they
delivered (the remat name "ep_slots").

On XLA:CPU (jax 0.10.2) an all-to-all is one instruction with one operand
per peer (`jaxtp.hlo` reads each as a collective of its own): a row here
counts ep operands of 1/ep of the buffer each (role "a2a_peers"); XLA:GPU
compiles one array of the whole buffer (`backends.on_backend`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from ..config import Config
from ..model.moe import LOSSES, capacity
from ..parallel import CP_AXIS, DATA_AXIS, EP_AXIS, PP_AXIS, TP_AXIS
from .rows import (ANY_SCOPE, HLO_DTYPES, Expected, counts_local, microbatch_rows, moe_per_tick,
                   on, reduces_once, runs_head, schedule_of)


def splits(cfg: Config) -> int:
    """The routing groups a sequence is cut into, n = cp (x tp under SP): a
    rank routes its own part of each (`jaxtp.model.moe.MoE`)."""
    p = cfg.parallel
    return p.cp * (p.tp if p.sequence_parallel else 1)


def slots(cfg: Config) -> int:
    """Elements of one rank's slot buffer per MoE layer and microbatch:
    E * G_r * C * D, its G_r = B/(M*dp*ep) groups of s/n tokens (`splits`;
    a pipeline's microbatch, B/M rows, holds every stage's rows)."""
    m = cfg.model
    groups = microbatch_rows(cfg)
    C = capacity(m.seq_len // splits(cfg), m.moe_top_k, m.n_experts, m.capacity_factor)
    return m.n_experts * groups * C * m.d_model


def tokens(cfg: Config) -> int:
    """The tokens N a rank routes per MoE layer and microbatch:
    B/(M*dp*ep) * s/n (a pipeline's microbatch holds every stage's rows)."""
    m = cfg.model
    return microbatch_rows(cfg) * m.seq_len // splits(cfg)


def _ragged_ep(cfg: Config) -> list[Expected]:
    """The ragged path's exchanges over ep, per MoE layer and microbatch
    (`jaxtp.parallel.ep.ragged`), in XLA:GPU's form (XLA:CPU compiles no
    ragged-all-to-all). A rank sends its A = N*k rows sorted by expert
    into a receive buffer of R = ep*N*min(k, E/ep) rows (the worst case:
    every rank's tokens on this rank's experts), and the outputs come back
    into A rows: forward one ragged all-to-all of R*D and one of A*D
    elements (the results), backward their transposes (A*D, R*D). A row's
    ring bytes are (ep-1)/ep of its buffer: for the dispatch an upper bound
    (balanced routing sends (ep-1)/ep of A*D; the buffer is ep*min(k, E/ep)/k
    times that). The sizes and offsets travel as int32: forward the send
    sizes all-gathered [ep, ep], the per-expert counts all-to-all'd
    [ep, E/ep] and the reverse exchange's offsets [ep]; backward each
    transpose exchanges its two offset vectors [ep] (jax's transpose rule),
    one of which is the forward's own (XLA computes it once): 3. Under remat
    "full" the forward's exchanges run again."""
    m, p = cfg.model, cfg.parallel
    El, N, k, D = m.n_experts // p.ep, tokens(cfg), m.moe_top_k, m.d_model
    R, A, dt = p.ep * N * min(k, El), N * k, HLO_DTYPES[m.dtype]
    E = lambda name, kind, pass_, n, dtype=dt, count=1: Expected(
        f"ep: {name}", kind, pass_, "moe", n, dtype, p.ep, count, "ep", (EP_AXIS,),
        per="layer")
    forward = [E("the rows to their experts' ranks (ragged, worst-case buffer)",
                 "ragged-all-to-all", "forward", R * D),
               E("the outputs home (ragged)", "ragged-all-to-all", "forward", A * D)]
    rows = forward + [
        E("their transposes", "ragged-all-to-all", "backward", R * D),
        E("their transposes", "ragged-all-to-all", "backward", A * D),
        E("sizes: the send sizes of every rank", "all-gather", "forward", p.ep * p.ep, "s32"),
        E("sizes: the rows per expert from every rank", "all-to-all", "forward", p.ep * El,
          "s32"),
        E("sizes: where each rank's rows came from", "all-to-all", "forward", p.ep, "s32"),
        E("sizes: the transposes' offsets", "all-to-all", "backward", p.ep, "s32", 3)]
    if m.remat == "full":
        rows += [dataclasses.replace(r, name=f"remat 'full': {r.name}", pass_="backward")
                 for r in forward]
    return rows


def per_moe_layer(cfg: Config, rows: list[Expected]) -> list[Expected]:
    """Rows counted per layer, for the MoE layers alone: where only every
    `model.moe_every`-th layer is one (a "layer" row would count every layer
    a loop trip runs), each counted per trip times the MoE layers it runs;
    else as they are."""
    m = cfg.model
    if m.n_moe_layers == m.n_layers:
        return rows
    moe = moe_per_tick(cfg)
    return [dataclasses.replace(r, count=r.count * moe, per="tick")
            if r.per == "layer" else r for r in rows]


def expected_ep(cfg: Config, impl: str = "gspmd") -> list[Expected]:
    """The all-to-alls over ep, per MoE layer and microbatch (see the
    module docstring), as XLA:CPU's operands (`backends.on_backend` joins
    them for an accelerator): written out by
    `jaxtp.parallel.ep` under shard_map, placed by GSPMD under gspmd."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1 or not m.n_experts:
        return []
    if m.moe_dispatch == "ragged":
        return per_moe_layer(cfg, _ragged_ep(cfg))
    part = slots(cfg) // p.ep
    E = lambda name, pass_: Expected(f"ep: {name}", "all-to-all", pass_, "moe", part,
                                     HLO_DTYPES[m.dtype], p.ep, 2 * p.ep, "a2a_peers", (EP_AXIS,),
                                     written=impl == "shard_map", per="layer")
    rows = [E("dispatch and combine (the slots to their experts' ranks and back)", "forward"),
            E("their transposes (the slots' gradients back and forth)", "backward")]
    if m.remat == "full" or resent(cfg):  # (the policies that do not keep "ep_slots")
        rows.append(E(f"remat {m.remat!r}: dispatch and combine again for the backward",
                      "backward"))
    return per_moe_layer(cfg, rows)


def resent(cfg: Config) -> bool:
    """Whether a remat that keeps ep's slots is told not to
    (`model.moe_slots=resend`): the backward sends them again."""
    return cfg.model.remat in ("minimal", "dots") and cfg.model.moe_slots == "resend"


def expected_moe(cfg: Config, impl: str) -> list[Expected]:
    """A MoE model's MoE layers' own rows, per MoE layer and microbatch (the
    rest of its step is the dense ledgers' on the same parameters, where ep
    splits the batch as dp does for all but the experts):

    - tp inside the experts (Megatron's MLP rule over the slots): g forward
      and f backward, each an all-reduce of the rank's slots (`slots`); under
      remat "full" g again (the block keeps its output, not the experts');
      under SP an entry's all-gather and an exit's reduce-scatter (`_sp_rows`);
    - ep's all-to-alls (`expected_ep`);
    - the router's statistics over the axes that split the tokens: the
      z-loss's mean and the balance loss's f and P, 1 + 2E elements forward
      (XLA combines them with the loss's mean), f again backward under any
      remat (the recomputed block reads it for the balance loss's gradient)."""
    if not cfg.model.n_experts:
        return []
    return per_moe_layer(cfg, _moe_rows(cfg, impl)) + expected_ep(cfg, impl)


def _moe_rows(cfg: Config, impl: str) -> list[Expected]:
    """The MoE layers' own rows (`expected_moe`'s list, but ep's all-to-alls),
    per MoE layer and microbatch where not said: tp inside the experts, the
    router's statistics (a pipeline's stages' summed once)."""
    m, p = cfg.model, cfg.parallel
    dt = HLO_DTYPES[m.dtype]
    E = lambda name, kind, pass_, n, count, group, axes, dtype=dt, per="layer", scope="moe", \
        written=True, role="moe": Expected("moe: " + name, kind, pass_, scope, n, dtype, group,
                                            count, role, axes, written, per)
    ragged = m.moe_dispatch == "ragged"
    tp_n = tokens(cfg) * m.d_model if ragged else slots(cfg)  # what g and f sum
    sp = p.sequence_parallel
    # (the slots' rows: role "moe_slots", for a compiler's rule on the experts' inputs)
    T = lambda *a, **k: E(*a, role="moe" if ragged else "moe_slots", **k)
    own = [] if p.tp == 1 else _sp_rows(cfg, impl, T, tp_n) if sp else [
        T("g: the experts' output " + ("(the layer's, weighted)" if ragged else
                                        "(the rank's slots)"), "all-reduce", "forward",
          tp_n, 1, p.tp, (TP_AXIS,)),
        T("f: dX entering the experts' up-proj", "all-reduce", "backward", tp_n, 1,
          p.tp, (TP_AXIS,))]
    if own and ragged:  # the weighted sum's operand is partial over tp
        own.append(E("the routing weights' gradient (the outputs they weigh are partial "
                     "over tp)", "all-reduce", "backward", tokens(cfg) * m.moe_top_k, 1,
                     p.tp, (TP_AXIS,)))
    # the block's output is kept, the experts' not; nor under minimal or dots at ep 1
    # the slots (named for remat only where they travel, `jaxtp.parallel.ep.placed`;
    # measured, jax 0.10.2: dp 2 x tp 4, and ep 2 x tp 2 and ragged holding the ledger)
    again = m.remat == "full" or (m.remat in ("minimal", "dots") and not ragged
                                  and (p.ep == 1 or resent(cfg)))
    if own and again and not sp:
        own.append(T(f"remat {m.remat!r}: g again for the backward", "all-reduce", "backward",
                     tp_n, 1, p.tp, (TP_AXIS,)))
    own += _statistics_rows(cfg, E)
    # each stage's sum over its layers and microbatches, added up once (1F1B
    # adds them to the loss in its schedule: in the loss's sum, `grads`)
    if p.pp > 1 and not runs_head(cfg):
        own.append(E("pp: the stages' router statistics summed", "all-reduce", "forward",
                     len(LOSSES), 1, p.pp, (PP_AXIS,), "f32", per="step", scope=""))
    return own



def _statistics_rows(cfg: Config, E: Callable) -> list[Expected]:
    """The router statistics' means over the axes that split the tokens,
    per MoE layer and microbatch where not said (`_moe_rows`; `E` its row
    maker)."""
    m, p, own = cfg.model, cfg.parallel, []
    routed = on(cfg, DATA_AXIS, EP_AXIS, CP_AXIS, *(TP_AXIS,) * p.sequence_parallel)
    if routed and m.moe_balance not in ("aux", "global_aux"):  # (global_aux: aux's f and P,
        # its f weighed with the slices' before, which are sums already)
        return _sequence_rows(cfg, E, routed) + _bias_rows(cfg, E, routed)
    if routed:
        n = math.prod(p.degrees[a] for a in routed)
        # (in any scope: XLA combines these small sums, and the layers' sum
        # of the statistics runs outside the MoE scope)
        own += [E("router statistics: the z-loss's mean, the balance loss's f and P",
                  "all-reduce", "forward", 1 + 2 * m.n_experts, 1, n, routed, "f32",
                  written=False, scope=ANY_SCOPE)]
        # the balance loss's gradient reads f, summed again; not under global_aux
        # over slices, whose shares and P every policy keeps (`SHARES`)
        if m.remat != "none" and not schedule_of(cfg).shares:
            own.append(E("remat: the balance loss's f summed again for its gradient",
                         "all-reduce", "backward", m.n_experts, 1, n, routed, "f32",
                         written=False, scope=ANY_SCOPE))
        if reduces_once(cfg):
            # in slices reduced once dp is manual: the means' psums are
            # transposed in the backward, P's in each MoE layer and microbatch,
            # the z-loss's (the same value in every layer) once a microbatch,
            # with a remat in each layer (measured, jax 0.10.2: moe-tiny at
            # dp 2 x tp 4, M 2 and 4, moe_every 1 and 2, remat none, minimal
            # and full; XLA:CPU hoists the z-loss's out of the slices' loop:
            # `backends`)
            remat = m.remat != "none"
            own += [E("dp manual in the slices: the statistics' means transposed",
                      "all-reduce", "backward", m.n_experts + remat, 1, n, routed, "f32",
                      written=False, scope=ANY_SCOPE)] + [
                E("dp manual in the slices: the z-loss's mean transposed", "all-reduce",
                  "backward", 1, 1, n, routed, "f32", written=False, scope=ANY_SCOPE,
                  per="microbatch", role="moe_z_transposed")] * (not remat)
    return own




def _sequence_rows(cfg: Config, E: Callable, routed: tuple) -> list[Expected]:
    """The statistics under the sequence-wise balance loss ("seq_aux"), per
    MoE layer and microbatch: each sequence's f and P summed over the ranks
    that hold its parts (cp, and tp under SP: [B/(dp*ep), E] each), then the
    z-loss's mean over every axis that splits the tokens and the loss's mean
    over the sequences' (the batch axes). Nothing again under remat: f is
    each rank's own (measured, jax 0.10.2, a 2-layer MoE at dp 2 x ep 2 x tp
    2 both impls, remat minimal, FSDP, cp 2, SP at tp 4, pp 2, and M 2 and 4
    once over dp at dp 2 x tp 4)."""
    p, within = cfg.parallel, tuple(a for a in routed if a in (CP_AXIS, TP_AXIS))
    size = lambda axes: math.prod(p.degrees[a] for a in axes)
    batch = tuple(a for a in routed if a not in within)
    seq = cfg.model.moe_balance.endswith("seq_aux")  # (else "bias" alone: the z-loss's)
    own = [E("router statistics: the z-loss's mean", "all-reduce", "forward", 1, 1,
             size(routed), routed, "f32", written=False, scope=ANY_SCOPE)]
    if seq and batch:
        own.append(E("seq_aux: the balance loss's mean over the sequences", "all-reduce",
                     "forward", 1, 1, size(batch), batch, "f32", written=False,
                     scope=ANY_SCOPE))
    if within and seq:
        rows = cfg.train.batch_size // cfg.train.microbatches // (p.dp * p.ep)
        own += [E(f"seq_aux: each sequence's {x} summed over its parts", "all-reduce",
                  "forward", rows * cfg.model.n_experts, 1, size(within), within, "f32",
                  written=False, scope=ANY_SCOPE) for x in ("f", "P")]
    if reduces_once(cfg):  # (dp manual in the slices: the two means' psums transposed,
        # as aux's z-loss's: the same value in every layer, so once a microbatch but
        # under a remat, in each layer; measured as `_statistics_rows` says; the balance
        # loss's and the bias's carrier's, of one cotangent, are one transpose)
        remat = cfg.model.remat != "none"
        own += [E(f"dp manual in the slices: the {x}'s mean transposed", "all-reduce",
                  "backward", 1, 1, size(routed), routed, "f32", written=False,
                  scope=ANY_SCOPE, **({} if remat else {"per": "microbatch",
                                                         "role": "moe_z_transposed"}))
                for x in ("z-loss", "balance loss")]
    return own


def _bias_rows(cfg: Config, E: Callable, routed: tuple) -> list[Expected]:
    """The loss-free balance's counts (`jaxtp.model.routing.counted`), per MoE
    layer and microbatch: summed over the axes that split the tokens in the
    forward (GSPMD sums them where the bias's gradient reads them, so the
    bias's gradient is summed nowhere without a remat: `jaxtp.analysis.grads`),
    or where they are each rank's own (`counts_local`) a scalar."""
    if not cfg.model.moe_balance.startswith("bias"):
        return []
    n = math.prod(cfg.parallel.degrees[a] for a in routed)
    if counts_local(cfg):  # (the counts' 0 averaged, `moe.moe`; its gradient local)
        return [E("bias: the counts' carrier (0) averaged over the tokens", "all-reduce",
                  "forward", 1, 1, n, routed, "f32", written=False, scope=ANY_SCOPE)]
    return [E("bias: each expert's count of assignments (the bias's step) over the tokens",
              "all-reduce", "forward", cfg.model.n_experts, 1, n, routed, "f32",
              written=False, scope=ANY_SCOPE)]


def _sp_rows(cfg: Config, impl: str, E: Callable, n: int) -> list[Expected]:
    """tp inside the experts under SP, per MoE layer and microbatch: a rank
    routes s/tp of each sequence, so the slots that arrive over ep (`n`
    elements, `slots`) are its tp rank's part: gathered over tp for the
    column-parallel up-projection and the row-parallel output reduce-
    scattered back (Megatron-SP's entry and exit, Korthikanti et al. 2022,
    Sec. 4.2.2, on the slots; Megatron-Core's expert-tp all-gather); the
    backward their mirrors. shard_map writes them so; GSPMD (XLA:CPU, jax
    0.10.2) sums the output by an all-reduce of the gathered slots and keeps
    its part (tp times the reduce-scatter's result, in both passes). Under
    remat "full" the backward runs the entry and the exit again."""
    p = cfg.parallel
    whole = p.tp * n
    kind, size = ("reduce-scatter", n) if impl == "shard_map" else ("all-reduce", whole)
    how = "reduce-scattered" if impl == "shard_map" else "all-reduced, its part kept (GSPMD)"
    T = (TP_AXIS,)
    again = [E("remat 'full': the entry's gather again for the backward", "all-gather",
               "backward", whole, 1, p.tp, T),
             E("remat 'full': the exit again for the backward", kind, "backward", size, 1,
               p.tp, T)] if cfg.model.remat == "full" else []
    return again + [
        E("SP entry: the slots that arrived gathered over tp", "all-gather", "forward",
          whole, 1, p.tp, T),
        E(f"SP exit: the experts' output {how}", kind, "forward", size, 1, p.tp, T),
        E("SP exit, backward: the output's gradient gathered", "all-gather", "backward",
          whole, 1, p.tp, T),
        E(f"SP entry, backward: the slots' gradient {how}", kind, "backward", size, 1,
          p.tp, T)]
