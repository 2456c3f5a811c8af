"""The FSDP ledger of a train step: the parameters' all-gathers over dp
(ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1: parameters, gradients and Adam
state split over dp along the model dim). The gradients' sums over dp and cp,
FSDP's reduce-scatters among them, are `jaxtp.analysis.grads`'s; the loss
mean too; a mixture of experts' (its experts split over dp too), `moe_fsdp`'s.

Per parameter p whose tp shard holds n elements, over dp:

- forward: p all-gathered (n elements) where a module uses it
  (`jaxtp.model.layers.weight`; under shard_map inside its region), once
  per microbatch inside a scanned stack (one layer per trip); XLA hoists
  every other gather, a loop invariant, out of the microbatch loop, so it
  runs once per step. A tied table is gathered once for both uses.
- backward, with a remat policy: the recomputed block gathers its weights
  again, once per microbatch (the recompute is not hoisted): every dp-split
  block parameter but the MLP's down bias (the block's last op, which the
  backward never needs), whatever the policy (none saves a gathered
  weight). Except under shard_map in an unscanned stack in one batch, where
  XLA gathers each region kernel once in all (remat "full": the forward's
  and the recompute's gather are one op, labelled by either pass) or not
  again ("dots", "minimal" keep the gathered kernels); a scanned stack's
  backward loop gathers them again (measured: docs/scale.md, "The dp
  ledger").
"""

from __future__ import annotations

import dataclasses
import math

from ..config import Config
from ..parallel import CP_AXIS, DATA_AXIS, EP_AXIS
from .grads import part_dtypes
from .params import param_shards
from .rows import ANY_PASS, ANY_SCOPE, HLO_DTYPES, Expected


def expected_fsdp(cfg: Config, impl: str) -> list[Expected]:
    """FSDP's all-gathers (see the module docstring), at dp > 1 with FSDP."""
    p = cfg.parallel
    if not p.fsdp or p.dp == 1:
        return []
    return _fsdp_gathers(cfg, impl)


def _fsdp_row(cfg: Config, name: str, kind: str, pass_: str, n: int, per: str, dtype: str,
              written: bool = True) -> Expected:
    return Expected("FSDP: " + name, kind, pass_, ANY_SCOPE, n, dtype, cfg.parallel.dp, 1, "",
                    (DATA_AXIS,), written, per)


def _fsdp_gathers(cfg: Config, impl: str) -> list[Expected]:
    """FSDP's all-gathers (the module docstring): forward, and again for a
    remat; a row per step (hoisted) and a row per microbatch (in a loop),
    per dtype: a weight travels in the dtype it is used in (`weight`: the
    compute dtype's copy; the norms, the router and the vocab tables in
    their own, `jaxtp.analysis.grads.part_dtypes`)."""
    m = cfg.model
    pd = HLO_DTYPES[m.param_dtype]
    split = [s for s in param_shards(cfg) if s.dp_split]
    tables = sum(s.elements for s in split if s.region == "vocab")
    by_dtype: dict[str, list] = {}
    for s in split:
        if s.region != "vocab":
            by_dtype.setdefault(part_dtypes(cfg, impl, s.path, 1)[0], []).append(s)
    rows = []
    for dt, shards in by_dtype.items():
        # (the tables' gather joins a total of their dtype whose pass is XLA's pick)
        rows += _gathers(cfg, impl, shards, dt, tables if dt == pd else 0)
    if tables and not any(r.pass_ == ANY_PASS and r.dtype == pd for r in rows):
        rows.insert(0, _fsdp_row(cfg, "the vocab tables all-gathered (in their own dtype) "
                                 "for the lookup and the head", "all-gather", "forward",
                                 tables, "step", pd))
    return rows


def _gathers(cfg: Config, impl: str, split: list, dt: str, tables: int) -> list[Expected]:
    """`_fsdp_gathers`'s rows of the weights `split` that travel in `dt`;
    `tables`: the vocab tables' elements, which join a total whose pass is
    XLA's pick (else their own row)."""
    m, M = cfg.model, cfg.train.microbatches
    scanned, remat = m.scan_layers, m.remat != "none"
    looped = lambda s: s.in_stack and scanned  # gathered per microbatch (and layer)
    # under shard_map, in an unscanned stack in one batch, XLA gathers each
    # region kernel once for both passes (remat "full") or for the forward
    once = lambda s: impl == "shard_map" and remat and s.in_stack and s.region and \
        not scanned and M == 1
    either = sum(s.elements for s in split if once(s) and m.remat == "full")
    fwd = {"step": sum(s.elements for s in split if not looped(s) and not (
        once(s) and m.remat == "full")), "microbatch": sum(s.elements for s in split
                                                           if looped(s))}
    bwd = sum(s.elements for s in split if remat and s.in_stack and not s.block_output
              and not once(s))  # inside the recompute: never hoisted
    # under shard_map, GSPMD gathers the parameters used outside the regions
    outside = (sum(s.elements for s in split if not s.region)
               if impl == "shard_map" and not remat and not scanned and M == 1 else 0)
    E = lambda *a, **kw: _fsdp_row(cfg, *a, **kw)
    if either:  # which pass a gather is labelled with is XLA's pick: one total
        name = ("every dp-split parameter all-gathered for its forward use, block weights "
                f"again for the backward (remat {m.remat!r}), but shard_map's region kernels "
                "once for both passes")
        rows = [E(name, "all-gather", ANY_PASS, fwd["step"] + either + tables, "step", dt),
                E(name, "all-gather", ANY_PASS, fwd["microbatch"] + bwd, "microbatch", dt)]
        return [r for r in rows if r.elements]
    rows = []
    if outside:
        rows.append(E("parameters outside the regions all-gathered by GSPMD for their "
                      "forward use", "all-gather", "forward", outside, "step", dt,
                      written=False))
    name = "every dp-split parameter all-gathered for its forward use" + (
        " in its region" if outside else "")
    rows += [E(name, "all-gather", "forward", fwd["step"] - outside, "step", dt),
             E(name, "all-gather", "forward", fwd["microbatch"], "microbatch", dt),
             E(f"remat {m.remat!r}: block weights gathered again for the backward",
               "all-gather", "backward", bwd, "microbatch", dt)]
    return [r for r in rows if r.elements]


def experts_scattered(cfg: Config, impl: str, platform: str) -> bool:
    """Whether FSDP's experts' gradients are reduce-scattered over dp:
    shard_map's psum_scatter; under gspmd XLA:GPU's reduce-scatter creator
    (measured, compiled for an H100) makes one of the all-reduce and slice
    that XLA:CPU and libtpu keep."""
    p = cfg.parallel
    return p.fsdp and p.dp > 1 and (
        impl == "shard_map" or platform in ("gpu", "cuda") and p.cp == 1)


def moe_fsdp(cfg: Config, impl: str, rows: list[Expected],
             scattered: bool) -> tuple[list, list]:
    """FSDP's part of a MoE step: (the dense rows, changed; rows to add).
    FSDP splits every weight's model dim over dp (the experts' and the
    router's too), not over ep, so each is gathered over dp where used
    (`expected_fsdp`, on the MoE model's parameters). The gradients,
    as XLA:CPU sums them (jax 0.10.2, measured): GSPMD all-reduces each one
    whole over its batch axes (dp x ep; the experts' over dp) and keeps its
    dp part, with no reduce-scatter (the non-FSDP rows); compiled for an
    H100, XLA:GPU makes the experts' a reduce-scatter over dp (`scattered`:
    `experts_scattered`),
    the rest as on CPU. shard_map's region
    weights (attention, vocab tables) are summed whole over ep (x cp) and
    then reduce-scattered over dp, the experts' summed whole over cp and
    reduce-scattered over dp; the gradients outside the regions (norms, the
    router) GSPMD all-reduces whole over dp x ep (and cp)."""
    p, shards = cfg.parallel, param_shards(cfg)
    add = expected_fsdp(cfg, impl)
    expert = lambda s: "/mlp/experts/" in s.path
    split = sum(s.elements for s in shards if s.region and s.dp_split and not expert(s))
    experts = sum(s.elements for s in shards if expert(s))
    pd = HLO_DTYPES[cfg.model.param_dtype]
    E = lambda name, kind, n, group, axes: Expected(name, kind, "backward", ANY_SCOPE, n, pd,
                                                   group, 1, "grads", axes, True, "microbatch")
    scatter = E("FSDP: the experts' weight gradients reduce-scattered over dp (ep owns its "
                "experts)", "reduce-scatter", experts // p.dp, p.dp, (DATA_AXIS,))
    if impl != "shard_map":
        return rows, add + ([scatter] if scattered else [])
    # (cp's ranks hold the same weights, the experts too: their gradients whole over it)
    whole = [(a, n) for a, n in ((EP_AXIS, p.ep), (CP_AXIS, p.cp)) if n > 1]
    if whole:
        over = tuple(a for a, _ in whole)
        add.append(E(f"{' x '.join(over)}: the region weights' gradients (whole over dp) "
                     "summed, before FSDP's reduce-scatter", "all-reduce", split,
                     math.prod(n for _, n in whole), over))
    if p.cp > 1:
        add.append(E("cp: the experts' weight gradients (whole over dp) summed, before "
                     "FSDP's reduce-scatter", "all-reduce", experts, p.cp, (CP_AXIS,)))
    add += [E("FSDP: the region weights' gradients reduce-scattered over dp",
              "reduce-scatter", split // p.dp, p.dp, (DATA_AXIS,)), scatter]
    written = lambda r: r.role == "grads" and r.written and DATA_AXIS in r.axes
    rows = [dataclasses.replace(r, elements=r.elements - split) if written(r) else r
            for r in rows]
    return [r for r in rows if r.elements], add
