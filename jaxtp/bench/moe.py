"""The `moe` section of the benchmark suite: the expert-parallel all-to-alls'
bytes per step against the capacity factor, read from each compiled step
(`jaxtp.hlo`) beside the ep ledger's (`jaxtp.analysis.ep`). Compile only:
nothing runs."""

from __future__ import annotations

from .. import hlo
from ..analysis.ep import expected_ep, slots
from ..analysis.rows import per_step, schedule_of
from ..model.moe import capacity
from ..parallel import EP_AXIS
from ..train.state import decide
from ..train.step import compiled_step
from .cases import _case, preset
from .report import section

# the capacity factors compared (0: dropless, C = s) and the layout
FACTORS = (1.0, 1.25, 2.0, 0.0)
EP, TP = 4, 2


def all_to_all_bytes(cfg) -> tuple[int, int]:
    """(compiled, ledger): the all-to-alls' bytes per step over ep, of `cfg`'s
    train step compiled on this machine's devices, and by the ep ledger."""
    mesh = decide(cfg)[2]
    _, step = compiled_step(cfg, mesh)
    sizes = dict(mesh.shape)
    got = sum(c.count * c.bytes for c in hlo.collectives(step.as_text())
              if c.kind == "all-to-all" and c.axes(sizes) == (EP_AXIS,))
    want = sum(r.bytes * r.count for r in per_step(expected_ep(cfg), schedule_of(cfg)))
    return got, want


def bench_moe(plan: dict, log=print, factors=FACTORS) -> dict:
    """moe-tiny at ep 4 x tp 2 at each capacity factor in `factors`: the
    compiled step's all-to-all bytes per step against the ep ledger's, and
    against cf = 1's (GShard's capacity C = ceil(cf * s * k / E): the bytes
    follow C, dropless E/k times cf 1's)."""
    rows, base = [], None
    for i, cf in enumerate(factors, 1):
        log(f"moe {i}/{len(factors)}: moe-tiny ep={EP} tp={TP} capacity factor {cf:g}")
        cfg, cut = preset("moe-tiny", f"parallel.ep={EP}", f"parallel.tp={TP}",
                          f"model.capacity_factor={cf}", *plan["small"])
        got, want = all_to_all_bytes(cfg)
        m = cfg.model
        base = got if cf == 1.0 else base
        name = f"moe-tiny ep={EP} tp={TP} cf={cf:g}" + (" dropless" if cf <= 0 else "")
        rows.append({"case": _case(name, cfg, cut),
                     "measured": "all-to-all bytes per step / cf=1", "unit": "ratio",
                     "value": got / base if base else None, "factor": cf,
                     "capacity": capacity(m.seq_len, m.moe_top_k, m.n_experts, cf),
                     "slots": slots(cfg), "compiled_bytes": got, "ledger_bytes": want})
    return section("moe", "Expert parallelism: all-to-all bytes against the capacity factor",
                   [("case", "case"), ("capacity", "C"), ("slots", "E*G_r*C*D per layer"),
                    ("compiled_bytes", "compiled B per step"), ("ledger_bytes", "ledger B"),
                    ("value", "/ cf=1")], rows, [
        "compiled only (abstract shapes): the train step's all-to-alls over ep, read from its "
        "HLO (jaxtp.hlo), full buffers per step, beside the ep ledger's (jaxtp.analysis.ep: "
        "2 forward and 2 backward per MoE layer, E*G_r*C*D elements each per rank)",
        "C = ceil(cf * s * k / E) slots per expert and sequence (GShard); cf 0 is dropless, "
        "C = s: E/k times cf 1's bytes"])
