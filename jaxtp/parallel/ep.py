"""Expert parallelism: a MoE layer's slots to their experts' ranks and back.

ep's ranks split the batch as dp's do, and each holds E/ep of the experts.
A rank's dispatch fills every expert's slots for its own groups,
[E, G_r, C, D]; the experts need theirs from every rank. One all-to-all over
ep (GShard, Lepikhin et al. 2020, Sec. 3.2) splits the expert dim into ep
chunks, sends chunk j to rank j and stacks what arrives along the groups:
[E/ep, ep*G_r, C, D], the rank's experts over every ep rank's groups, in ep
rank order. The experts run there, and the reverse all-to-all returns each
group's outputs to the rank that routed it. Each keeps 1/ep of its buffer
and sends (ep-1)/ep. Backward: the transpose of an all-to-all is the
all-to-all reversed, so 2 more per layer (`jaxtp.analysis.ep`).

Inside the region the experts' weights are split over ep and replicated over
dp: their gradient is summed over dp alone (check_vma's transpose of the
implicit broadcast), as an ep rank owns its experts.

`Slots` names the slots' logical axes at each step (under cp and SP a rank
routes its own part of each sequence); `over_tokens` takes the router
statistics' means over the ranks that split the tokens, where a pipeline's
stage runs manual over them.

Run per shard, inside a shard_map manual over ep (the shard_map impl's
expert region); under gspmd the same reshard is a sharding constraint and
GSPMD places the all-to-alls (`jaxtp.model.moe`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .collectives import vary, varying_axes
from .layout import AXES, CP_AXIS, DATA_AXIS, EP_AXIS, TP_AXIS, constrain, manual_axes

# what a CPU run of the ragged path at ep > 1 is told (train.py refuses it)
RAGGED_CPU = ("model.moe_dispatch='ragged' at ep > 1 needs a GPU or TPU: XLA:CPU does not "
              "compile ragged-all-to-all (jax-ml/jax#34755); on CPU use "
              "model.moe_dispatch=dense (with model.capacity_factor=0 it is dropless too), or "
              "compile for a GPU: --compare-hlo --hardware h100")

# remat name of the slots an all-to-all delivered (to the experts, and back):
# every policy but "full" keeps them, so the backward sends nothing again
SLOTS_NAME = "ep_slots"


@dataclasses.dataclass(frozen=True)
class Slots:
    """The logical axes of the slots [E, G, C, D]: as the dispatch makes them
    (`tokens`: the groups split as the tokens are, over dp x ep x cp and
    under SP tp; every expert on every rank), as the experts take them
    (`experts`: E over ep, the groups over dp x cp: under SP gathered over
    tp, whose ranks split each expert's F) and as the experts' row-parallel
    output leaves them (`out`: under SP reduce-scattered over tp along the
    groups, Megatron-SP's exit, Korthikanti et al. 2022; else `experts`)."""

    sp: bool = False

    @property
    def groups(self) -> str:
        return "sp_groups" if self.sp else "groups"

    @property
    def tokens(self) -> tuple:
        return (None, self.groups, None, "embed")

    @property
    def experts(self) -> tuple:
        return ("expert", "expert_batch", None, "embed")

    @property
    def out(self) -> tuple:
        return ("expert", "sp_expert_batch" if self.sp else "expert_batch", None, "embed")


def over_tokens(x, sp: bool = False, reduce=lax.pmean):
    """A rank's mean over its tokens -> the mean over every rank's (`reduce`
    lax.psum: a sum -> the sum), where the code runs manual over axes that
    split the tokens (a pipeline's stage: dp, cp, and under impl shard_map
    ep, and tp under SP); elsewhere x."""
    axes = {DATA_AXIS, EP_AXIS, CP_AXIS} | ({TP_AXIS} if sp else set())
    manual = tuple(a for a in AXES if a in axes and a in manual_axes())
    return reduce(x, manual) if manual else x


def placed(x_EGCD, to_experts: bool, slots: Slots, sent: bool = True):
    """On global arrays: the slots as the dispatch makes them (`Slots.tokens`)
    -> as the experts take them (`Slots.experts`), or from the experts'
    output (`Slots.out`) back: the same array resharded, an all-to-all over
    ep each way (GShard's, placed by GSPMD). Named for remat (`SLOTS_NAME`)
    only where `sent` (ep > 1): at ep 1 nothing travels, and keeping the
    slots would be memory bought for nothing."""
    x_EGCD = constrain(x_EGCD, *(slots.tokens if to_experts else slots.out))
    if slots.sp and to_experts:  # one axis at a time (GSPMD gathers everything to
        # move both at once): ep's all-to-all, then tp's gather of what arrived
        x_EGCD = constrain(x_EGCD, *slots.out)
    x_EGCD = constrain(x_EGCD, *(slots.experts if to_experts else slots.tokens))
    return checkpoint_name(x_EGCD, SLOTS_NAME) if sent else x_EGCD


def kept(x_EGCD, to_experts: bool, slots: Slots):
    """Under shard_map: the slots stay split as the tokens are; the expert
    region moves them itself (`over_ep`)."""
    return constrain(x_EGCD, *slots.tokens)


def over_ep(experts: Callable, x_EGCD):
    """`experts` (slots [E/ep, ep*G_r, C, D] -> outputs) run on this rank's
    experts over every ep rank's groups; in and out: every expert's slots of
    this rank's groups [E, G_r, C, D]. Without an ep axis: `experts(x)`."""
    if EP_AXIS not in manual_axes() or lax.axis_size(EP_AXIS) == 1:
        return experts(x_EGCD)  # nothing travels: nothing to keep
    # the axis as a tuple: jax 0.10.2's roofline rule for all_to_all iterates
    # over the name it is given ("ep" read as the axes "e" and "p")
    x_EGCD = lax.all_to_all(x_EGCD, (EP_AXIS,), split_axis=0, concat_axis=1, tiled=True)
    y_EGCD = experts(checkpoint_name(x_EGCD, SLOTS_NAME))
    y_EGCD = lax.all_to_all(y_EGCD, (EP_AXIS,), split_axis=1, concat_axis=0, tiled=True)
    return checkpoint_name(y_EGCD, SLOTS_NAME)


def ragged(experts: Callable, x_ND, experts_Nk, weights_Nk, n_experts: int):
    """A dropless MoE layer's output [N, D] for this rank's N tokens
    (MaxText's and Megablocks' form: no capacity, no padding per expert).

    The N*k assignments are sorted by expert and the token rows gathered in
    that order; `experts(x_AD, group_sizes)` runs the rank's experts on rows
    grouped by expert (`jax.lax.ragged_dot`). Over ep each rank's rows for
    rank j's experts go to j by `jax.lax.ragged_all_to_all` into a buffer
    sized for the worst case (every ep rank's tokens picking this rank's
    experts: ep*N*min(k, E/ep) rows), are regrouped by expert there, and
    return by the reverse exchange; the outputs are weighted and summed per
    token. XLA:CPU does not compile ragged-all-to-all (jax-ml/jax#34755):
    at ep > 1 this runs on GPUs and TPUs only."""
    N, k = experts_Nk.shape
    e_A = experts_Nk.reshape(-1)  # assignment a = n*k + j
    order = jnp.argsort(e_A, stable=True)
    x_AD = x_ND[order // k]
    counts_E = jnp.bincount(e_A, length=n_experts).astype(jnp.int32)
    if EP_AXIS in manual_axes():
        y_AD = _exchange(experts, x_AD, counts_E, n_experts, k)
    else:
        y_AD = experts(x_AD, counts_E)
    y_NkD = y_AD[jnp.argsort(order)].reshape(N, k, -1)  # back in assignment order
    return jnp.einsum("NkD,Nk->ND", y_NkD, weights_Nk.astype(y_NkD.dtype))


def _exchange(experts: Callable, x_AD, counts_E, n_experts: int, k: int):
    """`experts` on the rows every ep rank sends this rank's experts; `x_AD`
    sorted by expert, `counts_E` its rows per expert (see `ragged`)."""
    n = lax.axis_size(EP_AXIS)
    El, A = n_experts // n, x_AD.shape[0]
    counts_jl = counts_E.reshape(n, El)  # to rank j's l-th expert
    send_j = counts_jl.sum(1)
    in_off_j = jnp.cumsum(send_j) - send_j
    # from each source s: its rows for this rank's experts (by expert), and
    # where this rank's slice starts in every receiver's buffer (the sources
    # before it, in rank order)
    recv_sl = lax.all_to_all(counts_jl, (EP_AXIS,), 0, 0, tiled=True)
    recv_s = recv_sl.sum(1)
    sent_sj = lax.all_gather(send_j, (EP_AXIS,))
    out_off_j = (jnp.cumsum(sent_sj, 0) - sent_sj)[lax.axis_index(EP_AXIS)]
    rows = n * (A // k) * min(k, El)  # the worst case
    # the result takes its output buffer's type (jax 0.10.2): a buffer
    # invariant over ep would type every rank's rows as one value, and the
    # backward would sum their cotangents over ep
    buf_RD = vary(jnp.zeros((rows, x_AD.shape[1]), x_AD.dtype), varying_axes(x_AD))
    got_RD = lax.ragged_all_to_all(x_AD, buf_RD, in_off_j, send_j, out_off_j, recv_s,
                                   axis_name=(EP_AXIS,))
    # received by source, each source's rows by expert: regroup by expert,
    # the unused tail last (expert El)
    seg = jnp.concatenate([recv_sl.reshape(-1), (rows - recv_s.sum())[None]])
    ids = jnp.concatenate([jnp.arange(n * El, dtype=jnp.int32) % El, jnp.int32(El)[None]])
    by_expert = jnp.argsort(jnp.repeat(ids, seg, total_repeat_length=rows), stable=True)
    y_RD = experts(got_RD[by_expert], recv_sl.sum(0))[jnp.argsort(by_expert)]
    # home again: each source's slice back where it came from
    recv_off_s = jnp.cumsum(recv_s) - recv_s
    home_off_s = lax.all_to_all(in_off_j, (EP_AXIS,), 0, 0, tiled=True)
    home_AD = vary(jnp.zeros(x_AD.shape, y_RD.dtype), varying_axes(y_RD))
    return lax.ragged_all_to_all(y_RD, home_AD, recv_off_s, recv_s, home_off_s, send_j,
                                 axis_name=(EP_AXIS,))
