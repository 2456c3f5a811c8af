"""The data-parallel ledger of a train step: the rows over dp (the loss
mean, the gradient reductions, FSDP's gathers and reduce-scatters) that
`jaxtp.analysis.budget.expected_collectives` adds to the tp rows at dp > 1,
from a per-parameter table (`param_shards`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from ..config import Config
from ..model import Transformer
from ..parallel import CP_AXIS, DATA_AXIS, Layout, spec_axes, split_over_tp
from ..train.step import slices_over_dp_of
from .rows import ANY_PASS, ANY_SCOPE, HLO_DTYPES, Expected


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One parameter as the dp budget needs it: its path, the elements one tp
    rank holds, whether FSDP splits it over dp, where it is used."""

    path: str
    elements: int  # one tp rank's (a stacked parameter: all its layers')
    dp_split: bool
    in_stack: bool  # a block's (under a scanned stack: one layer per loop trip)
    # "column" (kernel or bias) / "row" kernel or "vocab" table: used inside a
    # region (shard_map gathers it there); "": on global arrays (norms,
    # row-parallel biases, positions)
    region: str
    # the MLP's down-projection bias: added last, its value feeds only the
    # block's output, so a remat's recompute never needs it
    block_output: bool


def param_shards(cfg: Config) -> list[ParamShard]:
    """Every parameter of `cfg`'s model as a `ParamShard`, from abstract shapes."""
    # Auto axes whatever the impl: shapes only, no contraction is typed
    layout = Layout.of(cfg)
    mesh = dataclasses.replace(layout, impl="gspmd").abstract_mesh()
    model = dataclasses.replace(cfg.model, attention="xla")  # shapes only
    with jax.sharding.use_abstract_mesh(mesh):
        params = nnx.state(nnx.eval_shape(
            lambda: Transformer(model, layout, rngs=nnx.Rngs(0))), nnx.Param)
    out = []
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, v in flat:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        spec = v.get_metadata().get("out_sharding") or ()
        module, leaf = names[-2], names[-1]
        # a column-parallel bias is added inside the region; a row-parallel
        # one after g, outside it
        region = ("vocab" if leaf == "embedding" and module in ("wte", "lm_head") else
                  "column" if module in ("q", "kv", "up") else
                  "row" if leaf == "kernel" and module in ("out", "down") else "")
        out.append(ParamShard(
            "/".join(names), int(np.prod(v.shape)) // (cfg.parallel.tp if split_over_tp(spec)
                                                        else 1),
            any(DATA_AXIS in spec_axes(e) for e in spec), names[0] == "blocks", region,
            module == "down" and leaf == "bias"))
    return out


def data_group(cfg: Config) -> tuple[int, tuple[str, ...]]:
    """(size, mesh axes) of the group a weight gradient is summed over: dp,
    and cp, which splits the tokens as dp does (each rank's gradient is its
    tokens' part)."""
    p = cfg.parallel
    axes = tuple(a for a, n in ((DATA_AXIS, p.dp), (CP_AXIS, p.cp)) if n > 1)
    return p.dp * p.cp, axes or (DATA_AXIS,)


def expected_dp(cfg: Config, impl: str) -> list[Expected]:
    """Data parallelism: the loss is averaged over dp (one scalar all-reduce),
    and every parameter gradient (each rank's tp shard) is all-reduced over dp
    (a tied embedding twice: its lookup and LM-head gradients are reduced
    before they are added). XLA may combine, split or loop these (a scanned
    stack), so the budget is their total elements, whatever the scopes.

    With microbatches the slices run in a shard_map manual over dp
    (`jaxtp.train.step`): every gradient, summed over the slices on each
    rank, is reduced once per step (the tied embedding's two parts added
    first), and the loss once. FSDP: `_expected_fsdp`.

    Under cp the same rows span dp x cp (`data_group`)."""
    m, p = cfg.model, cfg.parallel
    group, axes = data_group(cfg)
    if group == 1:
        return []
    over = " x ".join(axes)
    M = cfg.train.microbatches
    if p.fsdp:
        return _expected_fsdp(cfg, impl)
    pd = HLO_DTYPES[m.param_dtype]
    grads = sum(s.elements for s in param_shards(cfg))
    if slices_over_dp_of(cfg):  # one reduction of each whole gradient at the end
        return [_loss_mean(group, 1, "other", axes),
                Expected(f"{over}: every parameter gradient (tp shard), summed over {over} "
                         f"once after {M} microbatches", "all-reduce", "other", ANY_SCOPE, grads,
                         pd, group, 1, axes=axes)]
    if M > 1:  # cuDNN attention: the slices reduce as one batch does, each of them
        one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=1))
        return [dataclasses.replace(r, count=r.count * M) for r in expected_dp(one, impl)]
    return _one_batch(cfg, impl, grads)


def _one_batch(cfg: Config, impl: str, grads: int) -> list[Expected]:
    """`expected_dp`'s rows of one batch: the loss mean and the gradients'
    sums (under shard_map its regions' and GSPMD's outside them apart), from
    `grads`, the elements of every parameter's tp shard."""
    m, p = cfg.model, cfg.parallel
    group, axes = data_group(cfg)
    pd = HLO_DTYPES[m.param_dtype]
    if m.tie_embeddings:
        grads += m.padded_vocab // p.tp * m.d_model
    if p.sequence_parallel and impl == "shard_map" and m.kv_heads < p.tp:
        grads -= m.n_layers * m.d_model * 2 * m.kv_heads * m.head_dim  # over dp and tp at once
    # at dp > 1 and cp > 1, what GSPMD reduces (every gradient under gspmd
    # and explicit, the loss, shard_map's outside its regions) is summed over
    # cp and then over dp, two all-reduces; shard_map's regions sum over both
    # at once (one psum, the transpose of their dp x cp broadcast)
    steps = (((p.cp, (CP_AXIS,)), (p.dp, (DATA_AXIS,))) if p.dp > 1 and p.cp > 1
             else ((group, axes),))
    over = lambda a: " x ".join(a)
    # the learned positions' gradient is non-zero on a rank's own T/(cp*tp)
    # positions under SP (T/cp without), and the sum over dp alone reduces
    # just those rows (what cp and tp sum: `jaxtp.analysis.cp.settle_cp`)
    sp = p.tp if p.sequence_parallel else 1
    elided = lambda a: (m.seq_len * m.d_model - m.seq_len // (p.cp * sp) * m.d_model
                        if m.style != "llama" and a == (DATA_AXIS,) else 0)
    rows = [_loss_mean(g, 1, axes=a) for g, a in steps]
    if impl == "shard_map":  # its regions' own sums, and what GSPMD places outside them
        outside = sum(s.elements for s in param_shards(cfg) if not s.region)
        rows += [Expected(f"{over(axes)}: parameter gradients outside the regions (norms, "
                          f"biases, positions), summed over {over(a)} by GSPMD",
                          "all-reduce", "backward", ANY_SCOPE, outside - elided(a), pd, g, 1,
                          axes=a, written=False) for g, a in steps]
        return rows + [Expected(f"{over(axes)}: every parameter gradient (tp shard), summed "
                                f"over {over(axes)} in its region", "all-reduce", "backward",
                                ANY_SCOPE, grads - outside, pd, group, 1, axes=axes)]
    return rows + [Expected(f"{over(axes)}: every parameter gradient (tp shard), summed over "
                            f"{over(a)}", "all-reduce", "backward", ANY_SCOPE,
                            grads - elided(a), pd, g, 1, axes=a)
                   for g, a in steps]


def _loss_mean(group: int, count: int, pass_: str = "forward",
               axes: tuple[str, ...] = (DATA_AXIS,)) -> Expected:
    """The loss averaged over dp (and cp): in the forward pass of each
    microbatch, or once after the slices ("other": `jaxtp.train.step`'s
    dp-local sum)."""
    over = " x ".join(axes)
    return Expected(f"{over}: mean of the loss over {over}"
                    + (" (per microbatch)" if count > 1 else ""),
                    "all-reduce", pass_, "", 1, "f32", group, count, axes=axes,
                    written=pass_ == "other")


def _expected_fsdp(cfg: Config, impl: str) -> list[Expected]:
    """FSDP (ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1: parameters, gradients
    and Adam state split over dp along the model dim), per parameter p whose
    tp shard holds n elements, over dp:

    - forward: p all-gathered (n elements) where a module uses it
      (`jaxtp.model.layers.weight`; under shard_map inside its region),
      once per microbatch inside a scanned stack (one layer per trip); XLA
      hoists every other gather, a loop invariant, out of the microbatch loop,
      so it runs once per step. A tied table is gathered once for both uses.
    - backward, with a remat policy: the recomputed block gathers its
      weights again, once per microbatch (the recompute is not hoisted):
      every dp-split block parameter but the MLP's down bias (the block's
      last op, which the backward never needs), whatever the policy (none
      saves a gathered weight). Except under shard_map in an unscanned stack
      in one batch, where XLA gathers each region kernel once in all
      (remat "full": the forward's and the recompute's gather are one op,
      labelled by either pass: GPT-2's column kernels by the backward,
      Llama's by the forward) or not again ("dots", "minimal" keep the
      gathered kernels); a scanned stack's backward loop gathers them again
      (measured, jaxlib 0.10.2).
    - each gradient reduce-scattered (n/dp elements per rank) once per
      microbatch: the accumulator stays sharded (ZeRO-3's gradient memory,
      not one unsharded gradient per rank); a tied table's two parts apart.
      A parameter not split over dp (a column-parallel bias: no model dim)
      is all-reduced, as without FSDP.
    - the loss mean once per microbatch; the gradient norm over dp and tp
      (`_expected_tp`)."""
    shards = param_shards(cfg)
    return ([_loss_mean(cfg.parallel.dp, cfg.train.microbatches)]
            + _fsdp_over_cp(cfg, impl, shards)
            + _fsdp_gathers(cfg, impl, shards) + _fsdp_reductions(cfg, impl, shards))


def _fsdp_over_cp(cfg: Config, impl: str, shards: list[ParamShard]) -> list[Expected]:
    """FSDP with cp: each microbatch's gradients, whole over dp, are first
    all-reduced over cp (the loss too), then reduce-scattered over dp; but
    shard_map sums the parameters FSDP leaves whole (column biases) over
    dp x cp at once (`_fsdp_reductions`)."""
    m, p, M = cfg.model, cfg.parallel, cfg.train.microbatches
    if p.cp == 1:
        return []
    grads = sum(s.elements for s in shards
                if s.dp_split or impl != "shard_map" or not s.region)
    if m.tie_embeddings:  # its lookup's and its head's parts apart
        grads += m.padded_vocab // p.tp * m.d_model
    return [_loss_mean(p.cp, M, axes=(CP_AXIS,)),
            Expected("cp: every parameter gradient (whole over dp) summed over cp before "
                     "FSDP's reduction", "all-reduce", "backward", ANY_SCOPE, grads,
                     HLO_DTYPES[m.param_dtype], p.cp, M, "cp_grads", (CP_AXIS,))]


def _fsdp_row(cfg: Config, name: str, kind: str, pass_: str, n: int, count: int, dtype: str,
              role: str = "", written: bool = True) -> Expected:
    return Expected("FSDP: " + name, kind, pass_, ANY_SCOPE, n, dtype, cfg.parallel.dp, count,
                    role, (DATA_AXIS,), written)


def _fsdp_gathers(cfg: Config, impl: str, shards: list[ParamShard]) -> list[Expected]:
    """FSDP's all-gathers (`_expected_fsdp`): forward, and again for a remat."""
    m, M = cfg.model, cfg.train.microbatches
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    scanned, remat = m.scan_layers, m.remat != "none"
    split = [s for s in shards if s.dp_split]
    per_use = lambda s: M if s.in_stack and scanned else 1
    # the vocab tables travel in the parameter dtype, every other weight in the
    # compute dtype (`jaxtp.model.layers.weight`): their forward gathers apart
    tables = sum(s.elements for s in split if s.region == "vocab")
    split = [s for s in split if s.region != "vocab"]
    fwd, bwd = 0, 0
    either = 0  # gathered once, in the pass XLA keeps of two equal gathers
    # under shard_map, GSPMD gathers the parameters used outside the regions
    outside = (sum(s.elements for s in split if not s.region)
               if impl == "shard_map" and not remat and not scanned and M == 1 else 0)
    for s in split:
        if impl == "shard_map" and remat and s.in_stack and s.region and not scanned and M == 1:
            if m.remat == "full":
                either += s.elements * per_use(s)
            else:
                fwd += s.elements * per_use(s)
            continue
        fwd += s.elements * per_use(s)
        if remat and s.in_stack and not s.block_output:
            bwd += s.elements * M  # inside the recompute: never hoisted
    E = lambda *a, **kw: _fsdp_row(cfg, *a, **kw)
    rows = []
    if not either or pd != cd:
        rows.append(E("the vocab tables all-gathered (in their own dtype) for the lookup and "
                      "the head", "all-gather", "forward", tables, 1, pd))
    else:  # one total with the gathers whose pass is XLA's pick
        either += tables
    if either:  # which pass a gather is labelled with is XLA's pick: one total
        rows.append(E("every dp-split parameter all-gathered for its forward use, block "
                      f"weights again for the backward (remat {m.remat!r}), but shard_map's "
                      "region kernels once for both passes", "all-gather", ANY_PASS,
                      fwd + bwd + either, 1, cd))
    else:
        if outside:
            rows.append(E("parameters outside the regions all-gathered by GSPMD for their "
                          "forward use", "all-gather", "forward", outside, 1, cd, written=False))
        rows.append(E("every dp-split parameter all-gathered for its forward use"
                      + (" in its region" if outside else ""),
                      "all-gather", "forward", fwd - outside, 1, cd))
        if bwd:
            rows.append(E(f"remat {m.remat!r}: block weights gathered again for the backward",
                          "all-gather", "backward", bwd, 1, cd))
    return rows


def _fsdp_reductions(cfg: Config, impl: str, shards: list[ParamShard]) -> list[Expected]:
    """FSDP's gradient reductions over dp (`_expected_fsdp`), once per microbatch."""
    m, p, M = cfg.model, cfg.parallel, cfg.train.microbatches
    dp, pd = p.dp, HLO_DTYPES[m.param_dtype]
    split = [s for s in shards if s.dp_split and s.region != "vocab"]
    tables = sum(s.elements for s in shards if s.dp_split and s.region == "vocab")
    # shard_map reduce-scatters its region weights itself; GSPMD places the rest
    both = tables + (m.padded_vocab // p.tp * m.d_model if m.tie_embeddings else 0)
    region_rs = sum(s.elements for s in split if s.region) + both if impl == "shard_map" else 0
    gspmd_rs = sum(s.elements for s in split) + both - region_rs
    replicated = sum(s.elements for s in shards if not s.dp_split)
    if (p.sequence_parallel or p.cp > 1) and m.style != "llama":
        # the positions' dp slice (as without FSDP): each rank's own T/(cp*tp) rows
        gspmd_rs -= m.seq_len * m.d_model - m.seq_len // (p.cp * (
            p.tp if p.sequence_parallel else 1)) * m.d_model
    E = lambda *a, **kw: _fsdp_row(cfg, *a, **kw)
    rows = []
    if region_rs:
        rows.append(E("region weights' gradients reduce-scattered (shard_map)",
                      "reduce-scatter", "backward", region_rs // dp, M, pd))
    if gspmd_rs:
        rows.append(E("gradients reduce-scattered over dp" +
                      (" (GSPMD: norms, biases, positions)" if impl == "shard_map" else ""),
                      "reduce-scatter", "backward", gspmd_rs // dp, M, pd, "fsdp_gspmd",
                      written=False))
    if replicated:
        joint = impl == "shard_map" and p.cp > 1  # one psum over dp x cp in the region
        rows.append(dataclasses.replace(
            E("parameters not split over dp (no model dim): gradient all-reduced"
              + (" over dp x cp" if joint else ""), "all-reduce", "backward", replicated, M, pd),
            **(dict(group=p.dp * p.cp, axes=(DATA_AXIS, CP_AXIS)) if joint else {})))
    return rows
