"""Per-device memory and compute of a train step, and the planner.

Everything is read from the train step compiled ahead of time on abstract
shapes (nothing is allocated at full size), next to an analytic estimate:

- memory: `compiled.memory_analysis()` per device (arguments = parameters,
  optimizer state and batch; temporaries = activations and workspace;
  outputs) against parameters and Adam state divided by tp where sharded,
  and activations per layer from Korthikanti et al. 2022 (Eq. 2 and Table 2):
  `s*b*h*(10 + 24/t + 5*a*s/(h*t))` bytes with tensor parallelism,
  `s*b*h/t*(34 + 5*a*s/h)` with sequence parallelism. That count assumes
  16-bit activations, stored dropout masks and GELU; for this model scale it
  by bytes-per-activation/2 and read it as an estimate (no dropout masks
  when dropout is 0, SwiGLU stores a little more, XLA may fuse or keep
  more, e.g. the fp32 attention probabilities).
- compute: per-device flops from `compiled.cost_analysis()`; the redundancy
  factor `tp * flops(tp) / flops(tp=1)` (1.0 ideal: replicated norms,
  embeddings and losses push it up, sequence parallelism brings it down); and
  model flops per token, 6N + 12*L*h*s (`jaxtp.train.metrics`), for MFU.
- the roofline rule for tensor parallelism (Austin et al. 2025, "How to
  Scale Your Model", Training chapter): a matmul split over tp stays
  compute-bound while F / tp > C / W, C the chip's peak flops and W the
  bandwidth it drives along the tp axis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from .. import hlo, hlo_ops
from ..axes import AXIS, TABLE
from ..config import Config, ConfigError, validate
from ..parallel import mesh_for
from ..hardware import HARDWARE, TARGET_NAMES, model_flops_per_token
from ..model.build import resolve_attention
from ..sizes import activation_bytes, capacity, moe_activation_bytes
from .backends import on_backend
from .cp import cp_intensity
from .ep import expected_ep, slots
from .cluster import load
from .fit import dispatch_choice, name, smallest_fit
from .params import param_shards
from .predict import decode_lines, from_hlo, plan_lines, predict_config
from .rows import decided, per_step, schedule_of
from .plan_report import print_plan
from ..parallel.targets import CPU_OVERSTATES, TargetUnavailable, target_mesh

# Planning on CPU: XLA's CPU scheduler orders work for speed, and keeps more
# live than the memory-aware schedulers of the GPU and TPU compilers; its
# memory-optimized scheduler brings the CPU plan closer to them (llama3-8b,
# tp=8, SP, blockwise, minimal remat: 68.3 -> 50.5 GiB of temporaries; the
# H100 compile: 27.9).
CPU_PLAN_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def state_bytes(cfg: Config) -> dict[str, int]:
    """Per-device bytes of the parameters, their gradients and Adam's two
    moments, analytically: each parameter's elements divided by tp where it
    is split over tp and by dp where FSDP splits it (ZeRO-3, Rajbhandari et
    al. 2020, Sec. 5.1: every data-parallel rank keeps 1/N_d of each), in
    the parameter dtype (the gradients too) and fp32 for mu and nu."""
    dp = cfg.parallel.dp
    n = sum(s.elements // (dp if s.dp_split else 1) for s in param_shards(cfg))
    width = np.dtype(cfg.model.param_dtype).itemsize
    return {"params": n * width, "grads": n * width, "adam": n * 8}


def analyze(cfg: Config, mesh=None, *, compile_step: Callable) -> dict:
    """Compile the train step of `cfg` (abstract shapes, by `compile_step`:
    `jaxtp.train.step.compiled_step`) on `mesh` (default: this machine's CPU
    devices; or compile-only devices of an accelerator,
    `jaxtp.parallel.targets`) and account for it."""

    m, p, t = cfg.model, cfg.parallel, cfg.train
    t0 = time.perf_counter()
    # fake CPU devices: planning needs no accelerator, nor as many as tp
    mesh = decided(cfg)[0].mesh(devices=jax.devices("cpu")) if mesh is None else mesh
    mesh = mesh_for(mesh, p.impl)
    # a CPU plan stands in for an accelerator: its kernel choice, not the CPU's own
    cfg = resolve_attention(cfg, mesh.devices.flat[0], cpu_tuned=False)
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    state, compiled = compile_step(cfg, mesh, CPU_PLAN_OPTIONS if on_cpu else None)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()  # None for a compile-only GPU
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    text = compiled.as_text()
    colls = hlo.collectives(text)
    params = _per_device_bytes(state.params)
    opt = _per_device_bytes(state.opt_state)
    batch = (t.batch_size // (p.pp * p.dp * p.ep)) * (m.seq_len + 1) * 4
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    device = mesh.devices.flat[0]
    return {
        **dict(tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, dp=p.dp, fsdp=p.fsdp),
        "sp": p.sequence_parallel, "impl": p.impl,
        "compile_s": time.perf_counter() - t0,
        "n_params": n_params, "attention": cfg.model.attention, "remat": m.remat,
        "dtype": m.dtype, "loss_chunk": m.loss_chunk,
        "compiled_for": f"{device.platform} ({device.device_kind})",
        "memory": {
            "params": params, "optimizer": opt, "batch": batch,
            "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
            "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes,
            # outputs alias the donated parameters and optimizer state
            "total": mem.argument_size_in_bytes + mem.temp_size_in_bytes
            + mem.output_size_in_bytes - mem.alias_size_in_bytes,
        },
        "analytic_memory": {"params_plus_optimizer": params + opt,
                            "activations_korthikanti": activation_bytes(cfg),
                            # ZeRO-3's accounting (without FSDP: split over tp only)
                            "state": state_bytes(cfg)},
        "mesh": dict(mesh.shape),
        # each collective as the predictor prices it (jaxtp.analysis.predict)
        "traffic": [dataclasses.asdict(t) for t in from_hlo(colls, dict(mesh.shape))],
        "hbm_bytes": float(cost.get("bytes accessed", float("nan"))),
        "collectives_per_step": sum(c.count for c in colls),
        "collective_bytes_per_step": sum(c.count * c.bytes for c in colls),
        # the same bytes by the mesh axes each collective spans: what each link carries
        "collective_bytes_by_axis": {k: v["bytes"] for k, v in
                                     hlo.by_axis(colls, dict(mesh.shape)).items()},
        # loops at their trip counts (XLA's cost analysis reads a loop's body once)
        "flops_per_device": hlo_ops.flops(text),
        "xla_cost_analysis_flops": float(cost.get("flops", float("nan"))),
        "_hlo": None if on_cpu else text,  # priced op by op under --cluster
        "model_flops_per_token": model_flops_per_token(cfg, n_params),
        **({"moe": moe_facts(cfg, colls, device.platform)} if m.n_experts else {}),
    }


# the all-to-alls a MoE plan counts: the dense dispatch's and the ragged path's
A2A = ("all-to-all", "ragged-all-to-all")


def moe_facts(cfg: Config, colls, platform: str) -> dict:
    """A MoE step's own numbers per device: its experts (E/ep), the slots
    buffer per layer (E * G_r * C * D elements, `jaxtp.analysis.ep.slots`),
    what a MoE layer keeps (`moe_activation_bytes`), and the all-to-alls'
    bytes per step, compiled (over ep) and by the ep ledger as the compiler
    for `platform` carries it (XLA:CPU: bf16 slots in fp32)."""
    m, impl = cfg.model, cfg.parallel.impl
    ledger = per_step(on_backend(expected_ep(cfg, impl), cfg, impl, platform),
                      schedule_of(cfg))
    return {"experts_per_device": m.n_experts // cfg.parallel.ep,
            "capacity": capacity(m.seq_len, m.moe_top_k, m.n_experts, m.capacity_factor),
            "slots_bytes_per_layer": slots(cfg) * np.dtype(m.dtype).itemsize,
            "activations_per_layer": moe_activation_bytes(cfg),
            "all_to_all_bytes": sum(c.count * c.bytes for c in colls if c.kind in A2A),
            "all_to_all_ledger_bytes": sum(r.bytes * r.count for r in ledger if r.kind in A2A)}



def cp_sweep(n: int) -> list[int]:
    """The degrees `--plan --<axis> N` compiles: 1, the powers of two below
    N, and N (a degree the model does not split into is skipped, saying why)."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def planned_sweep(cfg: Config) -> tuple[str, list[int]] | None:
    """(the axis, its degrees) `--plan` sweeps: the innermost axis of the
    table with a sweep rule (`jaxtp.axes.Axis.sweep`) whose degree is above
    1, over `cp_sweep` of it, every other degree as given; None: a sweep
    over tp."""
    p = cfg.parallel
    swept = [a.name for a in TABLE if a.sweep and p.degrees[a.name] > 1]
    return (swept[-1], cp_sweep(p.degrees[swept[-1]])) if swept else None


def sweep_cases(cfg: Config, tps, sweep: tuple[str, list[int]] | None = None) -> list[dict]:
    """The degrees each row of a plan compiles: over tp (tp=1 the base), or
    over the swept axis (at 1 the base) as its table row says: "alone" at
    the largest of `tps`; "devices" at a fixed device count, the largest
    degree x the largest tp, tp taking what it leaves (ep's: every expert
    on every rank at the base, tp over the device count)."""
    tp = max(tps)
    if sweep is None:
        return [dict(tp=t) for t in sorted(set(tps) | {1})]
    axis, degrees = sweep
    degrees = sorted(set(degrees) | {1})
    if AXIS[axis].sweep == "alone":
        return [{axis: d, "tp": tp} for d in degrees]
    n = max(degrees) * tp
    return [{axis: d, "tp": n // d} for d in degrees if n % d == 0]


def plan(cfg: Config, tps, hardware: str = "h100", compile_for_target: bool = False,
         log: Callable[[str], None] = print, out_dir=None, sweep=None,
         cluster: str | None = None, *, compile_step: Callable) -> list[dict]:
    """Analyze `cfg` at each tp (or, with `sweep` = (axis, degrees), at each
    degree of that axis: `sweep_cases`; under pp every number per device is
    its stage's); print the table with a fits / does not fit verdict against
    `hardware`'s memory; return the rows (and, with `out_dir`, write them to
    plan.json).

    `compile_for_target`: compile for `hardware` itself (`jaxtp.parallel.targets`)
    where its compiler is installed; otherwise, or when it is not, compile for
    this machine's CPU, whose temporaries overstate an accelerator's.
    `cluster` (a preset or JSON file, `jaxtp.analysis.cluster`): also predict
    each row's step there (`jaxtp.analysis.predict`)."""
    target = HARDWARE[hardware]
    on_target = compile_for_target and _compiler_here(hardware, log)
    rows, cfgs, base = [], [], None
    swept = sweep[0] if sweep else None
    wanted = set(sweep[1]) if sweep else set(tps)
    cases = sweep_cases(cfg, tps, sweep)
    for i, degrees in enumerate(cases):
        par = dataclasses.replace(cfg.parallel, **degrees)
        if par.pp == 1:  # (no schedule without stages)
            par = dataclasses.replace(par, pp_schedule="gpipe", pp_repeats=1)
        c = dataclasses.replace(cfg, parallel=par if par.tp > 1 else par.without_sp())
        name = " ".join(f"{a}={d}" for a, d in degrees.items())
        try:
            validate(c)
        except ConfigError as e:
            log(f"{name}: skipped ({e})")
            continue
        log(f"[{i + 1}/{len(cases)}] compiling the train step at {name} for "
            f"{hardware if on_target else 'CPU'} (abstract shapes) ...")
        mesh = target_mesh(hardware, **c.parallel.degrees) if on_target else None
        r = analyze(c, mesh, compile_step=compile_step)
        # the base: the swept axis at 1 (a sweep at fixed devices keeps their count: x 1)
        split = degrees[swept or "tp"]
        base = r["flops_per_device"] if split == 1 else base
        _verdict(r, c, 1 if swept and AXIS[swept].sweep == "devices" else split, base, target)
        if split in wanted:
            rows.append(r)
            cfgs.append(c)
    if not rows:
        log(f"no valid tp among {sorted(tps)}")
        return rows
    print_plan(cfg, rows, target, swept, log)
    if cfg.model.n_experts:  # (a fine-grained MoE: which dispatch, by the accelerator's compile)
        rows[-1]["dispatch"] = dispatch_choice(
            cfgs[-1], rows[-1], (lambda c: analyze(c, target_mesh(
                hardware, **c.parallel.degrees), compile_step=compile_step)) if on_target
            else None, log)
    if cluster and not any(r["fits"] for r in rows):
        rows[0]["smallest_fit"] = _search(cfgs[-1], cluster, log, compile_step)
    _report(cfg, rows, cfgs, hardware, target, on_target, cluster, out_dir, log)
    return rows


def _search(cfg: Config, cluster: str, log, compile_step) -> dict | None:
    """Where no planned layout fits: the fewest of `cluster`'s devices
    that hold the step, and the layout (`jaxtp.analysis.fit`), compiled for
    its accelerator where that compiler is here (else CPU, whose
    temporaries overstate); its prediction on the cluster."""
    c0 = load(cluster)
    hw = c0.accelerator.name if c0.accelerator.name in HARDWARE else None
    memory = HARDWARE[hw].memory if hw and HARDWARE[hw].memory else c0.accelerator.memory
    here = bool(hw) and hw in TARGET_NAMES and _compiler_here(hw, log)
    counts = [n for n in (2 ** i for i in range(1, 31))
              if cfg.parallel.devices < n <= c0.devices]
    log(f"no layout above fits {c0.accelerator.name}'s {memory / 2**30:,.1f} GiB: the fewest "
        f"of {c0.name}'s {c0.devices} devices that hold the step, compiled for "
        f"{hw if here else 'CPU'} ...")
    mesh = lambda c: target_mesh(hw, **c.parallel.degrees) if here else None
    found = smallest_fit(cfg, counts, c0.devices_per_node, memory,
                         lambda c: sum(state_bytes(c).values()),
                         lambda c: analyze(c, mesh(c), compile_step=compile_step), log,
                         speed=lambda c: _step_s(c, c0))
    if found is None:
        log(f"no layout of up to {c0.devices} devices fits: a larger cluster, "
            "model.moe_slots=resend, or a smaller batch")
        return None
    n, c, r = found
    nodes = -(-n // c0.devices_per_node)
    log(f"smallest that fits: {n} {c0.accelerator.name} ({nodes} node{'s' * (nodes > 1)} "
        f"of {c0.devices_per_node}) at {name(c)}, {r['memory']['total'] / 2**30:,.1f} GiB a "
        f"device of {memory / 2**30:,.1f} (compiled for {r['compiled_for']})")
    for line in plan_lines(r, c, c0):
        log("  " + line)
    return {"devices": n, "layout": name(c), **{k: r[k] for k in ("memory", "mesh")}}


def _report(cfg, rows, cfgs, hardware, target, on_target, cluster, out_dir, log) -> None:
    """What follows a plan's table: the CPU's caveat, the cluster's
    predictions, plan.json."""
    if not on_target:
        log("compiled for CPU: XLA's CPU temporaries overstate a GPU compile's (measured "
            + ", ".join(f"{v:g}x for {k}" for k, v in CPU_OVERSTATES.items())
            + f"); --hardware {hardware} compiles for it where "
            + ("jax[tpu]" if target.platform == "tpu" else "jax[cuda12]") + " is installed")
    if cluster:
        for line in [x for r, c in zip(rows, cfgs) for x in plan_lines(r, c, cluster)] \
                + decode_lines(cfg, cluster):
            log(line)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        (out / "plan.json").write_text(json.dumps(public, indent=2) + "\n")
        log(f"wrote {out / 'plan.json'}")


def _step_s(cfg: Config, cluster) -> float:
    """`cfg`'s step on `cluster` by its ledger, communication exposed."""
    return predict_config(cfg, cluster)["exposed"]["step_s"]


def _compiler_here(hardware: str, log) -> bool:
    """Whether `hardware`'s compiler is installed here (else say so: CPU plans)."""
    try:
        target_mesh(hardware, 1, 1)
    except TargetUnavailable as e:
        log(f"{e}: planning on CPU instead")
        return False
    return True


def _verdict(r: dict, cfg: Config, split: int, base: float | None, target) -> None:
    """Add to an `analyze` row: redundancy against the base row (`split`
    times its devices: tp=1, or in a cp sweep cp=1), the F/tp against C/W
    bound, the cp roofline, and whether it fits the target's memory."""
    tp, m = cfg.parallel.tp, cfg.model
    F = m.expert_d_ff if m.n_experts else m.d_ff  # (a MoE's MLPs are its experts)
    r["redundancy"] = split * r["flops_per_device"] / base if base else float("nan")
    r["f_over_tp"] = F / tp
    r["bound"] = ("-" if tp == 1 else "compute"
                  if F / tp > target.peak_flops / target.link else "communication")
    r["cp_flops_per_kv_byte"] = cp_intensity(cfg)
    r["target"] = target.name
    r["target_memory"] = target.memory
    r["fits"] = r["memory"]["total"] <= target.memory
