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

Run per shard, inside a shard_map manual over ep (the shard_map impl's
expert region); under gspmd the same reshard is a sharding constraint and
GSPMD places the all-to-alls (`jaxtp.model.moe`).
"""

from __future__ import annotations

from typing import Callable

from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .layout import EP_AXIS, manual_axes

# remat name of the slots an all-to-all delivered (to the experts, and back):
# every policy but "full" keeps them, so the backward sends nothing again
SLOTS_NAME = "ep_slots"


def over_ep(experts: Callable, x_EGCD):
    """`experts` (slots [E/ep, ep*G_r, C, D] -> outputs) run on this rank's
    experts over every ep rank's groups; in and out: every expert's slots of
    this rank's groups [E, G_r, C, D]. Without an ep axis: `experts(x)`."""
    if EP_AXIS not in manual_axes():
        return experts(x_EGCD)
    # the axis as a tuple: jax 0.10.2's roofline rule for all_to_all iterates
    # over the name it is given ("ep" read as the axes "e" and "p")
    x_EGCD = lax.all_to_all(x_EGCD, (EP_AXIS,), split_axis=0, concat_axis=1, tiled=True)
    y_EGCD = experts(checkpoint_name(x_EGCD, SLOTS_NAME))
    y_EGCD = lax.all_to_all(y_EGCD, (EP_AXIS,), split_axis=1, concat_axis=0, tiled=True)
    return checkpoint_name(y_EGCD, SLOTS_NAME)
