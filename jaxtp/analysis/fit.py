"""The fewest devices a train step fits on, and its layout there: what
`--plan --cluster` says of a model no layout of its own devices holds
(a MoE whose weights, gradients and Adam state alone outgrow a node).

The search doubles the device count n from twice the plan's up to the
cluster's. At each n the layouts are pp x dp x ep x tp = n with tp and ep
inside a node (tp x ep <= devices per node: tp's all-reduces and ep's
all-to-alls on the node's own links, where Megatron-Core and DeepSeek-V3
place their expert parallelism's all-to-alls too; arXiv 2412.19437, Sec.
3.2) and FSDP over dp (ZeRO-3: each rank keeps 1/dp of every parameter and
its state; Rajbhandari et al. 2020). A layout whose analytic floor
(`jaxtp.analysis.plan.state_bytes`, per device) is already past the
memory is dropped uncompiled; the rest are ranked by that floor plus
Korthikanti et al.'s activation count (`jaxtp.sizes.activation_bytes`,
which ignores remat: an order, not a size), and the `per_count` first are
compiled (abstract shapes, for the cluster's accelerator where its
compiler is installed) and held to the memory the compiler says they
take. At the first n where one fits, as many of the layouts predicted
fastest on the cluster (`jaxtp.analysis.predict`) are compiled too, and
the fastest that fits is named.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import Config, ConfigError, validate
from ..sizes import ITEMSIZE, activation_bytes, capacity, param_count

# layouts compiled at each device count: the ranking's first three
PER_COUNT = 3


def _powers(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]


def layouts(cfg: Config, n: int, per_node: int) -> list[Config]:
    """Every valid layout of `cfg` on `n` devices the search considers:
    pp x dp x ep x tp = n, tp x ep <= `per_node`, FSDP over dp > 1 (no cp,
    the config's SP where tp > 1; under pp at least pp microbatches)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = []
    for pp in _powers(n):
        for tp in _powers(per_node):
            for ep in _powers(min(per_node // tp, m.n_experts or 1)):
                dp, rest = divmod(n, pp * tp * ep)
                if rest or not dp:
                    continue
                par = dataclasses.replace(p, pp=pp, dp=dp, ep=ep, tp=tp, cp=1, fsdp=dp > 1)
                if pp == 1:
                    par = dataclasses.replace(par, pp_schedule="gpipe", pp_repeats=1)
                train = dataclasses.replace(t, microbatches=max(t.microbatches, pp)) \
                    if pp > 1 else t
                c = dataclasses.replace(cfg, parallel=par if tp > 1 else par.without_sp(),
                                        train=train)
                try:
                    validate(c)
                except ConfigError:
                    continue
                out.append(c)
    return out


def name(c: Config) -> str:
    """A layout as the report writes it: pp x ep x FSDP x tp."""
    p = c.parallel
    parts = [f"pp={p.pp}"] * (p.pp > 1) + [f"ep={p.ep}"] * (p.ep > 1) \
        + [f"fsdp={p.dp}" if p.fsdp else f"dp={p.dp}"] * (p.dp > 1) + [f"tp={p.tp}"]
    return " x ".join(parts)


def estimate(c: Config, floor: float) -> float:
    """A layout's memory a device for ranking: its analytic `floor`, the
    Korthikanti activations and, under pp with FSDP, the stage's weights
    gathered whole for the step (`jaxtp.parallel.pipeline`)."""
    p, m = c.parallel, c.model
    held = param_count(c) * ITEMSIZE[m.param_dtype] // (p.pp * p.tp) \
        if p.pp > 1 and p.fsdp else 0
    return floor + activation_bytes(c) + held


def smallest_fit(cfg: Config, counts: list[int], per_node: int, memory: float,
                 floor: Callable[[Config], float], measure: Callable[[Config], dict],
                 log: Callable[[str], None] = print, per_count: int | None = PER_COUNT,
                 speed: Callable[[Config], float] | None = None):
    """(n, the layout's config, its `measure` row) of the first device count
    in `counts` at which a layout's compiled total fits `memory` bytes;
    None where none does. `floor(c)`: a layout's analytic floor a device;
    `measure(c)`: its `jaxtp.analysis.plan.analyze` row (compiled).
    `per_count` (None: all) layouts are compiled at each count, the
    shallowest pipeline and least `estimate` first (jaxtp's GPipe keeps
    every microbatch's activations, and under FSDP the stage's weights
    whole); where one fits, with `speed(c)` (a predicted step) as many of
    the fastest too, at no deeper a pipeline, and the fastest that fits is
    named (without `speed`, the one of least memory)."""
    for n in counts:
        cands = [(floor(c), c) for c in layouts(cfg, n, per_node)]
        # (pipelines last: jaxtp's GPipe keeps every microbatch's activations)
        ranked = sorted(((estimate(c, f), c) for f, c in cands if f <= memory),
                        key=lambda x: (x[1].parallel.pp, x[0]))
        held = [c for _, c in ranked]
        if not held:
            least = min((f for f, _ in cands), default=float("nan"))
            log(f"{n} devices: no layout's floor fits (parameters, gradients and Adam "
                f"{least / 2**30:,.1f} GiB a device at least), none compiled")
            continue
        log(f"{n} devices: {len(cands)} layouts, {len(held)} whose floor fits; compiling "
            f"{min(len(held), per_count or len(held))} of least estimated memory ...")
        fits = _try(held[:per_count], measure, memory, log)
        if fits and speed is not None:  # (the rest as deep a pipeline as a fit at most)
            pp = max(f[1].parallel.pp for f in fits)
            fast = sorted((c for c in held[per_count or len(held):] if c.parallel.pp <= pp),
                          key=speed)[:per_count]
            log(f"{n} devices: compiling the {len(fast)} others predicted fastest ...")
            fits += _try(fast, measure, memory, log)
        if fits:
            _, c, r = min(fits, key=lambda x: (speed(x[1]) if speed else 0, x[0]))
            return n, c, r
    return None


def _try(cands: list[Config], measure, memory: float, log) -> list[tuple]:
    """(total, config, row) of each of `cands` whose compiled total fits."""
    fits = []
    for i, c in enumerate(cands):
        r = measure(c)
        total = r["memory"]["total"]
        log(f"  [{i + 1}/{len(cands)}] {name(c)}: {total / 2**30:,.1f} GiB a device, "
            f"{'fits' if total <= memory else 'does not fit'}")
        if total <= memory:
            fits.append((total, c, r))
    return fits


def dispatch_ratio(cfg: Config) -> float:
    """The dense dispatch's einsums over the experts' matmuls, per token:
    dispatch and combine each 2*E*C*D FLOPs a token ([T, E, C] one-hots
    against [T, D]; GShard, Lepikhin et al. 2020, Sec. 2.2) against the k
    experts' 2*n*D*F (n = 3 matmuls gated, 2 not): 2*E*C / (n*k*F)."""
    m = cfg.model
    C = capacity(m.seq_len, m.moe_top_k, m.n_experts, m.capacity_factor or 1.0)
    n = 3 if m.style == "llama" else 2
    return 2 * m.n_experts * C / (n * m.moe_top_k * m.expert_d_ff)


def dispatch_choice(cfg: Config, row: dict, measure: Callable[[Config], dict] | None,
                    log: Callable[[str], None] = print) -> str:
    """For a fine-grained MoE (`dispatch_ratio` above 1: the dense
    dispatch costs more than the experts it feeds), compile the other
    dispatch at `cfg`'s layout and name the one of less compiled memory
    (the ragged path is dropless: capacity 0); the config's own otherwise,
    and where there is no accelerator's compile (`measure` None: XLA:CPU
    compiles no ragged all-to-all) say so."""
    m = cfg.model
    ratio = dispatch_ratio(cfg)
    if not m.n_experts or ratio <= 1:
        return m.moe_dispatch
    other = "ragged" if m.moe_dispatch == "dense" else "dense"
    if measure is None:
        log(f"dispatch: the dense dispatch's einsums cost {ratio:.2f}x the experts' matmuls "
            f"(2EC/(nkF)); --hardware compiles model.moe_dispatch={other} beside it")
        return m.moe_dispatch
    c = dataclasses.replace(cfg, model=dataclasses.replace(
        m, moe_dispatch=other, capacity_factor=0.0 if other == "ragged" else
        (m.capacity_factor or 1.0)))
    log(f"dispatch: the dense dispatch's einsums cost {ratio:.2f}x the experts' matmuls "
        f"(2EC/(nkF)); compiling model.moe_dispatch={other} at the last layout ...")
    r = measure(c)
    mine, theirs = row["memory"]["total"], r["memory"]["total"]
    pick = other if theirs < mine else m.moe_dispatch
    log(f"dispatch: {m.moe_dispatch} {mine / 2**30:,.1f} GiB a device, {other} "
        f"{theirs / 2**30:,.1f} GiB ({r['compiled_for']}): model.moe_dispatch={pick}"
        + (" (dropless: model.capacity_factor=0)" if pick == "ragged" else ""))
    return pick
