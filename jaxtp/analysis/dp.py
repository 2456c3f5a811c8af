"""The FSDP ledger of a train step: the parameters' all-gathers over dp
(ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1: parameters, gradients and Adam
state split over dp along the model dim). The gradients' sums over dp and cp,
FSDP's reduce-scatters among them, are `jaxtp.analysis.grads`'s; the loss
mean too.

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
from ..parallel import DATA_AXIS
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
    remat; a row per step (hoisted) and a row per microbatch (in a loop)."""
    m, M = cfg.model, cfg.train.microbatches
    shards = param_shards(cfg)
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    scanned, remat = m.scan_layers, m.remat != "none"
    split = [s for s in shards if s.dp_split]
    looped = lambda s: s.in_stack and scanned  # gathered per microbatch (and layer)
    # the vocab tables travel in the parameter dtype, every other weight in the
    # compute dtype (`jaxtp.model.layers.weight`): their forward gathers apart
    tables = sum(s.elements for s in split if s.region == "vocab")
    split = [s for s in split if s.region != "vocab"]
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
    rows = []
    if not either or pd != cd:
        rows.append(E("the vocab tables all-gathered (in their own dtype) for the lookup and "
                      "the head", "all-gather", "forward", tables, "step", pd))
    else:  # one total with the gathers whose pass is XLA's pick
        either += tables
    if either:  # which pass a gather is labelled with is XLA's pick: one total
        name = ("every dp-split parameter all-gathered for its forward use, block weights "
                f"again for the backward (remat {m.remat!r}), but shard_map's region kernels "
                "once for both passes")
        rows += [E(name, "all-gather", ANY_PASS, fwd["step"] + either, "step", cd),
                 E(name, "all-gather", ANY_PASS, fwd["microbatch"] + bwd, "microbatch", cd)]
        return [r for r in rows if r.elements]
    if outside:
        rows.append(E("parameters outside the regions all-gathered by GSPMD for their "
                      "forward use", "all-gather", "forward", outside, "step", cd,
                      written=False))
    name = "every dp-split parameter all-gathered for its forward use" + (
        " in its region" if outside else "")
    rows += [E(name, "all-gather", "forward", fwd["step"] - outside, "step", cd),
             E(name, "all-gather", "forward", fwd["microbatch"], "microbatch", cd),
             E(f"remat {m.remat!r}: block weights gathered again for the backward",
               "all-gather", "backward", bwd, "microbatch", cd)]
    return [r for r in rows if r.elements]

