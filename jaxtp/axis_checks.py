"""Each parallel axis's own checks, keyed by the axis table's names
(`jaxtp.axes`): what a layout with that axis above 1 needs, and what is not
built with it yet. Each returns the ConfigError's message, or None;
`jaxtp.checks` raises it (this module imports nothing of jaxtp: the config's
checks read it). A new axis adds its function here and a line to `CHECKS`."""

from __future__ import annotations

import math

from .axes import CP_AXIS, EP_AXIS, PP_AXIS


def _layers_split(m, p) -> str | None:
    """Whole layers (groups of moe_every) per stage and repeat, of the stack
    (a leading dense run, model.moe_first_dense, runs before the stages)."""
    k = m.layer_group
    chunks, S = p.pp * p.pp_repeats * k, m.stacked_layers
    if not S % chunks:
        return None
    ok = [n for n in range(2, S + 1) if S % (n * p.pp_repeats * k) == 0]
    groups = f" in groups of model.moe_every={k}" if k > 1 else ""
    lead = m.n_layers - S
    after = f" ({S} after model.moe_first_dense={lead})" if lead else ""
    return (f"pipeline parallelism splits model.n_layers={m.n_layers}{after} evenly over "
            f"pp={p.pp} stages x {p.pp_repeats} repeat(s){groups}; valid --pp here: "
            f"{ok or 'none'}, or set model.n_layers to {f'{lead} + ' if lead else ''}a "
            f"multiple of {chunks}")


def pp(cfg) -> str | None:
    """What a pipeline needs: whole layers per stage, at least as many
    microbatches as stages, and the parts built for it so far."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.pp == 1:
        if p.pp_repeats != 1:
            return (f"parallel.pp_repeats={p.pp_repeats} repeats pipeline stages, and "
                    "parallel.pp=1 has none: add --pp N, or drop pp_repeats")
        return None
    split = _layers_split(m, p)
    if split:
        return split
    if t.microbatches < p.pp:
        return (
            f"train.microbatches={t.microbatches} is below pp={p.pp}: a pipeline keeps every "
            f"stage busy only with at least one microbatch per stage; set --microbatches "
            f"{2 * p.pp} (the default with --pp {p.pp}) or more")
    chunked = p.pp_schedule in ("circular", "interleaved")
    if p.pp_schedule != "zb" and chunked != (p.pp_repeats > 1):
        return (
            f"parallel.pp_repeats={p.pp_repeats} with parallel.pp_schedule={p.pp_schedule!r}: "
            "the circular and interleaved schedules run v >= 2 chunks per stage (at v = 1 "
            "they are gpipe and 1f1b), gpipe and 1f1b one; set parallel.pp_repeats=2 with "
            "circular or interleaved, or parallel.pp_repeats=1 with gpipe or 1f1b (zb: any)")
    if p.pp_stash != "residuals" and p.pp_schedule not in ("1f1b", "interleaved"):
        return (f"parallel.pp_stash={p.pp_stash!r} chooses what 1f1b and interleaved keep for "
                f"a stage's backward; {p.pp_schedule} keeps "
                + ("the residuals its split backward reads" if p.pp_schedule == "zb" else
                   "what autodiff keeps") + ": drop it, or use --pp-schedule 1f1b")
    if p.pp_schedule in ("interleaved", "zb") and p.pp_repeats > 1 and t.microbatches % p.pp:
        return (f"the {p.pp_schedule} schedule over pp_repeats={p.pp_repeats} chunks runs "
                f"microbatches in groups of pp={p.pp} "
                f"(Megatron's order): train.microbatches={t.microbatches} is not a multiple; "
                f"set --microbatches {p.pp * max(1, t.microbatches // p.pp)}")
    if m.attention == "cudnn" and p.impl == "gspmd":
        return ("model.attention='cudnn' does not run in a pipeline under --impl "
                "gspmd (jax 0.10.2: cuDNN's custom partitioning fails in a shard_map "
                "that leaves tp to GSPMD); use model.attention=blockwise (auto picks "
                "it there), or --impl shard_map")
    if p.cp > 1 and p.impl == "gspmd" and p.cp_attention == "allgather":
        return ("pipeline parallelism with --cp under --impl gspmd takes "
                "parallel.cp_attention=ring: a stage is manual over cp, and GSPMD "
                "gathers the K/V heads over tp before an all-gather over cp (twice "
                "the bytes, measured on jax 0.10.2); or use --impl shard_map")
    unbuilt = [(p.impl == "explicit", "--impl explicit (use gspmd or shard_map)"),
               (m.dropout > 0, "model.dropout > 0"),
               (p.overlap != "none", f"--overlap {p.overlap}")]
    for cond, what in unbuilt:
        if cond:
            return f"pipeline parallelism (--pp) is not built for {what} yet"
    return None


def cp(cfg) -> str | None:
    """What context parallelism needs: a sequence of whole chunks per rank
    (2cp chunks under causal balance, cp without), each split again over tp
    under SP, and the parts built for it."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return None
    tp_sp = p.tp if p.sp and p.tp > 1 else 1
    need = lambda cp: 1 if cp == 1 else math.lcm(2 * cp if p.cp_balance else cp, cp * tp_sp)
    if m.seq_len % need(p.cp):
        ok = [c for c in range(1, 65) if m.seq_len % need(c) == 0]
        what = (f"{2 * p.cp} chunks (rank r holds chunks r and 2cp-1-r)" if p.cp_balance
                else f"{p.cp} chunks")
        sp = f", each rank's part split again over tp={p.tp} (SP)" if tp_sp > 1 else ""
        return (
            f"context parallelism splits model.seq_len={m.seq_len} into {what}{sp}; valid "
            f"--cp here: {ok}, or set model.seq_len to a multiple of {need(p.cp)}")
    if m.attention == "cudnn":
        return ("model.attention='cudnn' does not run under --cp: cuDNN's fused "
                "attention returns no log-sum-exp to merge the cp ranks' parts "
                "by; use model.attention=blockwise (or xla, or auto)")
    if p.overlap != "none":
        return (f"parallel.overlap={p.overlap!r} is not built for --cp yet: use "
                "--overlap none with --cp")
    return None


def ep(cfg) -> str | None:
    """The layouts a mixture of experts is not built for (yet), or refuses."""
    m, p = cfg.model, cfg.parallel
    split = [what for cond, what in ((p.cp > 1, f"--cp {p.cp}"), (p.sp and p.tp > 1, "--sp"))
             if cond]
    if split and m.capacity_factor:
        return (
            f"{' and '.join(split)} split{'' if len(split) > 1 else 's'} each sequence, and "
            "a MoE rank routes its own part "
            f"of one; model.capacity_factor={m.capacity_factor} counts capacity per "
            "sequence, so the drops would depend on the split: set model.capacity_factor=0 "
            "(dropless: the same result at every layout)")
    unbuilt = [(p.impl == "explicit" and m.moe_dispatch == "ragged",
                "--impl explicit with model.moe_dispatch='ragged' (use gspmd or shard_map)"),
               (p.impl == "explicit" and (bool(split) or p.pp > 1),
                f"--impl explicit with {' and '.join(split) or '--pp'} (use gspmd or "
                "shard_map)"),
               (bool(split) and m.moe_dispatch == "ragged",
                f"model.moe_dispatch='ragged' with {' and '.join(split)}"),
               (p.pp > 1 and p.sp and p.tp > 1 and p.impl == "gspmd", "--sp in a pipeline under "
                "--impl gspmd (GSPMD gathers the slots over tp before they travel over ep: "
                "use --impl shard_map)")]
    for cond, what in unbuilt:
        if cond:
            return (f"the mixture of experts (model.n_experts > 0) is not built "
                    f"for {what} yet")
    return None


# (ep's: a mixture of experts' layouts, checked with the model's MoE keys)
CHECKS = {PP_AXIS: pp, CP_AXIS: cp, EP_AXIS: ep}
