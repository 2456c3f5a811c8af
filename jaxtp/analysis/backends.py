"""The budget as each compiler carries it out: the rules by which XLA's CPU
and GPU pipelines and libtpu place a budget row (`jaxtp.analysis.budget`)
differently, each measured from compiled HLO with the compilers named in
`MEASURED_ON` (another version may place collectives otherwise:
`version_note`)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from typing import TYPE_CHECKING

from ..config import Config
from ..parallel import CP_AXIS, DATA_AXIS, TP_AXIS
from ..axes import AXES

from .dp import scatters
from .rows import ANY_SCOPE, HLO_DTYPES, batch_axes, batch_ranks, reduces_once, runs_head

if TYPE_CHECKING:
    from .grads import Part
    from .rows import Expected


# the compilers every rule below was measured with (tiny and llama-tiny at
# tp=8, and the layouts of tests/analysis/test_budget.py)
MEASURED_ON = {"jaxlib": "0.10.2", "libtpu": "0.0.42"}
REMEASURE = ("re-measure: run `python -m pytest tests/analysis -m slow` and `python train.py "
             "--compare-hlo` (with --hardware h100 / v5p for the accelerators) on this version, "
             "update the rules in jaxtp/analysis/backends.py where they differ, then "
             "MEASURED_ON there")


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_note(platform: str) -> str | None:
    """One line where the compiler for `platform` is not the one the rules
    were measured on (a deviation may then be the compiler's, not the
    step's), else None."""
    package = "libtpu" if platform == "tpu" else "jaxlib"
    have = installed(package)
    if have is None or have == MEASURED_ON[package]:
        return None
    return (f"note: the budget's compiler rules were measured on {package} "
            f"{MEASURED_ON[package]}; this is {package} {have}, so a deviation may be the "
            f"compiler's; {REMEASURE}")


def on_backend(rows: list[Expected], cfg: Config, impl: str, platform: str) -> list[Expected]:
    """The budget as each compiler carries it out: what XLA's CPU and GPU
    pipelines and libtpu do differently from the budget's rows (`MEASURED_ON`)."""
    out = [_row_on_backend(r, cfg, impl, platform) for r in rows]
    if platform in ("gpu", "cuda") and cfg.parallel.cp > 1:
        out = _joined_loss_means(out) if cfg.parallel.pp > 1 else _gpu_cp(out, cfg)
    return out


def gradients_on_backend(parts: list[Part], cfg: Config, impl: str,
                         platform: str) -> list[Part]:
    """The gradient table (`jaxtp.analysis.grads`) as the compiler for
    `platform` sums it, before it is grouped into rows: a part the compiler
    adds to another before their one sum is dropped (the other's sum carries
    it); a part it sums over more axes at once, or in another dtype, is
    changed so. One function a rule, each measured (`MEASURED_ON`)."""
    gpu = platform in ("gpu", "cuda")
    rules = [_gpu_seq_over_dp_tp, _gpu_head_once, _gpu_tied_outside, _gpu_pp_cp_join] \
        if gpu else [_tpu_head] if platform == "tpu" else []
    for rule in rules:
        parts = rule(parts, cfg, impl)
    return parts


def _whole(r: Expected) -> Expected:
    """A reduce-scatter carried out as an all-reduce of the full buffer and a slice."""
    return dataclasses.replace(r, kind="all-reduce", elements=r.elements * r.group,
                               name=r.name + " [as all-reduce + slice]")


def _row_on_backend(r: Expected, cfg: Config, impl: str, platform: str) -> Expected:
    """One row as the compiler for `platform` carries it out (`on_backend`)."""
    m = cfg.model
    if platform != "cpu" and r.role == "a2a_peers":
        # one all-to-all of the whole buffer, not XLA:CPU's operand per peer
        r = dataclasses.replace(r, elements=r.elements * r.group, count=r.count // r.group,
                                role="a2a", name=r.name + " [one array]")
    if platform in ("cpu", "gpu", "cuda") and r.role == "head_dx" and \
            impl != "shard_map" and m.dtype in ("bfloat16", "float16"):
        # GSPMD (and explicit, lowered by it) reduces the LM head's dX in
        # the fp32 of the logits' gradient, before the cast (and so no
        # reduce-scatter under SP)
        r = dataclasses.replace(r, dtype="f32")
        if r.kind == "reduce-scatter":
            r = _whole(r)
    if platform == "cpu":
        r = _on_cpu(r, impl)
    elif platform == "tpu":
        r = _on_tpu(r, cfg, impl)
    if platform in ("gpu", "cuda", "tpu") and r.role == "positions":
        # each rank's position rows are its own sequence shard's: the
        # gradient rows are gathered, not summed (half the ring bytes)
        r = dataclasses.replace(r, kind="all-gather")
    return r


def _on_cpu(r: Expected, impl: str) -> Expected:
    # no reduce-scatter creator: GSPMD's (and explicit's, which the
    # partitioner lowers from its types; and the FSDP gradients GSPMD places
    # under shard_map) stays an all-reduce of the full buffer and a slice
    # (shard_map's psum_scatter is kept, and so is the cp core's, written in
    # a shard_map under every impl)
    if r.kind == "reduce-scatter" and r.role != "cp" and (
            impl != "shard_map" or r.role == "fsdp_gspmd"):
        r = _whole(r)
    if r.role == "moe_z_transposed":  # loop-invariant: hoisted out of the slices' loop
        r = dataclasses.replace(r, count=1)
    return dataclasses.replace(r, dtype=carried("cpu", r.dtype))


def widened(rows: list[Expected], dtype: str) -> list[Expected]:
    """`rows` for a model of compute `dtype`: under float64 (a verification
    run, `train.py --float64`) the rows booked in fp32, the wide dtype of the
    softmaxes, norms and sums (`jaxtp.parallel.wide`), are float64; else
    `rows` as they are."""
    if dtype != "float64":
        return rows
    return [dataclasses.replace(r, dtype="f64") if r.dtype == "f32" else r for r in rows]


def carried(platform: str, dtype: str) -> str:
    """The dtype the compiler for `platform` carries a collective of `dtype`
    in: the CPU runtime carries bf16 collectives in fp32 (f16 in f16)."""
    return "f32" if platform == "cpu" and dtype == "bf16" else dtype


def _on_tpu(r: Expected, cfg: Config, impl: str) -> Expected:
    if r.kind == "reduce-scatter":  # libtpu: all-reduce + slice, every impl
        r = _whole(r)
    if r.role.startswith("gather_grad") and impl != "shard_map" and \
            cfg.parallel.overlap != "none" and r.count > 1:
        # GSPMD's overlap (no loop on this target): libtpu gathers an exit's
        # output gradient for each of the two dots that read it, in the bf16
        # they read, but the last block's once
        r = dataclasses.replace(r, dtype="bf16", count=2 * r.count - 1,
                                name=r.name + " [once per dot but the last block's]")
    # fp32 activations and gradients on their way into a matmul travel in
    # bf16, the precision a default-precision TPU matmul reads them in (a MoE
    # layer's slots, `jaxtp.analysis.ep`: the experts' inputs, and the combine's)
    if r.dtype == "f32" and (r.role in ("gather_in", "gather_grad_mlp", "kv_grad", "a2a",
                                        "moe_slots") or
                             (r.role == "gather_grad_attention" and impl == "shard_map")):
        r = dataclasses.replace(r, dtype="bf16")
    return r


def _joined_loss_means(rows: list[Expected]) -> list[Expected]:
    """XLA:GPU folds the loss's mean over cp and its mean over the other
    batch axes that follows it into one all-reduce over their union (GPipe
    and circular, which take the two apart; 1F1B's is one already; measured
    on the H100 target: llama-tiny at pp 2 x cp 2 x tp 2, and x dp 2, and
    moe-tiny at pp 2 x ep 2 x cp 2 x tp 2 and x dp 2, jaxlib 0.10.2)."""
    means = [r for r in rows if r.role == "loss_mean"]
    if len(means) < 2:
        return rows
    axes = tuple(a for a in AXES if any(a in r.axes for r in means))
    joined = dataclasses.replace(means[0], name=f"{' x '.join(axes)}: mean of the loss, the "
                                 "means over cp and the batch axes joined",
                                 axes=axes, group=math.prod(r.group for r in means))
    return [r for r in rows if r.role != "loss_mean"] + [joined]


def _gpu_cp(rows: list[Expected], cfg: Config) -> list[Expected]:
    """At cp > 1 (dp = 1, no FSDP), XLA's GPU all-reduce combiner joins the
    loss mean over cp and every gradient summed over cp into one all-reduce
    after the backward pass (measured on the H100 target, llama-tiny at
    cp=4 x tp=2)."""
    p = cfg.parallel
    if batch_ranks(cfg) > 1 or p.fsdp:
        return rows
    over_cp = lambda r: r.axes == (CP_AXIS,) and r.kind == "all-reduce" and (
        r.scope == ANY_SCOPE or r.role == "loss_mean")
    joined = [r for r in rows if over_cp(r)]
    if not joined:
        return rows
    total = sum(r.elements * r.count for r in joined)
    return [r for r in rows if not over_cp(r)] + [dataclasses.replace(
        joined[0], name="cp: the loss mean and every gradient summed over cp, combined",
        pass_="other", scope=ANY_SCOPE, elements=total, count=1, written=True)]



def _sums_per_microbatch(cfg: Config) -> bool:
    """The gradients summed over the batch axes in each microbatch (no
    FSDP reduce-scatter, not in slices reduced once)."""
    return batch_ranks(cfg) > 1 and not scatters(cfg) and not reduces_once(cfg)


def _gpu_seq_over_dp_tp(parts: list[Part], cfg: Config, impl: str) -> list[Part]:
    """XLA:GPU sums a replicated weight used on sequence shards under SP (a
    norm, a row-parallel bias) over dp and tp at once, one all-reduce over
    every dp x tp device; its sum over the batch axes alone goes (measured
    at cp = 1: at cp > 1 the GPU's sums over dp are not budgeted,
    docs/scale.md). (In slices reduced once dp is manual inside them:
    nothing is summed over dp and tp at once.)"""
    if not _sums_per_microbatch(cfg):
        return parts
    batch = batch_axes(cfg)
    seq = {t.path for t in parts if t.role == "seq_shard_param"}
    out = []
    for t in parts:
        if t.role == "seq_shard_param":
            t = dataclasses.replace(t, axes=batch + (TP_AXIS,), rule=t.rule + " [over dp and tp]")
        elif t.path in seq and t.axes == batch and cfg.parallel.cp == 1:
            continue
        out.append(t)
    return out


def _gpu_head_once(parts: list[Part], cfg: Config, impl: str) -> list[Part]:
    """XLA:GPU sums the LM head's gradient over the batch axes once after
    the loss's chunks, not once per chunk as XLA:CPU does (measured on the
    H100 target, tiny at dp 2 x tp 4, 4 and 8 chunks, every impl); with one
    chunk, under shard_map and explicit, it adds a tied table's head part to
    its lookup part before one sum (XLA's all-reduce reassociation; GSPMD's
    two stay apart). Measured at cp = 1."""
    if not _sums_per_microbatch(cfg) or cfg.parallel.cp > 1:
        return parts
    batch = batch_axes(cfg)
    heads = [i for i, t in enumerate(parts) if t.use == "head" and t.axes == batch]
    if len(heads) == 1 and (impl == "gspmd" or not cfg.model.tie_embeddings):
        return parts
    drop = set(heads[1:] if len(heads) > 1 else heads)
    return [t for i, t in enumerate(parts) if i not in drop]


def _gpu_tied_outside(parts: list[Part], cfg: Config, impl: str) -> list[Part]:
    """Around a pipeline under shard_map, XLA:GPU adds the tied table's two
    gradients (lookup; head, in its dtype, or 1F1B's accumulated in the
    table's) before their one sum over pp x dp, in the lookup's fp32."""
    if impl != "shard_map" or not cfg.model.tie_embeddings:
        return parts
    head = next((i for i, t in enumerate(parts)
                 if t.use == "head" and t.role == "grads_outside"), None)
    return [t for i, t in enumerate(parts) if i != head]


def _gpu_pp_cp_join(parts: list[Part], cfg: Config, impl: str) -> list[Part]:
    """Around a pipeline at cp > 1, XLA:GPU joins the two sums GSPMD places
    apart for a weight outside the stages, over cp and then over pp and the
    batch axes, into one all-reduce over all of them; not the learned
    positions', whose sum over pp reduces only the rank's own rows (measured
    on the H100 target, GPipe and 1F1B: tiny and llama-tiny at pp 2 x cp 2 x
    tp 2 and x dp 2, moe-tiny at pp 2 x ep 2 x cp 2 x tp 2, and at dp 2 x
    pp 2 x ep 2 x cp 2 x tp 2 on 32 devices)."""
    if cfg.parallel.pp == 1 or cfg.parallel.cp == 1:
        return parts
    joined = lambda t: t.path != "wpe/embedding"
    return [dataclasses.replace(t, axes=t.axes + (CP_AXIS,), rule=t.rule + " [and cp, at once]")
            if t.role == "grads_apart" and joined(t) else t
            for t in parts if not (t.role == "grads_apart_cp" and joined(t))]


def _tpu_head(parts: list[Part], cfg: Config, impl: str) -> list[Part]:
    """libtpu, the gradients summed per microbatch over dp at cp = 1
    (measured on the v5p target, fp32 and bf16: tiny and llama-tiny at dp4 x
    tp2, tiny at pp2 x dp2 x tp2, moe-tiny at ep4 x tp2 and dp2 x ep2 x tp2):
    - sums a vocab table's head part in the compute dtype under every impl:
      the head's dot reads bf16 operands (`_on_tpu`), where GSPMD on CPU and
      GPU sums it in the logits' fp32 (`params.part_dtypes`); in a 1F1B
      pipeline that part accumulates in the loop, in the table's dtype;
    - under explicit, and under shard_map where that part is in the lookup's
      dtype, adds a tied table's head part to its lookup part before one sum
      (XLA's all-reduce reassociation; GSPMD's two stay apart, as do
      shard_map's bf16 region sum and the fp32 lookup's)."""
    p, m = cfg.parallel, cfg.model
    if not _sums_per_microbatch(cfg) or p.cp > 1:
        return parts
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    summed = pd if p.pp > 1 and runs_head(cfg) else cd
    # (the row a head part is summed over dp in: per microbatch, or in a
    # pipeline the weights' outside it)
    role = ("grads_apart" if impl == "gspmd" else "grads_outside") if p.pp > 1 else "grads"
    head = next((i for i, t in enumerate(parts) if t.use == "head" and t.role == role
                 and t.kind == "all-reduce" and DATA_AXIS in t.axes), None)
    if head is None:
        return parts
    out = list(parts)
    if m.tie_embeddings and (impl == "explicit" or (impl == "shard_map" and summed == pd)):
        del out[head]
    else:
        out[head] = dataclasses.replace(out[head], dtype=summed)
    return out
