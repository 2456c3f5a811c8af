"""The analytic Megatron communication budget of a train step, as rows that
`jaxtp.analysis.rows.check` holds compiled HLO against (the side-by-side
report is `jaxtp.analysis.compare`).

Tensor parallelism per Shoeybi et al. 2019 ("Megatron-LM", Sec. 3, Fig. 4):
each Transformer block has two column -> row regions (attention, MLP), each
with one all-reduce forward (g) and one backward (f), so per block and
microbatch 2 + 2 all-reduces of the activation, b*s*h elements. Narayanan et
al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters",
Sec. 3.3) price each with a ring all-reduce: every rank sends and receives
2(t-1)/t of the payload ((t-1)/t for an all-gather or reduce-scatter).

Outside the blocks this model needs, per train step (`expected_collectives`):
- vocab-parallel embedding: the lookup's partial rows are summed over tp,
  one forward all-reduce of b*s*h;
- LM head: column-parallel over the vocabulary, so its input gradient is
  all-reduced backward (f), b*s*h;
- vocab-parallel cross-entropy: max, sum of exponentials and target logit,
  three forward all-reduces of b*s fp32 values;
- the global gradient norm: one scalar all-reduce of the partial sums of
  squares of the tp-sharded gradients;
- with fewer kv heads than tp (replicated kv projection): the kv gradient,
  b*s*2*K*H per block, is summed over the ranks that share each kv head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ..config import Config
from ..model.vocab import loss_chunks
from ..parallel import DATA_AXIS, EP_AXIS, PP_AXIS, TP_AXIS
from ..parallel import xla_overlap
from .backends import on_backend, widened
from .cp import expected_cp
from .pp import expected_pp
from .dp import expected_fsdp
from .ep import expected_moe
from .grads import expected_grads
from .overlap_rows import ring_regions, windowed_head, windowed_regions
from .rows import (HLO_DTYPES, Expected, batch_ranks, microbatch_rows, moe_per_tick, on, per_step,
                   runs_head, schedule_of)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Megatron's per-block TP communication for one train step, per tp rank."""

    tp: int
    layers: int
    batch: int  # microbatch size on one dp rank
    seq: int
    d_model: int
    dtype_bytes: int
    # the loop trips each rank runs its layers in: M, or under a pipeline its
    # ticks v*M + p - 1 (with `layers` a stage's L/p)
    microbatches: int = 1
    all_reduce_per_layer_fwd: int = 2
    all_reduce_per_layer_bwd: int = 2

    @property
    def ring_factor(self) -> float:
        """Bytes each rank sends per payload byte in a ring all-reduce: 2(t-1)/t."""
        return 2 * (self.tp - 1) / self.tp

    @property
    def elements_per_all_reduce(self) -> int:
        return self.batch * self.seq * self.d_model

    @property
    def bytes_per_all_reduce(self) -> int:
        return self.elements_per_all_reduce * self.dtype_bytes

    @property
    def ring_bytes_per_all_reduce(self) -> float:
        return self.ring_factor * self.bytes_per_all_reduce

    @property
    def ring_bytes_per_layer(self) -> float:
        """Per block and microbatch, forward + backward."""
        per_layer = self.all_reduce_per_layer_fwd + self.all_reduce_per_layer_bwd
        return per_layer * self.ring_bytes_per_all_reduce

    @property
    def ring_bytes_blocks_per_step(self) -> float:
        return self.layers * self.microbatches * self.ring_bytes_per_layer


def budget_for(cfg: Config) -> Budget:
    m, p = cfg.model, cfg.parallel
    M = cfg.train.microbatches
    schedule = schedule_of(cfg)
    return Budget(tp=p.tp, layers=schedule.layers_per_tick,
                  batch=cfg.train.batch_size // (batch_ranks(cfg) * M), seq=m.seq_len // p.cp,
                  d_model=m.d_model, dtype_bytes=np.dtype(m.dtype).itemsize,
                  microbatches=schedule.ticks)


def expected_collectives(cfg: Config, impl: str, platform: str = "",
                         forms: xla_overlap.Forms | None = None) -> list[Expected]:
    """Every collective the train step of `cfg` needs under `impl`, one
    ledger per axis: tp's activations (here), the gradients' sums over dp,
    cp and under SP tp (`jaxtp.analysis.grads`), FSDP's gathers
    (`jaxtp.analysis.dp`), cp's attention core (`jaxtp.analysis.cp`); each
    row's count multiplied out per step once (`rows.per_step`); as the
    compiler for `platform` ("cpu", "gpu", "tpu"; "" for none) carries it
    out (`backends.on_backend`). `forms`: which of XLA's windowed-einsum
    loops form under GSPMD's overlap (default: `xla_overlap.forms` for the
    platform, a GPU's compiled deviceless)."""
    forms = xla_overlap.forms(cfg, platform, deviceless=True) if forms is None else forms
    tp, cp = _expected_tp(cfg, impl, forms), expected_cp(cfg, impl)
    rows = per_step(_dense_mlp(cfg, tp) + lead_rows(cfg, tp + cp) + _norm(cfg)
                    + expected_grads(cfg, impl, platform) + expected_fsdp(cfg, impl)
                    + cp + expected_pp(cfg) + expected_moe(cfg, impl),
                    schedule_of(cfg))
    return widened(on_backend(rows, cfg, impl, platform) if platform else rows,
                   cfg.model.dtype)


def lead_rows(cfg, rows: list[Expected]) -> list[Expected]:
    """Under a pipeline, the leading dense run's (`model.moe_first_dense`)
    copies of a block's "layer" rows (`rows`: its attention's and dense
    MLP's): those layers run before the stages, as the embedding does, on
    each stage's own B/(pp*dp) rows once a step (a row's elements scale
    with its rows); none otherwise (the run counts among the layers)."""
    m, p = cfg.model, cfg.parallel
    lead = m.n_layers - m.stacked_layers
    if p.pp == 1 or not lead:
        return []
    b, out = microbatch_rows(cfg), cfg.train.batch_size // (p.pp * batch_ranks(cfg))
    return [dataclasses.replace(r, name=f"{r.name} (the leading dense layers)",
                                elements=r.elements * out // b, count=r.count * lead, per="step")
            for r in rows if r.per == "layer" and r.scope != "moe"]


def _norm(cfg: Config) -> list[Expected]:
    """The gradient norm, once per step: one sum of squares over every axis
    that splits a gradient (tp; pp's stages; dp under FSDP; ep's experts)."""
    p = cfg.parallel
    axes = on(cfg, PP_AXIS, *(DATA_AXIS,) * p.fsdp, *(EP_AXIS,) * bool(cfg.model.n_experts),
              TP_AXIS)
    if not axes or (p.tp == 1 and p.pp == 1 and not cfg.model.n_experts):
        return []
    return [Expected("gradient norm: one sum of squares", "all-reduce", "other", "", 1, "f32",
                     math.prod(p.degrees[a] for a in axes), 1, axes=axes)]


def _expected_tp(cfg: Config, impl: str, forms: xla_overlap.Forms) -> list[Expected]:
    m, p = cfg.model, cfg.parallel
    tp = p.tp
    # each cp rank's s/cp positions: the tp rows are Megatron's within each cp group
    b, s, dt = microbatch_rows(cfg), m.seq_len // p.cp, HLO_DTYPES[m.dtype]
    act = b * s * m.d_model
    # counted per microbatch (E) or per layer and microbatch (EL): `per_step`
    E = lambda name, kind, pass_, scope, n, count, dtype=dt, group=tp, role="", axes=(TP_AXIS,), \
        per="microbatch": Expected(name, kind, pass_, scope, n, dtype, group, count, role, axes,
                                   per=per)
    EL = functools.partial(E, per="layer")
    if tp == 1:
        return []
    # outside a pipeline (embedding, head, loss) each stage takes its own
    # B/(pp*dp) rows, once per step; 1F1B's head runs in the loop, on a
    # microbatch per tick (Eh, b_head)
    Eh, b_head = E, b
    if p.pp > 1:
        b_out = cfg.train.batch_size // (p.pp * batch_ranks(cfg))
        E = functools.partial(E, per="step")
        if not runs_head(cfg):
            Eh, b_head = E, b_out
    else:
        b_out = b
    if p.sequence_parallel:
        return _expected_sp(cfg, impl, E, EL, b, s, act, forms, b_out, Eh, b_head)
    out = b_head * s * m.d_model
    n, c = loss_chunks(m.loss_chunk, b_head, s)
    rows = [
        E("g: vocab-parallel embedding lookup", "all-reduce", "forward", "embed",
          b_out * s * m.d_model, 1, role="embed"),
        EL("g: attention out-proj output", "all-reduce", "forward", "attention", act, 1),
        EL("g: MLP down-proj output", "all-reduce", "forward", "mlp", act, 1),
        *_cross_entropy(Eh, b_head, n, c),
        EL("f: dX entering the q/kv projection", "all-reduce", "backward", "attention", act, 1),
        EL("f: dX entering the MLP up-proj", "all-reduce", "backward", "mlp", act, 1),
        Eh("f: dX entering the LM head", "all-reduce", "backward", "cross_entropy", out, 1,
           role="head_dx")
        if impl == "shard_map" or n == 1 else
        Eh("f: dX entering the LM head, per loss chunk (GSPMD reduces each chunk's partial "
           "dX; shard_map once after the loop)", "all-reduce", "backward", "cross_entropy",
           b_head * c * m.d_model, n, role="head_dx"),
    ]
    return rows + _kv_rows(cfg, impl, EL, b * s * 2 * m.kv_heads * m.head_dim)


def _dense_mlp(cfg: Config, rows: list[Expected]) -> list[Expected]:
    """tp's rows with the MLP's counted in the layers that have a dense MLP:
    a MoE layer's experts run their own tp rows (`jaxtp.analysis.ep`), a
    shared expert is a dense MLP in every layer."""
    m = cfg.model
    if not m.n_experts or m.moe_shared_d_ff:
        return rows
    dense = schedule_of(cfg).layers_per_tick - moe_per_tick(cfg)
    return [dataclasses.replace(r, count=r.count * dense, per="tick")
            if r.scope == "mlp" and r.per == "layer" else r
            for r in rows if r.scope != "mlp" or (dense and r.per == "layer")]


def _kv_rows(cfg: Config, impl: str, EL, kv: int) -> list[Expected]:
    """With fewer kv heads than tp the kv projection is replicated, and the kv
    activation gradient (kv = b*s*2*K*H elements) is summed over the ranks that
    share each kv head (`jaxtp.model.attention`), per layer."""
    m, tp = cfg.model, cfg.parallel.tp
    K = m.kv_heads
    if K >= tp:
        return []
    # explicit picks each rank's kv head by a contraction over tp
    # (`jaxtp.parallel.Explicit.kv_for_heads`): the same one sum as shard_map
    if impl != "gspmd" or K == 1:
        return [EL("kv gradient: sum over the ranks sharing a kv head", "all-reduce",
                   "backward", "attention", kv, 1, role="kv_grad")]
    # GSPMD splits the same sum: within each kv group, then gathered
    return [EL("kv gradient: sum within each group of tp/K ranks", "all-reduce", "backward",
               "attention", kv // K, 1, group=tp // K, role="kv_grad"),
            EL("kv gradient: gathered across the K groups", "all-gather", "backward",
               "attention", kv, 1, group=K, role="kv_grad")]


def _cross_entropy(E, b: int, n: int, c: int) -> list[Expected]:
    """The vocab-parallel loss's three reductions, per loss chunk (jaxtp.model.vocab:
    n chunks of c positions; a recomputed chunk reuses them)."""
    return [E("cross-entropy: max, sum of exp, target logit"
              + (f" (x {n} loss chunks)" if n > 1 else ""), "all-reduce", "forward",
              "cross_entropy", b * c, 3 * n, "f32")]


def _expected_sp(cfg: Config, impl: str, E, EL, b: int, s: int, act: int,
                 forms: xla_overlap.Forms, b_out: int, Eh, b_head: int):
    """Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2): each all-reduce of a
    region becomes an all-gather at its entry and a reduce-scatter at its exit
    (their mirrors in the backward pass), the same ring bytes. Elements count
    the result: a reduce-scatter returns b*s*h/tp. (The replicated parameters
    used on sequence shards get partial gradients over tp: their sums are the
    gradient ledger's, `jaxtp.analysis.grads`.)

    With a remat policy, the backward pass gathers each region's input again
    for its weight gradient instead of keeping the gathered copy, as
    Megatron-SP does (Korthikanti et al. 2022, Sec. 4.2.2): one more
    all-gather per region and layer.

    With fewer kv heads than tp, GSPMD and explicit sum the kv gradient as
    they do without SP (`_kv_rows`), so the kv branch's dX is whole while the
    queries' is partial: the attention's backward entry stays an all-reduce of
    b*s*h. `b_out`: the rows of the embedding (a pipeline's stage's), `b_head`
    the head's (1F1B's: a microbatch's, counted per tick by `Eh`)."""
    m, tp = cfg.model, cfg.parallel.tp
    shard = act // tp
    emb = b_out * s * m.d_model
    out = b_head * s * m.d_model
    n, c = loss_chunks(m.loss_chunk, b_head, s)
    # GSPMD and explicit sum the kv gradient as they do without SP
    # (`_kv_rows`); shard_map sums the replicated kv weight's gradient instead
    xla_kv = impl != "shard_map" and m.kv_heads < tp
    rows = _sp_regions(cfg, EL, act, shard, xla_kv, impl, forms)
    head_windowed = impl != "shard_map" and cfg.parallel.overlap != "none" and n == 1
    rows += [
        E("SP embedding: reduce-scatter of the looked-up rows", "reduce-scatter", "forward",
          "embed", emb // tp, 1, role="embed"),
        E("SP embedding, backward: all-gather", "all-gather", "backward", "embed", emb, 1),
        *(windowed_head(Eh, act, shard, forms, tp * cfg.parallel.dp, tp) if head_windowed else [
            Eh("SP LM head entry: all-gather", "all-gather", "forward", "cross_entropy", out, 1,
               role="gather_in"),
            Eh("SP LM head, backward: reduce-scatter of dX", "reduce-scatter", "backward",
               "cross_entropy", out // tp, 1, role="head_dx")
            if impl == "shard_map" or n == 1 else
            Eh("SP LM head, backward: dX per loss chunk (GSPMD reduces each chunk)",
               "all-reduce", "backward", "cross_entropy", b_head * c * m.d_model, n,
               role="head_dx")]),
        *_cross_entropy(Eh, b_head, n, c),
    ]
    return rows + (_kv_rows(cfg, impl, EL, b * s * 2 * m.kv_heads * m.head_dim) if xla_kv
                   else [])


def _sp_regions(cfg: Config, EL, act: int, shard: int, xla_kv: bool,
                impl: str, forms: xla_overlap.Forms) -> list:
    """Each region's SP entry and exit, forward and backward (and a remat's
    regather), per layer (`EL`)."""
    if impl == "shard_map" and cfg.parallel.overlap != "none":
        return ring_regions(cfg, EL, shard)
    if cfg.parallel.overlap != "none":
        return windowed_regions(cfg, EL, act, shard, xla_kv, forms)
    rows = []
    for scope in ("attention", "mlp"):
        rows += [EL(f"SP entry: all-gather into {scope}", "all-gather", "forward", scope, act, 1,
                    role="gather_in"),
                 EL(f"SP exit: reduce-scatter out of {scope}", "reduce-scatter", "forward",
                    scope, shard, 1),
                 EL(f"SP exit, backward: all-gather of the {scope} output gradient",
                    "all-gather", "backward", scope, act, 1, role=f"gather_grad_{scope}"),
                 EL(f"SP entry, backward: all-reduce of dX into {scope} (the kv branch's dX "
                    "is whole)", "all-reduce", "backward", scope, act, 1)
                 if scope == "attention" and xla_kv else
                 EL(f"SP entry, backward: reduce-scatter of dX into {scope}",
                    "reduce-scatter", "backward", scope, shard, 1)]
        if cfg.model.remat != "none":
            rows.append(EL(f"SP remat: {scope}'s input gathered again in the backward pass",
                           "all-gather", "backward", scope, act, 1, role="gather_in"))
    return rows
