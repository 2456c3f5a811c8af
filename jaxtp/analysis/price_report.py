"""The op-by-op price of a compiled step as `--plan --cluster` prints it:
one predicted step, tokens/s and MFU, where the time goes by op class, the
ops that take the most, and the collectives the schedule leaves exposed."""

from __future__ import annotations

import math

from ..config import Config
from ..hardware import model_flops_per_token
from ..hlo import pass_of
from .cluster import Cluster
from .price import Line, accelerator_costs, price

# The method's own error, measured (docs/results.md, 2026-12-08): |predicted /
# measured - 1| of this pricing calibrated on a CPU, over 9 layouts' measured
# steps (`python -m jaxtp.bench --only predict_cpu`: mean 14.0%, max 26.7%);
# against the one published run of an XLA program on H100s (MaxText's
# Llama-2-70B, `--only predict`) it was 0.0%; against other frameworks'
# programs it is the framework's difference too (up to 2.1x)
MEAN_ERROR, MAX_ERROR = 0.14, 0.27


def _label(ln: Line) -> str:
    """The op's pass and the last of its op_name's scopes (else its HLO name)."""
    parts = [p for p in ln.op_name.split("/") if p and not p.startswith("jit(")]
    return f"{pass_of(ln.op_name)} {'/'.join(parts[-2:])}" if parts else ln.name


def priced_step(text: str, cfg: Config, mesh: dict[str, int], cluster: Cluster,
                n_params: int) -> dict:
    """`price` of `text` on `cluster` with tokens/s and MFU (model flops per
    token, `jaxtp.hardware.model_flops_per_token`, over the peak)."""
    p = price(text, accelerator_costs(cluster.accelerator), mesh, cluster)
    devices = math.prod(mesh.values())
    tokens = cfg.train.batch_size * cfg.model.seq_len
    tps = tokens / p["step_s"]
    p |= {"devices": devices, "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
          "mfu": model_flops_per_token(cfg, n_params) * tps / (devices *
                                                                 cluster.accelerator.peak_flops)}
    return p


def lines(p: dict, cluster: Cluster, top: int = 5) -> list[str]:
    ms = lambda s: f"{s * 1e3:,.1f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"
    step = p["step_s"]
    by = {}
    for ln in p["lines"]:
        by[ln.cls] = by.get(ln.cls, 0.0) + ln.seconds
    compute = ", ".join(f"{k} {ms(by.get(k, 0.0))}" for k in ("matmul", "attention", "memory")
                        if by.get(k))
    out = [f"predicted on {cluster.name}, op by op from the compiled program: step "
           f"{ms(step)} (+/- {MEAN_ERROR:.0%}: the pricing's mean error on measured steps, "
           f"{MAX_ERROR:.0%} at most), {p['tokens_per_s']:,.0f} tokens/s "
           f"({p['tokens_per_s_per_device']:,.0f} per device), MFU {p['mfu']:.1%}",
           f"  compute {ms(p['compute_s'])} ({compute}); collectives {ms(p['comm_s'])}, of which "
           f"{ms(p['exposed_s'])} exposed: not covered by the compute XLA scheduled between "
           "their start and done"]
    ops = [ln for ln in p["lines"] if ln.cls in ("matmul", "attention", "memory")][:top]
    out.append(f"  top {len(ops)} ops: " + "; ".join(
        f"{_label(ln)} ({ln.cls}, x{ln.count}) {ms(ln.seconds)}, {ln.seconds / step:.1%}"
        for ln in ops))
    comm = sorted((ln for ln in p["lines"] if ln.exposed > 0), key=lambda ln: -ln.exposed)[:top]
    out.append(f"  top {len(comm)} exposed collectives: " + ("; ".join(
        f"{ln.cls} over {ln.axes or '?'} (x{ln.count}, {ln.bytes / max(ln.count, 1) / 2**20:,.1f} "
        f"MiB) {ms(ln.exposed)} of {ms(ln.seconds)}" for ln in comm) or "none"))
    return out
