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

from ..model.vocab import loss_chunks
from .grads import scatters
from .params import part_dtypes, param_shards
from .rows import ANY_SCOPE, HLO_DTYPES, batch_axes, batch_ranks, reduces_once, schedule_of

if TYPE_CHECKING:
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
    if platform in ("gpu", "cuda") and batch_ranks(cfg) > 1:
        out = _gpu_dp(out, cfg, impl)
    if platform == "tpu" and batch_ranks(cfg) > 1:
        out = _tpu_dp(out, cfg, impl)
    if platform in ("gpu", "cuda") and cfg.parallel.cp > 1:
        out = _gpu_pp_cp(out, cfg, impl) if cfg.parallel.pp > 1 else _gpu_cp(out, cfg)
    return out


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
    if platform in ("gpu", "cuda") and r.role == "grads_outside" and impl == "shard_map" \
            and m.tie_embeddings and r.dtype == (
                HLO_DTYPES[m.param_dtype] if cfg.parallel.pp_schedule == "1f1b" else
                part_dtypes(cfg, impl, "lm_head/embedding", 1)[0]):
        # around a pipeline XLA:GPU adds the tied table's two gradients
        # (lookup, head: the head's in its dtype, 1F1B's accumulated in the
        # table's) before their one sum over pp x dp, in the lookup's fp32
        table = next(s.elements for s in param_shards(cfg) if s.path == "wte/embedding")
        r = dataclasses.replace(r, elements=r.elements - table,
                                name=r.name + " [the tied table's two summed first]")
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
    return dataclasses.replace(r, dtype=carried("cpu", r.dtype))


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


def _gpu_pp_cp(rows: list[Expected], cfg: Config, impl: str) -> list[Expected]:
    """Around a pipeline at cp > 1 (no combined cp sum: the stages' is their
    own, once), XLA's GPU pipeline under gspmd sums a tied table's lookup
    part over pp x cp at once, with the head's part, not over cp and then
    over pp (measured on the H100 target, tiny at pp=2 x cp=2 x tp=2, 1F1B)."""
    table = next(s.elements for s in param_shards(cfg) if s.path == "wte/embedding") \
        if impl == "gspmd" and cfg.model.tie_embeddings else 0
    less = {"grads_apart_cp": table, "grads_apart": table, "grads_outside": -table}
    rows = [dataclasses.replace(r, elements=r.elements - less[r.role],
                                name=r.name + " [as XLA:GPU sums them]")
            if less.get(r.role) else r for r in rows]
    return _joined_loss_means(rows)


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


def _gpu_dp(rows: list[Expected], cfg: Config, impl: str) -> list[Expected]:
    """At dp > 1, XLA's GPU pipeline reduces some gradients over dp and tp at
    once, or once instead of twice; the dp total (`jaxtp.analysis.grads`) loses them.
    - replicated weights used on sequence shards (norms, row-parallel biases):
      one all-reduce over all dp * tp devices;
    - shard_map and explicit, tied embeddings: the lookup's and the LM
      head's table gradients are added first and reduced once (XLA's
      all-reduce reassociation; GSPMD's two stay apart)."""
    p, m = cfg.parallel, cfg.model
    # in slices over dp, dp is manual inside them and reduced once after
    # (jaxtp.parallel.Schedule): nothing is summed over dp and tp at once
    once = not scatters(cfg) and not reduces_once(cfg)
    moved: dict[str, int] = {}  # elements per dtype
    out = []
    for r in rows:
        if r.role == "seq_shard_param" and once:
            moved[r.dtype] = moved.get(r.dtype, 0) + r.elements * r.count
            r = dataclasses.replace(r, group=batch_ranks(cfg) * p.tp,
                                    axes=batch_axes(cfg) + (TP_AXIS,),
                                    name=r.name + " [over dp and tp]")
        out.append(r)
    head = part_dtypes(cfg, impl, "lm_head/embedding", 1)[0]
    part = m.padded_vocab // p.tp * m.d_model * cfg.train.microbatches  # per step
    # the LM head's gradient is summed once after the loss's chunks, not per
    # chunk as XLA:CPU does (`jaxtp.analysis.grads`; measured on the H100
    # target, tiny at dp 2 x tp 4, 4 and 8 chunks, every impl)
    chunks = loss_chunks(m.loss_chunk, schedule_of(cfg).head_rows, m.seq_len)[0]
    if once and p.cp == 1 and chunks > 1:
        moved[head] = moved.get(head, 0) + (chunks - 1) * part
    elif impl != "gspmd" and m.tie_embeddings and once:  # (the head's part, in its dtype;
        # not after a chunk loop, where the head's sum is its own)
        moved[head] = moved.get(head, 0) + part
    # from the gradient totals over dp in their dtype (measured at cp = 1: at
    # cp > 1 the GPU's sums over dp are not budgeted, docs/scale.md)
    for i, r in enumerate(out):
        if r.role == "grads" and r.axes == batch_axes(cfg) and p.cp == 1 and r.dtype in moved:
            out[i] = dataclasses.replace(r, elements=r.elements - moved.pop(r.dtype))
    return out


def _tpu_dp(rows: list[Expected], cfg: Config, impl: str) -> list[Expected]:
    """At dp > 1 with the gradients summed per microbatch (no FSDP, cp = 1),
    libtpu (measured on the v5p target, fp32 and bf16: tiny and llama-tiny
    at dp4 x tp2, tiny at pp2 x dp2 x tp2, moe-tiny at ep4 x tp2 and dp2 x
    ep2 x tp2):
    - sums a vocab table's head part in the compute dtype under every impl:
      the head's dot reads bf16 operands (`_on_tpu`), where GSPMD on CPU and
      GPU sums it in the logits' fp32 (`params.part_dtypes`); in a 1F1B
      pipeline that part accumulates in the loop, in the table's dtype;
    - under explicit, and under shard_map where that part is in the lookup's
      dtype, adds a tied table's lookup and head parts before one sum (XLA's
      all-reduce reassociation; GSPMD's two stay apart, as do shard_map's
      bf16 region sum and the fp32 lookup's)."""
    p, m = cfg.parallel, cfg.model
    if scatters(cfg) or p.cp > 1 or reduces_once(cfg):
        return rows
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    pipelined = p.pp > 1
    # the rows a vocab table's head part is summed in: over dp per microbatch,
    # or in a pipeline the weights' outside it (GSPMD's, and shard_map's)
    role = {"gspmd": "grads_apart"}.get(impl, "grads_outside") if pipelined else "grads"
    head = m.padded_vocab // p.tp * m.d_model * (1 if pipelined else cfg.train.microbatches)
    in_loop = pipelined and p.pp_schedule == "1f1b"
    booked = pd if in_loop else part_dtypes(cfg, impl, "lm_head/embedding", 1)[0]
    summed = pd if in_loop else cd  # libtpu's
    moves: list[tuple[str, str | None]] = []  # (from dtype, to dtype; None: folded)
    if booked != summed:
        moves.append((booked, summed))
    if m.tie_embeddings and (impl == "explicit" or (impl == "shard_map" and summed == pd)):
        moves.append((summed, None))
    out = list(rows)
    at = lambda dt: next((i for i, r in enumerate(out) if r.role == role and r.dtype == dt
                          and r.kind == "all-reduce" and DATA_AXIS in r.axes), None)
    for frm, to in moves:
        i = at(frm)
        if i is None:
            continue
        out[i] = dataclasses.replace(out[i], elements=out[i].elements - head,
                                     name=out[i].name + " [libtpu: the head's part elsewhere]")
        if to is not None:
            j = at(to)
            if j is None:
                out.append(dataclasses.replace(out[i], elements=head, dtype=to,
                                               name=out[i].name + f" [the head's part, {to}]"))
            else:
                out[j] = dataclasses.replace(out[j], elements=out[j].elements + head)
    return [r for r in out if r.elements]
