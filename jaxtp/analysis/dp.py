"""The FSDP ledger of a train step: the parameters' all-gathers over dp
(ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1: parameters, gradients and Adam
state split over dp along the model dim). The gradients' sums over dp and cp,
FSDP's reduce-scatters among them, are `jaxtp.analysis.grads`'s; the loss
mean too (a mixture of experts' by the same rule, per parameter).

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


from ..config import Config
from ..parallel import CP_AXIS, DATA_AXIS, EP_AXIS
from .params import param_shards, part_dtypes
from .rows import ANY_PASS, ANY_SCOPE, HLO_DTYPES, Expected, on, runs_head


def scatters(cfg: Config) -> bool:
    """Whether FSDP reduce-scatters the gradients over dp: at dp > 1 in a
    dense model (a MoE model's GSPMD sums stay whole over dp x ep, `moe_fsdp_parts`)."""
    p = cfg.parallel
    return p.fsdp and p.dp > 1 and not cfg.model.n_experts


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
    their own, `jaxtp.analysis.params.part_dtypes`)."""
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
    # inside the recompute: never hoisted (but a schedule that runs its own
    # backward (1F1B) gathers a stage's weights once, for both passes)
    bwd = sum(s.elements for s in split if remat and s.in_stack and not s.block_output
              and not once(s)) * (not runs_head(cfg))
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


def fsdp_parts(cfg: Config, impl: str, g, platform: str = "") -> list:
    """FSDP's sums, per microbatch: over cp first (what is whole over dp; a
    written gradient in its region), then a dp-split gradient reduce-scattered
    over dp (n/dp elements per rank: the accumulator stays sharded), any other
    one all-reduced (with cp at once where written)."""
    p = cfg.parallel
    dp, cp = (DATA_AXIS,), on(cfg, CP_AXIS)
    joint = g.written and not g.shard.dp_split  # one psum over dp x cp
    out = []
    for dt in g.dtypes:
        if cp and not joint and not g.keyed:
            what = ("every parameter gradient" if impl != "shard_map" else
                    "the regions' parameter gradients" if g.written else
                    "by GSPMD, the gradients outside the regions (norms, biases, positions)")
            whole = " (whole over dp)" * (impl != "shard_map" or g.written)
            out.append(g.part(f"cp: {what}{whole} summed over cp before FSDP's reduction",
                              g.shard.elements, dt, cp, written=g.written or impl != "shard_map",
                              role="" if g.written else "cp_grads"))
        if g.shard.dp_split and g.written:
            out.append(g.part("FSDP: region weights' gradients reduce-scattered (shard_map)",
                              g.shard.elements // p.dp, dt, dp, kind="reduce-scatter", role=""))
        elif g.shard.dp_split:
            out.append(g.part("FSDP: gradients reduce-scattered over dp" + (
                " (GSPMD: norms, biases, positions)" if impl == "shard_map" else ""),
                g.dp_elements // p.dp, dt, dp, kind="reduce-scatter", written=False,
                role="fsdp_gspmd"))
        else:
            both = impl == "shard_map" and cp
            out.append(g.part("FSDP: parameters not split over dp (no model dim): gradient "
                              "all-reduced" + (" over dp x cp" if both else ""),
                              g.shard.elements, dt, dp + cp if both else dp, role=""))
    return out


def experts_scattered(cfg: Config, impl: str, platform: str) -> bool:
    """Whether FSDP's experts' gradients are reduce-scattered over dp:
    shard_map's psum_scatter; under gspmd XLA:GPU's reduce-scatter creator
    (measured, compiled for an H100) makes one of the all-reduce and slice
    that XLA:CPU and libtpu keep."""
    p = cfg.parallel
    return p.fsdp and p.dp > 1 and (
        impl == "shard_map" or platform in ("gpu", "cuda") and p.cp == 1)


def moe_fsdp_parts(cfg: Config, impl: str, g, platform: str = "") -> list:
    """FSDP in a MoE model (as XLA:CPU sums it, jax 0.10.2, measured): GSPMD
    all-reduces each gradient whole over its batch axes and keeps its dp
    part (`jaxtp.analysis.grads.placed`; XLA:GPU reduce-scatters the experts', `experts_scattered`);
    shard_map's region weights (attention, vocab tables, experts) are summed
    whole over ep and cp and then reduce-scattered over dp; GSPMD sums the
    rest (norms, the router) as `placed`."""
    p, pd = cfg.parallel, HLO_DTYPES[cfg.model.param_dtype]
    whole = on(cfg, CP_AXIS) if g.expert else on(cfg, EP_AXIS, CP_AXIS)
    scatter = g.part("FSDP: the experts' weight gradients reduce-scattered over dp (ep owns "
                     "its experts)" if g.expert else "FSDP: the region weights' gradients "
                     "reduce-scattered over dp", g.shard.elements // p.dp, pd, (DATA_AXIS,),
                     kind="reduce-scatter")
    if g.expert and experts_scattered(cfg, impl, platform) and impl != "shard_map":
        return [scatter]
    if impl != "shard_map" or not (g.expert or g.shard.region and g.shard.dp_split):
        return None  # (as without FSDP: `jaxtp.analysis.grads.placed`)
    over = " x ".join(whole)
    return [g.part(f"{over}: the {'experts' if g.expert else 'region weights'}' gradients "
                   "(whole over dp) summed, before FSDP's reduce-scatter", g.shard.elements,
                   pd, whole)] * bool(whole) + [scatter]
