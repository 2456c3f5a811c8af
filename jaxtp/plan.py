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
  model flops per token, 6N + 12*L*h*s (Chowdhery et al. 2022, App. B), for
  MFU.
- the roofline rule for tensor parallelism (Austin et al. 2025, "How to
  Scale Your Model", Training chapter): a matmul split over tp stays
  compute-bound while F / tp > C / W, C the chip's peak flops and W the
  bandwidth it drives along the tp axis.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import numpy as np

from . import hlo
from .config import Config

# peak dense bf16 FLOP/s, and W: bytes/s one chip moves along the tp axis.
HARDWARE = {
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense; NVLink 4: 900 GB/s
    # bidirectional, so 450 GB/s each way.
    "h100": (989e12, 450e9),
    # NVIDIA H200 SXM datasheet: same compute and NVLink as H100.
    "h200": (989e12, 450e9),
    # Google Cloud TPU v5p: 459 TFLOP/s bf16; ICI 9e10 B/s per link each way,
    # a ring along one torus axis uses both directions: 1.8e11 (Austin et al.).
    "tpu-v5p": (459e12, 1.8e11),
}


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def activation_bytes(cfg: Config) -> float:
    """Korthikanti et al. 2022 activation memory of all layers, per device."""
    m, t = cfg.model, cfg.parallel.tp
    s, b, h, a = m.seq_len, cfg.train.batch_size // cfg.parallel.dp, m.d_model, m.n_heads
    if cfg.parallel.sp:
        per_layer = s * b * h / t * (34 + 5 * a * s / h)
    else:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return m.n_layers * per_layer * np.dtype(m.dtype).itemsize / 2


def korthikanti_terms(cfg: Config) -> str:
    """Which terms of the Korthikanti et al. activation count apply to this model."""
    m = cfg.model
    return (f"Korthikanti terms for this model: activations {m.dtype} (estimate scaled by "
            f"{np.dtype(m.dtype).itemsize / 2:g} from 16-bit); residual/MLP dropout masks "
            f"(2sbh per block) {'kept' if m.dropout > 0 else 'absent (dropout=0)'}; attention "
            "dropout (as^2b mask + 2as^2b output of the 5as^2b) absent: jaxtp has none; "
            + ("SwiGLU keeps gate and up (more than the GELU count)" if m.style == "llama"
               else "GELU MLP as counted"))


def model_flops_per_token(cfg: Config, n_params: int) -> float:
    """6N + 12*L*h*s: matmul flops of forward and backward per token. N counts
    the parameters that multiply: not the input lookup table (when untied
    from the LM head) nor learned positions."""
    m = cfg.model
    lookup = (0 if m.tie_embeddings else m.padded_vocab * m.d_model) + \
        (0 if m.style == "llama" else m.seq_len * m.d_model)
    return 6 * (n_params - lookup) + 12 * m.n_layers * m.d_model * m.seq_len


def analyze(cfg: Config) -> dict:
    """Compile the train step of `cfg` (abstract shapes) and account for it."""
    from .sharding import make_mesh
    from .train_lib import abstract_train_state, compile_train_step

    m, p, t = cfg.model, cfg.parallel, cfg.train
    t0 = time.perf_counter()
    # fake CPU devices: planning needs no accelerator, nor as many as tp
    state = abstract_train_state(cfg, make_mesh(p.dp, p.tp, devices=jax.devices("cpu")))
    compiled = compile_train_step(state, t.batch_size, m.seq_len)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    colls = hlo.collectives(compiled.as_text())
    params = _per_device_bytes(state.params)
    opt = _per_device_bytes(state.opt_state)
    batch = (t.batch_size // p.dp) * (m.seq_len + 1) * 4
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    return {
        "tp": p.tp, "sp": p.sp, "impl": p.impl, "compile_s": time.perf_counter() - t0,
        "n_params": n_params,
        "memory": {
            "params": params, "optimizer": opt, "batch": batch,
            "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
            "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes,
            # outputs alias the donated parameters and optimizer state
            "total": mem.argument_size_in_bytes + mem.temp_size_in_bytes
            + mem.output_size_in_bytes - mem.alias_size_in_bytes,
        },
        "analytic_memory": {"params_plus_optimizer": params + opt,
                            "activations_korthikanti": activation_bytes(cfg)},
        "collectives_per_step": sum(c.count for c in colls),
        "collective_bytes_per_step": sum(c.count * c.bytes for c in colls),
        "flops_per_device": float(cost.get("flops", float("nan"))),
        "model_flops_per_token": model_flops_per_token(cfg, n_params),
    }


def plan(cfg: Config, tps, hardware: str = "h100",
         log: Callable[[str], None] = print) -> list[dict]:
    """Analyze `cfg` at each tp; print the table; return the rows."""
    from .config import ConfigError, validate

    peak, link = HARDWARE[hardware]
    rows, base = [], None
    for tp in sorted(set(tps) | {1}):
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp,
                                                                  sp=cfg.parallel.sp and tp > 1))
        try:
            validate(c)
        except ConfigError as e:
            log(f"tp={tp}: skipped ({e})")
            continue
        log(f"compiling the train step at tp={tp} (abstract shapes) ...")
        r = analyze(c)
        base = r["flops_per_device"] if tp == 1 else base
        r["redundancy"] = tp * r["flops_per_device"] / base
        r["f_over_tp"] = cfg.model.d_ff / tp
        r["bound"] = ("-" if tp == 1 else
                      "compute" if cfg.model.d_ff / tp > peak / link else "communication")
        if tp in tps:
            rows.append(r)
    if not rows:
        log(f"no valid tp among {sorted(tps)}")
        return rows
    gib = lambda b: f"{b / 2**30:,.2f} G" if b >= 2**30 else f"{b / 2**20:,.1f} M"
    head = ["tp", "params B", "optim B", "temps B", "total B", "acts est. B",
            "collectives", "coll. B", "GFLOP/dev", "redundancy", "F/tp", "bound"]
    table = [head] + [[
        str(r["tp"]), gib(r["memory"]["params"]), gib(r["memory"]["optimizer"]),
        gib(r["memory"]["temporaries"]), gib(r["memory"]["total"]),
        gib(r["analytic_memory"]["activations_korthikanti"]), str(r["collectives_per_step"]),
        gib(r["collective_bytes_per_step"]), f"{r['flops_per_device'] / 1e9:,.1f}",
        f"{r['redundancy']:.3f}", f"{r['f_over_tp']:,.0f}", r["bound"]] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    m = cfg.model
    log(f"plan: {m.style} {rows[0]['n_params']:,} params, L={m.n_layers} h={m.d_model} "
        f"F={m.d_ff} heads={m.n_heads}/{m.kv_heads} kv, batch {cfg.train.batch_size} x seq "
        f"{m.seq_len}, {m.dtype}, sp={cfg.parallel.sp}, impl={cfg.parallel.impl}")
    for row in table:
        log("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    log("B: bytes per device (M = MiB, G = GiB); temps from memory_analysis, acts est. "
        "from Korthikanti et al. 2022; collectives counted per step from the HLO")
    log(korthikanti_terms(cfg))
    log(f"{hardware}: C = {peak / 1e12:g} TFLOP/s, W = {link / 1e9:g} GB/s along tp, "
        f"C/W = {peak / link:,.0f}: tp is compute-bound while F/tp > C/W. Model flops "
        f"per token 6N + 12Lhs = {rows[0]['model_flops_per_token']:.3e}.")
    return rows
