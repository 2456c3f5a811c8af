"""The planner's report (`jaxtp.analysis.plan.plan`): its table of memory,
collectives and compute per layout, and the lines that read it."""

from __future__ import annotations

import dataclasses

from ..axes import CP_AXIS, PP_AXIS
from ..config import Config
from ..sizes import activation_bytes, korthikanti_terms


def _gib(b: float) -> str:
    return f"{b / 2**30:,.2f} G" if b >= 2**30 else f"{b / 2**20:,.1f} M"


def _num(x: float, f: str) -> str:
    return "-" if x != x else f.format(x)  # NaN: no cost analysis


def print_plan(cfg: Config, rows: list[dict], target, swept: str | None, log) -> None:
    """The plan's table (a row per compiled layout, `swept` the axis its
    rows vary beside tp, None for tp alone) and the lines under it."""
    gib = _gib
    name = lambda r: f"{swept}={r[swept]} tp={r['tp']}" if swept else f"tp={r['tp']}"
    log(_headline(cfg, rows[0], swept == PP_AXIS))
    for line in _table(rows, swept):
        log(line)
    log("B: bytes per device (M = MiB, G = GiB); temps from memory_analysis, acts est. "
        "from Korthikanti et al. 2022; collectives counted per step from the HLO")
    log("coll. B by mesh axis: " + "; ".join(
        f"{name(r)}: " + (", ".join(f"{a} {gib(b)}" for a, b in
                                    r["collective_bytes_by_axis"].items()) or "none")
        for r in rows))
    log(("ZeRO-3 (Rajbhandari et al. 2020)" if cfg.parallel.fsdp else "state")
        + " per device, analytic: " + "; ".join(
            f"{name(r)}: params {gib(z['params'])}, grads {gib(z['grads'])}, Adam "
            f"{gib(z['adam'])} (measured params {gib(r['memory']['params'])}, optimizer "
            f"{gib(r['memory']['optimizer'])})"
            for r in rows for z in [r["analytic_memory"]["state"]]))
    log(korthikanti_terms(cfg))
    if any(r["pp"] > 1 for r in rows):
        log(_schedules(cfg, rows, name))
    m = cfg.model
    if m.n_experts:
        log(f"MoE ({m.n_experts} experts, top {m.moe_top_k}, capacity factor "
            f"{m.capacity_factor:g}{' (dropless)' if m.capacity_factor <= 0 else ''}) per "
            "device: " + "; ".join(
                f"{name(r)}: {f['experts_per_device']} "
                f"experts, C = {f['capacity']} slots per expert and sequence, slots buffer "
                f"E*G_r*C*D {gib(f['slots_bytes_per_layer'])} per layer, a MoE layer keeps "
                f"{gib(f['activations_per_layer'])} (est.), all-to-alls "
                f"{gib(f['all_to_all_bytes'])} per step compiled, "
                f"{gib(f['all_to_all_ledger_bytes'])} by the ep ledger"
                for r in rows for f in [r["moe"]]))
        kept = [r for r in rows if r["ep"] > 1 and not r["fits"] and m.moe_slots == "keep"
                and m.remat in ("minimal", "dots") and m.moe_dispatch == "dense"]
        if kept:  # (the rule: keep them while the step fits; else memory is the bound)
            log(f"the slots {m.remat} remat keeps (2 buffers a MoE layer: " + ", ".join(
                f"{name(r)} {gib(2 * r['moe']['slots_bytes_per_layer'] * m.n_moe_layers)}"
                for r in kept) + ") where the step does not fit: model.moe_slots=resend "
                "drops them for 2 all-to-alls a layer sent again in the backward")
    if swept == CP_AXIS:
        log(f"cp roofline (attention flops per K/V byte received, per layer; hidden while > "
            f"C/W = {target.peak_flops / target.link:,.0f} for {target.name}): " + ", ".join(
                f"cp={r['cp']} {r['cp_flops_per_kv_byte']:,.0f}" for r in rows if r["cp"] > 1))
    _verdicts(rows, target, name, log)


def _schedules(cfg: Config, rows: list[dict], name) -> str:
    """Each pipeline schedule's activations per device (stage 0's, the
    Korthikanti estimate of `jaxtp.sizes.activation_bytes`) at each row's
    pp and tp: the row's own schedule is the one compiled."""
    def acts(r, schedule, v):
        p = dataclasses.replace(cfg.parallel, pp=r["pp"], tp=r["tp"], pp_schedule=schedule,
                                pp_repeats=v)
        M, L = cfg.train.microbatches, cfg.model.n_layers
        if L % (r["pp"] * v) or schedule in ("interleaved", "zb") and v > 1 and M % r["pp"]:
            return "-"
        return _gib(activation_bytes(dataclasses.replace(cfg, parallel=p)))
    kinds = [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved", 2), ("zb", 1),
             ("zb", 2)]
    return ("activations per device by schedule (est.; stage 0 holds M microbatches under "
            "gpipe and circular, 2p - 1 under 1f1b, v*p + p - 1 chunks interleaved; zb "
            "interleaved's and p chunks' weight-matmul cotangents): " + "; ".join(
                f"{name(r)}: " + ", ".join(f"{s}{f' v={v}' if v > 1 else ''} {acts(r, s, v)}"
                                           for s, v in kinds)
                for r in rows if r["pp"] > 1))


def _headline(cfg: Config, r0: dict, pp: bool) -> str:
    m, p = cfg.model, cfg.parallel
    return (f"plan: {m.style} {r0['n_params']:,} params, L={m.n_layers} h={m.d_model} "
            f"F={m.d_ff} heads={m.n_heads}/{m.kv_heads} kv, batch {cfg.train.batch_size} x seq "
            f"{m.seq_len}, {m.dtype}, sp={p.sp}, impl={p.impl}, "
            + (f"dp={p.dp}, " if p.dp > 1 else "") + ("fsdp, " if p.fsdp else "")
            + f"attention={r0['attention']}, remat={m.remat}"
            + (f", loss_chunk={m.loss_chunk}" if m.loss_chunk else "")
            + (f", pp ({p.pp_schedule}, M={cfg.train.microbatches}, L/pp layers per stage: "
               "every number per device is its stage's; acts est. the microbatches a stage "
               "holds at once)" if pp else "")
            + f"; compiled for {r0['compiled_for']}")


def _table(rows: list[dict], swept: str | None) -> list[str]:
    label = lambda r: f"{swept}={r[swept]} tp={r['tp']}" if swept else str(r["tp"])
    gib = _gib
    head = [f"{swept}, tp" if swept else "tp", "params B", "optim B", "temps B", "total B", "fits",
            "acts est. B", "collectives", "coll. B", "GFLOP/dev", "redundancy", "F/tp", "bound"]
    table = [head] + [[
        label(r), gib(r["memory"]["params"]), gib(r["memory"]["optimizer"]),
        gib(r["memory"]["temporaries"]), gib(r["memory"]["total"]),
        "yes" if r["fits"] else "NO",
        gib(r["analytic_memory"]["activations_korthikanti"]), str(r["collectives_per_step"]),
        gib(r["collective_bytes_per_step"]), _num(r["flops_per_device"] / 1e9, "{:,.1f}"),
        _num(r["redundancy"], "{:.3f}"), f"{r['f_over_tp']:,.0f}", r["bound"]] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]


def _verdicts(rows: list[dict], target, name, log) -> None:
    verdicts = ", ".join(f"{name(r)} {r['memory']['total'] / 2**30:,.1f} GiB "
                         + ("fits" if r["fits"] else "does not fit") for r in rows)
    log(f"{target.name}: {target.memory / 2**30:,.1f} GiB per device: {verdicts}")
    if target.platform == "cuda" and any(r["fits"] and r["memory"]["total"] > 0.75 *
                                         target.memory for r in rows):
        log("note: JAX's GPU allocator takes 75% of the memory by default; above that set "
            "XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.95)")
    r0 = rows[0]
    log(f"{target.name}: C = {target.peak_flops / 1e12:g} TFLOP/s, W = {target.link / 1e9:g} "
        f"GB/s along tp, C/W = {target.peak_flops / target.link:,.0f}: tp is compute-bound "
        f"while F/tp > C/W. Model flops per token 6N + 12Lhs = "
        f"{r0['model_flops_per_token']:.3e}.")
