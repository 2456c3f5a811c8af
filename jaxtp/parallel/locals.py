"""The `Local`: how a region's local math reaches the other tp ranks, one
class per impl (`LOCALS`), and the five entries the model calls.

The model's regions are local math over a `Local`: `module.region(x, local)`
takes the replicated (under SP: sequence-split) input to the output summed
over tp, entering through `local.enter(x, mm)` (f, and the column-parallel
matmul `mm`) and leaving through `local.exit(h, mm)` (the row-parallel
matmul `mm`, and g); `module.rows(ids, local)` looks up token rows,
`module.losses(x, targets, local)` computes the vocab-parallel
cross-entropy, `module.cached_region` and `module.sample` decode. A `Local`
also says how a module runs with it (`run_region`, ...): inside
`jax.shard_map` over the module's own parameters, or on global arrays with
layouts pinned. A new way to communicate is one class and one `LOCALS`
entry, not edits in the model.
"""

from __future__ import annotations

from typing import Callable, Protocol

from jax.ad_checkpoint import checkpoint_name

from .global_arrays import GSPMD, Explicit
from .layout import Layout
from .shardmap import ShardMap


class Local(Protocol):
    """What a region's math may ask of its impl (B batch, T sequence, D model,
    V vocab shard, K kv heads, C k/v, H head dim)."""

    layout: Layout

    def enter(self, x_BTD, mm: Callable | None = None, out: tuple | None = None):
        """Megatron's f, then the column-parallel `mm` (`project`): identity
        forward, the input gradient all-reduced over tp (SP: x all-gathered
        along T). `out`: the logical axes of mm's output dims after B and T
        (None: mm's output is not one array split over tp)."""

    def project(self, x_BTD, mm: Callable, out: tuple | None = None):
        """The column-parallel `mm(x, out_sharding=None)` of an input already
        entered. Under SP's overlap on global arrays, x is still split along
        T and the output named split over tp (`out`): the form XLA's
        windowed einsum decomposes into a loop of permutes."""

    def exit(self, h, mm: Callable):
        """The row-parallel `mm(h)`, then g: its partial sums all-reduced over
        tp (SP: reduce-scattered along T)."""

    def constrain(self, x, *logical):
        """Pin x's layout to these logical axes (global arrays; per shard: x)."""

    def attend(self, core: Callable, q, k, v):
        """The attention core (`jaxtp.model.kernels.Core`) on each rank's
        heads: no collective over tp; under cp, the rank's queries over every
        cp rank's keys and values (`jaxtp.parallel.context`)."""

    def positions(self, T: int):
        """The original positions of the T tokens of a [B, T, ...] array as
        this Local sees it (global, or a cp rank's)."""

    def kv_for_heads(self, kv_BTCKH, n_heads: int):
        """Replicated kv heads (K < tp) for this rank's query heads; the
        backward pass sums the kv gradient over tp (one all-reduce)."""

    def kv_per_rank(self, kv_BTCKH):
        """The kv head a rank's query heads use, for its KV cache: no collective."""

    def vocab_rows(self, table_VD, ids_BT, dtype):
        """table[ids] from a table split over tp along V: each shard's rows,
        summed over tp by the caller's exit (an all-reduce, SP: reduce-scatter)."""

    def row_start(self, B: int):
        """The global index of this array's first row (dp-split arrays)."""

    def vocab_argmax(self, scores_BV):
        """The lowest id of the highest score [B] over the vocab shards: a max
        and a min of B values over tp (global: [B, tp] values gathered)."""

    def vocab_top(self, scores_BV, c: int):
        """Each shard's `c` best (scores, ids), side by side [B, tp*c]: an
        all-gather of B x c values."""

    def vocab_start(self, rows: int):
        """The first vocabulary id of this rank's shard (global arrays: 0)."""

    def seq_parts(self) -> int:
        """How many cp parts the T of an array as this Local sees it holds
        (global arrays: cp; a rank's own: 1): the chunked loss chunks within each."""

    def batch_per_dp_rank(self, B: int) -> int:
        """Rows of one dp rank in an array of B rows as this Local sees it."""

    def vocab_max(self, v):
        """The max over the vocab shards: a pmax over tp (global: v)."""

    def vocab_sum(self, v):
        """The sum over the vocab shards: an all-reduce over tp (global: v)."""

    def run_region(self, module, x_BTD):
        """`module.region(x, local)`, its output summed over tp (SP: split along T)."""

    def run_embed(self, module, ids_BT):
        """`module.rows(ids, local)`, summed over tp: the residual stream."""

    def run_losses(self, module, x_BTD, targets_BT):
        """`module.losses(enter(x), targets, local)`: per-token cross-entropy
        [B, T], its statistics reduced over tp (three all-reduces of B x T)."""

    def run_cached(self, module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
        """`module.cached_region`: (output summed over tp, the KV caches split
        over tp by kv head)."""

    def run_sample(self, module, x_BD, key, **sampling):
        """`module.sample`: the next token [B], no rank holding all logits."""

    def place_slots(self, module, x_EGCD, to_experts: bool):
        """A MoE layer's slots [E, G, C, D] laid out for its experts
        (`to_experts`) or back for the combine (`jaxtp.parallel.ep`)."""

    def run_experts(self, module, x_EGCD):
        """`module.local` on every expert's slots: its outputs, summed over tp
        (under SP reduce-scattered over it), sent over ep and back."""

    def run_ragged(self, module, local: Callable, *args, arg_specs, out_specs):
        """`local(module, *args)` per shard (the ragged dispatch)."""


# the impl names of jaxtp.config.IMPLS, each with its Local
LOCALS: dict[str, type] = {"gspmd": GSPMD, "shard_map": ShardMap, "explicit": Explicit}


def local_of(layout: Layout) -> Local:
    """The `Local` of a layout's impl."""
    return LOCALS[layout.impl](layout)


def region(module, x_BTD):
    """`module.region` from replicated x (SP: split along T) to its output
    summed over tp: the row-parallel bias is added by the caller. The sum
    carries the remat name `module.tag`: every remat policy keeps it
    (jaxtp.model.block.REMAT_POLICIES), so recomputing a block in the
    backward pass never repeats g's collective."""
    return checkpoint_name(local_of(module.layout).run_region(module, x_BTD), module.tag)


def embed(module, ids_BT):
    """`module.rows(ids, local)`: token rows, replicated over tp (SP: split along T)."""
    return local_of(module.layout).run_embed(module, ids_BT)


def vocab_losses(module, x_BTD, targets_BT):
    """`module.losses(x, targets, local)`: per-token cross-entropy [B, T] from
    vocab-sharded logits. The input enters as a region's does (f once, on the
    whole input, so dX is reduced once)."""
    return local_of(module.layout).run_losses(module, x_BTD, targets_BT)


def cached_region(module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
    """`module.cached_region`: a region that reads and extends a KV cache
    (inference: no SP, no backward pass)."""
    return local_of(module.layout).run_cached(module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill)


def vocab_sample(module, x_BD, key, *, temperature: float, top_k: int, top_p: float):
    """`module.sample(x, key, ..., local)`: the next token [B] of each row."""
    return local_of(module.layout).run_sample(module, x_BD, key, temperature=temperature,
                                              top_k=top_k, top_p=top_p)


def place_slots(module, x_EGCD, to_experts: bool):
    """A MoE layer's slots laid out for its experts or back (the impl's way)."""
    return local_of(module.layout).place_slots(module, x_EGCD, to_experts)


def experts(module, x_EGCD):
    """A MoE layer's experts on their slots [E, G, C, D] (`Local.run_experts`)."""
    return local_of(module.layout).run_experts(module, x_EGCD)


def ragged_experts(module, local: Callable, *args, arg_specs, out_specs):
    """The ragged dispatch's `local(module, *args)` per shard."""
    return local_of(module.layout).run_ragged(module, local, *args, arg_specs=arg_specs,
                                              out_specs=out_specs)


__all__ = ["LOCALS", "Local", "local_of", "region", "embed", "vocab_losses", "cached_region",
           "vocab_sample", "place_slots", "experts", "ragged_experts"]
