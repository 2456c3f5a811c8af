"""Who consumes a step's microbatches: the `Schedule`, decided once from the
config beside the `Layout` and carried with it (`TrainState.schedule`).

A step of B rows runs in M microbatches of B/M rows (`train.microbatches`):

- "whole": M = 1, one value-and-grad of the batch;
- "sequential": M slices in a scan, their gradients summed in fp32; each
  slice's gradient is reduced over dp where it is made (by GSPMD, or by
  FSDP's reduce-scatter: ZeRO-3's sharded accumulator, Rajbhandari et al.
  2020, Sec. 5.1), M times a step;
- "over_dp": the same scan inside a shard_map manual over dp: each rank sums
  its own partial gradients and the sum is reduced over dp once per step;
- "pipeline": one value-and-grad of the batch, whose forward pass runs the
  M microbatches through `stages` pipeline stages (`jaxtp.parallel.pipeline`)
  and whose backward pass is its autodiff: each gradient is summed over the
  microbatches as it is made, and reduced over dp once per step.

The step asks `Schedule.loss_and_grads` for (loss, grads); the ledger
(`jaxtp.analysis.ledger`) multiplies each row by the Schedule's counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..checks import ONE_F_ONE_B, SPLIT
from .collectives import wide
from .pipeline_table import phases
from .layout import DATA_AXIS, PP_AXIS, Layout, constrain, explicit_mesh, keep_axes

MODES = ("whole", "sequential", "over_dp", "pipeline")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a step's batch is consumed: `microbatches` (M) slices run as `mode`
    (see the module docstring), over `stages` pipeline stages of
    `layers // stages` layers each (1: no pipeline)."""

    microbatches: int = 1
    mode: str = "whole"
    layers: int = 1
    stages: int = 1
    repeats: int = 1
    pipeline: str = "gpipe"  # the stages' order (jaxtp.config.PP_SCHEDULES)
    stash: str = "residuals"  # what 1F1B keeps for a backward (jaxtp.checks.PP_STASHES)
    # the blocks' parameters stacked on a leading layer axis and run by a
    # loop (`model.scan_layers`; always under a pipeline: the stages' layers)
    scan: bool = False
    # rows one rank holds of each microbatch (`Layout.rows`; 0: not given)
    rows: int = 0
    # the layers of the stack's unit (`model.layer_group`): a stacked
    # parameter's leading axis runs over the units, (L - lead)/period of them
    period: int = 1
    lead: int = 0  # the layers before the stack (`model.moe_first_dense`)
    # (MoE layers, experts) of the assignment shares carried from slice to
    # slice ("global_aux" at M > 1: Megatron-Core's running global_aux_loss); ()
    shares: tuple = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"schedule mode {self.mode!r}: one of {MODES}")
        if self.mode == "pipeline" and self.stages == 1:
            raise ValueError("a pipeline schedule has more than one stage")
        if self.mode == "whole" and self.microbatches != 1:
            raise ValueError(f"a whole-batch schedule has 1 microbatch, not {self.microbatches}")

    @classmethod
    def of(cls, cfg, layout: Layout) -> "Schedule":
        """The schedule of a config (its attention kernel resolved for the
        device: `jaxtp.model.resolve_attention`) on `layout`."""
        M, p = cfg.train.microbatches, cfg.parallel
        # a microbatch runs whole through the stages: its rows split over the
        # batch axes but pp, which splits the layers there
        rows = layout.rows(cfg.train.batch_size // M, frozenset({PP_AXIS}))
        if layout.pp > 1:
            return cls(microbatches=M, mode="pipeline", layers=cfg.model.n_layers,
                       stages=layout.pp, repeats=p.pp_repeats, pipeline=p.pp_schedule,
                       stash=p.pp_stash,
                       scan=True, rows=rows, period=cfg.model.layer_group,
                       lead=cfg.model.n_layers - cfg.model.stacked_layers)
        m = cfg.model
        return cls(microbatches=M, layers=m.n_layers, scan=m.scan_layers,
                   mode=_mode(layout, M, m.attention, cfg.train.reduce_once
                              and m.moe_balance != "global_aux"),
                   rows=rows, period=m.layer_group, lead=m.n_layers - m.stacked_layers,
                   shares=(m.n_moe_layers, m.n_experts)
                   if m.moe_balance == "global_aux" and M > 1 else ())

    @property
    def reduces_once(self) -> bool:
        """Whether the gradients are reduced over dp once per step (not once
        per microbatch)."""
        return self.mode == "over_dp"

    @property
    def ticks(self) -> int:
        """Loop trips of one step that run a stage's forward (and as many
        its backward): v*M + p - 1 (a pipeline's fill and drain: Huang et
        al. 2019, GPipe; 1F1B's too, over `span` ticks); M without a
        pipeline."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def weight_ticks(self) -> int:
        """Loop trips that run a stage's weight gradients: `ticks`, but v*M
        where the backward is split (`split`): zb's W runs on real data only."""
        return self.repeats * self.microbatches if self.split else self.ticks

    @property
    def forward_shifts(self) -> int:
        """The forward shift's trips the compiled program keeps: `ticks`, but
        one fewer where the last loop that runs forwards has one trip (zb at
        M = p): XLA inlines a loop of one trip and drops what nothing reads,
        there the last forward's output, sent on to no tick."""
        if not self.runs_head:
            return self.ticks
        b, e = [(b, e) for b, e, f, *_ in phases(self.stages, self.microbatches, self.repeats,
                                                  self.split) if f][-1]
        return self.ticks - (e - b == 1)

    @property
    def span(self) -> int:
        """The schedule's ticks from the first forward to the last backward:
        1F1B's forwards and backwards share ticks, v*M + (v+1)p - 2 in all
        (M + 2p - 2 at v = 1: `jaxtp.parallel.pipeline_1f1b.table`); GPipe's
        and circular's run 2(v*M + p - 1)."""
        if self.runs_head:
            return phases(self.stages, self.microbatches, self.repeats)[-1][1]
        return 2 * self.ticks

    @property
    def recomputes(self) -> bool:
        """Whether a stage's backward runs its forward again (1F1B keeping
        its inputs alone): the forward's collectives twice a tick."""
        return self.runs_head and self.stash == "inputs"

    @property
    def head_trips(self) -> int:
        """The loop trips that run the head and the loss: M, but where the
        pipeline runs the head in its loop, the ticks of its steady loop
        (v(M - p) + p: M at v = 1), each computing it on every stage."""
        if self.runs_head:
            return sum(end - begin for begin, end, f, b, _ in
                       phases(self.stages, self.microbatches, self.repeats, self.split) if f and b)
        return self.microbatches

    @property
    def head_rows(self) -> int:
        """The rows one rank's LM head and loss take at once: a microbatch's,
        but under a pipeline that runs them outside its stages the step's
        own rows of each stage (`jaxtp.parallel.pipeline`: pp splits them
        there as dp does)."""
        if self.stages > 1 and not self.runs_head:
            return self.rows * self.microbatches // self.stages
        return self.rows

    @property
    def stacked(self) -> bool:
        """Whether the blocks' parameters are stacked on a leading layer axis."""
        return self.scan or self.stages > 1

    @property
    def split(self) -> bool:
        """Whether a stage's backward runs in two, its input's gradient and,
        later, its weights' (the zero-bubble schedule, `jaxtp.checks.SPLIT`)."""
        return self.pipeline in SPLIT and self.stages > 1

    @property
    def runs_head(self) -> bool:
        """Whether the stack runs the head and the loss inside it (1F1B: a
        microbatch's backward starts on the last stage as soon as its
        forward ends; interleaved 1F1B too), so that the model asks
        `jaxtp.parallel.stack_loss`."""
        return self.pipeline in ONE_F_ONE_B and self.stages > 1

    @property
    def stack_axis(self) -> str | None:
        """The mesh axis a stacked layer dim is split over: pp (each stage
        holds its layers), or None (every rank holds every layer)."""
        return PP_AXIS if self.stages > 1 else None

    def layer_order(self, L: int | None = None) -> tuple[int, ...]:
        """The unit (a layer, or a group of `period`) each position of a
        stacked [L, ...] parameter holds (L: the units, `(layers - lead) / period`).
        Position j lies on stage j // (L/p); under the
        circular schedule (v = `repeats` chunks of L/(p*v) layers per stage)
        stage r's i-th chunk is the pipeline's chunk i*p + r (Narayanan et
        al. 2021, Sec. 2.2.2), so the stack is stored in that order: on each
        stage its chunks in the order it runs them. The identity otherwise.

        >>> Schedule(2, "pipeline", stages=2, repeats=2, pipeline="circular").layer_order(8)
        (0, 1, 4, 5, 2, 3, 6, 7)
        """
        L = (self.layers - self.lead) // self.period if L is None else L
        p, v = self.stages, self.repeats
        c = L // (p * v)  # layers per chunk
        return tuple((i * p + j // (v * c)) * c + k
                     for j in range(L) for i, k in [divmod(j % (v * c), c)])

    @property
    def layers_per_rank(self) -> int:
        """The layers a pipeline stage holds: L/p of the stack (the leading
        dense run, `lead`, runs before the stages); L without a pipeline."""
        return self._piped // self.stages

    @property
    def layers_per_tick(self) -> int:
        """The layers a stage runs in one tick: a chunk, L/(p*v) of the stack."""
        return self._piped // (self.stages * self.repeats)

    @property
    def _piped(self) -> int:
        """The layers a pipeline splits: the stack's (all without one)."""
        return self.layers - self.lead if self.stages > 1 else self.layers

    def loss_and_grads(self, value_and_grad, params, specs, tokens, key):
        """(mean loss, gradients) of a placed batch by `value_and_grad(params,
        tokens, key)`, as this schedule runs it (the same result as one batch:
        the loss is a mean over equal-sized slices). With `shares`,
        `value_and_grad(params, tokens, key, shares) -> ((loss, own shares),
        grads)`, the shares summed over the slices so far."""
        if self.mode in ("whole", "pipeline"):  # (the model runs the pipeline)
            return value_and_grad(params, tokens, key)
        if self.mode == "over_dp":
            return _over_dp_once(value_and_grad, params, specs, tokens, key, self.microbatches,
                                 self.shares)
        return _accumulate(value_and_grad, params, tokens, key, self.microbatches, self.shares)


def _mode(layout: Layout, M: int, attention: str, reduce_once: bool = True) -> str:
    """"over_dp" where asked (`train.reduce_once`; not under a MoE's
    "global_aux", whose running shares through the manual slices leave
    XLA:CPU more of the statistics' transposed sums than aux's, in a
    count the ledger does not model), the parameters are
    replicated over dp (no FSDP) and nothing else splits the tokens (no cp:
    its sum over cp would be per slice; no ep: the MoE layers' resharding
    over ep needs the groups' split over dp x ep, which a shard_map manual
    over dp alone breaks); not with cuDNN attention under gspmd or explicit
    (jax 0.10.2: its custom partitioning fails inside a shard_map that
    leaves an axis to GSPMD; shard_map's own regions are manual over every
    axis)."""
    if M == 1:
        return "whole"
    if (reduce_once and layout.dp > 1 and not layout.fsdp and layout.cp == 1
            and layout.ep == 1
            and (attention != "cudnn" or layout.impl == "shard_map")):
        return "over_dp"
    return "sequential"


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _accumulate(value_and_grad, params, tokens_BT1, key, microbatches: int,
                shares: tuple = ()):
    """The slices' (mean loss, mean gradient), summed in fp32 (`wide`) by a scan.

    Slice m holds rows m, M+m, 2M+m, ...: reshaping [B] -> [B/M, M] keeps
    each dp rank's rows on that rank (the dp split is on the leading B/M), so
    slicing needs no communication. The dropout key is folded per slice.
    `shares` (a shape): the running assignment shares, fp32 zeros at slice
    0, each slice's own added (`Schedule.shares`)."""
    B, *rest = tokens_BT1.shape
    tail = (None, "seq") if len(rest) == 2 else (None,)  # under cp [B, 2, T]: T over cp
    tokens_MBT = constrain(tokens_BT1.reshape(B // microbatches, microbatches, *rest),
                           "batch", None, *tail)
    tokens_MBT = constrain(jnp.moveaxis(tokens_MBT, 1, 0), None, "batch", *tail)
    # zeros_like: typed like each parameter (its sharding, under impl explicit)
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, wide(p)), params)

    def body(carry, xs):
        loss_sum, grad_sum, *running = carry
        m, tokens = xs
        args = (params, tokens, None if key is None else jax.random.fold_in(key, m), *running)
        loss, grads = value_and_grad(*args)
        if running:  # ((loss, this slice's shares), grads)
            loss, own = loss
            running = [running[0] + own.astype(running[0].dtype)]
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads)
        return (loss_sum + loss, grad_sum, *running), None

    wide_ = wide(jnp.result_type(*jax.tree.leaves(params)))
    (loss_sum, grad_sum, *_), _ = jax.lax.scan(
        body, (jnp.zeros((), wide_), zeros, *[jnp.zeros(shares, jnp.float32)] * bool(shares)),
        (jnp.arange(microbatches), tokens_MBT))
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grad_sum, params)
    return loss_sum / microbatches, grads


def _over_dp_once(value_and_grad, params, specs, tokens_BT1, key, microbatches: int,
                  shares: tuple = ()):
    """`_accumulate` on each dp rank's rows inside a shard_map manual over dp:
    the parameters are replicated over dp and dp is manual, so each slice's
    gradient is this rank's partial sum, and the mean over dp is taken once
    at the end: one all-reduce of every gradient per step. check_vma is off:
    the body has no dp collective to check. On an Explicit mesh the other
    axes are made Auto around the shard_map and Explicit again inside it
    (`auto_axes`, `explicit_axes`), so the model's types are as without
    slices (why: docs/scale.md, "Gradient accumulation")."""
    mesh = jax.sharding.get_abstract_mesh()
    others = tuple(a for a in mesh.axis_names if a != DATA_AXIS)
    drop = lambda s: keep_axes(s, others)
    whole = jax.tree.map(lambda s: P(), specs, is_leaf=_is_spec)  # over dp: replicated
    key_spec = None if key is None else P()

    def local(params, tokens_BT1, key):
        loss, grads = _accumulate(value_and_grad, params, tokens_BT1, key, microbatches, shares)
        return (jax.lax.pmean(loss, DATA_AXIS),
                jax.tree.map(lambda g: jax.lax.pmean(g, DATA_AXIS), grads))

    explicit = explicit_mesh()
    if explicit:
        local = jax.sharding.explicit_axes(
            local, axes=others, in_sharding=(jax.tree.map(drop, specs, is_leaf=_is_spec),
                                             P(), key_spec))
    step = jax.shard_map(local, in_specs=(whole, P(DATA_AXIS), key_spec),
                         out_specs=(P(), whole), axis_names={DATA_AXIS}, check_vma=False)
    if explicit:
        step = jax.sharding.auto_axes(step, axes=others, out_sharding=(P(), specs))
    return step(params, tokens_BT1, key)
