"""What a step will cost on a cluster, before anyone pays for it.

Per device and step (the scaling book's accounting, Austin et al. 2025, "How
to Scale Your Model", Training chapter: compute time against communication
time, each axis on its own link):

- matmul time: the step's flops over peak x the fraction large bf16 matmuls
  reach on the accelerator (`cluster.Accelerator.matmul_fraction`, measured);
- memory-bound time: the step's HBM bytes over the HBM bandwidth, where the
  compiled program reports them (cost analysis' "bytes accessed");
- per collective, on the link its mesh axes cross (`cluster.axis_links`, the
  slowest where a group spans several): latency plus the bytes a rank puts on
  the wire over the link's bandwidth, a ring's share of the full buffer
  (nccl-tests' bus factors: all-reduce 2(n-1)/n, all-gather and
  reduce-scatter (n-1)/n, a permute the whole buffer);
- the step as two bounds, since the schedule that hides communication behind
  compute is not known before running: exposed = compute + communication,
  hidden = max(compute, communication); tokens/s and MFU (model flops,
  6N + 12*L*h*s per token, over the peak) for both.

Decode (`predict_decode`): per generated token, the weights and the KV
cache a device holds read once from HBM, plus each decode collective's
latency and bytes: at batch 1 the all-reduces of B x D are latency-bound.

The collectives come from the compiled step's HLO (`jaxtp.hlo.collectives`)
or from the ledger that the tests hold the compiled HLO to
(`jaxtp.analysis.budget.expected_collectives`), which prices layouts this
machine cannot compile (64 devices) in no time.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..checks import SPLIT
from ..config import Config
from ..hlo import DTYPE_BYTES
from ..parallel import TP_AXIS, Layout
from ..hardware import model_flops_per_token
from ..sizes import param_count
from .budget import expected_collectives
from .cluster import Cluster, Link, axis_links, describe, load
from .decode import decode_budget
from .pp import bubble, compute_factor
from .rows import schedule_of

# a rank's bytes on the wire per byte of the full buffer, and its ring steps
_RING = {"all-reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
         "all-gather": (lambda n: (n - 1) / n, lambda n: n - 1),
         "reduce-scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
         "all-to-all": (lambda n: (n - 1) / n, lambda n: n - 1),
         "collective-permute": (lambda n: 1.0, lambda n: 1)}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """`count` collectives per step of `bytes` each (the full buffer, as
    nccl-tests sizes it) over a group of `group` devices along `axes`."""

    kind: str
    bytes: float
    group: int
    axes: tuple[str, ...]
    count: int = 1


def from_hlo(colls, mesh: dict[str, int]) -> list[Traffic]:
    """Traffic of the compiled step's collectives (`jaxtp.hlo.collectives`).
    XLA:CPU's all-to-all is one instruction with an operand per peer, which
    `jaxtp.hlo` lists element by element ("name#i"): priced as one
    all-to-all of their sum, as XLA:GPU compiles it (one array)."""
    out, whole = [], {}
    for c in colls:
        if c.kind == "all-to-all" and "#" in c.name:
            key = (c.name.split("#")[0], c.count)
            t = whole.get(key)
            whole[key] = Traffic(c.kind, c.bytes + (t.bytes if t else 0), c.group_size or 1,
                                 c.axes(mesh), c.count)
        else:
            out.append(Traffic(c.kind, c.bytes, c.group_size or 1, c.axes(mesh), c.count))
    return out + list(whole.values())


def from_budget(rows) -> list[Traffic]:
    """Traffic of ledger rows (`jaxtp.analysis.rows.Expected`). Where the
    ep ledger's all-to-alls are XLA:CPU's operands, one per peer (role
    "a2a_peers", `jaxtp.analysis.ep`), each group of `group` of them is
    priced as one all-to-all of the whole buffer."""
    out = []
    for r in rows:
        n = DTYPE_BYTES[r.dtype] * r.elements
        if r.role == "a2a_peers":
            out.append(Traffic(r.kind, n * r.group, r.group, tuple(r.axes), r.count // r.group))
        else:
            out.append(Traffic(r.kind, n * (r.group if r.kind == "reduce-scatter" else 1),
                               r.group, tuple(r.axes), r.count))
    return out


def link_of(axes, links: dict[str, Link]) -> Link:
    """The link a group along `axes` runs at: the slowest among them."""
    return min((links[a] for a in axes if a in links), key=lambda k: k.bandwidth,
               default=next(iter(links.values())))


def collective_time(t: Traffic, link: Link) -> tuple[float, float]:
    """(seconds, bytes a rank sends) for `t.count` of them on `link`."""
    if t.group <= 1:
        return 0.0, 0.0
    factor, steps = _RING.get(t.kind, _RING["all-reduce"])
    wire = t.bytes * factor(t.group)
    latency = link.latency * (steps(t.group) if link.per_hop else 1)
    return t.count * (latency + wire / link.bandwidth), t.count * wire


def predict_step(cluster: Cluster, mesh: dict[str, int], flops: float, traffic: list[Traffic],
                 tokens: int, flops_per_token: float, hbm_bytes: float | None = None,
                 overlap: str = "") -> dict:
    """Both bounds of one train step per device: `flops` and `hbm_bytes` per
    device, `traffic` its collectives, `tokens` the global batch's tokens."""
    acc, devices = cluster.accelerator, math.prod(mesh.values())
    links = axis_links(mesh, cluster)
    compute = flops / (acc.peak_flops * acc.matmul_fraction)
    memory = hbm_bytes / acc.hbm_bandwidth if hbm_bytes else None
    busy = max(compute, memory or 0.0)
    axes: dict[str, dict] = {}
    for t in traffic:
        link = link_of(t.axes, links)
        s, wire = collective_time(t, link)
        row = axes.setdefault("+".join(t.axes) or "?", {"link": link.name, "bytes": 0.0,
                                                        "seconds": 0.0, "collectives": 0,
                                                        "kinds": {}})
        row["bytes"] += wire
        row["seconds"] += s
        row["collectives"] += t.count
        row["kinds"][t.kind] = row["kinds"].get(t.kind, 0.0) + s  # seconds by kind
    comm = sum(r["seconds"] for r in axes.values())
    bounds = {"exposed": busy + comm, "hidden": max(busy, comm)}
    out = {"cluster": cluster.name, "devices": devices, "compute_s": compute, "memory_s": memory,
           "comm_s": comm, "overlap": overlap, "axes": axes}
    for name, step in bounds.items():
        tps = tokens / step
        out[name] = {"step_s": step, "tokens_per_s": tps, "tokens_per_s_per_device": tps / devices,
                     "mfu": flops_per_token * tps / (devices * acc.peak_flops)}
    for r in axes.values():
        r["share"] = r["seconds"] / bounds["exposed"]
    return out


def lines(p: dict) -> list[str]:
    """The prediction as printed by --plan --cluster."""
    ms = lambda s: f"{s * 1e3:,.1f} ms"
    out = [f"predicted on {p['cluster']} ({p['devices']} devices), per device and step: "
           f"matmul {ms(p['compute_s'])}"
           + (f", HBM {ms(p['memory_s'])}" if p["memory_s"] is not None else
              ", HBM time left out")
           + f", communication {ms(p['comm_s'])}"]
    for name, what in (("exposed", "communication exposed"), ("hidden", "communication "
                                                              "hidden behind compute")):
        b = p[name]
        out.append(f"  {what}: step {ms(b['step_s'])}, {b['tokens_per_s']:,.0f} tokens/s "
                   f"({b['tokens_per_s_per_device']:,.0f} per device), MFU {b['mfu']:.1%}")
    for axis, r in sorted(p["axes"].items()):
        a2a = r["kinds"].get("all-to-all")
        out.append(f"  {axis}: {r['collectives']} collectives, {r['bytes'] / 2**20:,.1f} MiB "
                   f"sent per device on {r['link']}, {ms(r['seconds'])}"
                   + (f" (all-to-alls {ms(a2a)})" if a2a else "")
                   + f", {r['share']:.1%} of the exposed step")
    if p["overlap"]:
        out.append(f"  overlap: {p['overlap']}")
    return out


def plan_lines(row: dict, cfg: Config, cluster: str | Cluster) -> list[str]:
    """A `--plan` row's prediction on `cluster` (stored in row["prediction"])."""
    cluster = load(cluster) if isinstance(cluster, str) else cluster
    mesh, m, p = row["mesh"], cfg.model, cfg.parallel
    name = ", ".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "one device"
    if row.get("_hlo") and row["compiled_for"].split()[0] == platform_of(cluster):
        # the accelerator's own program: priced op by op (`jaxtp.analysis.price`)
        from .price_report import lines as op_lines, priced_step

        pred = priced_step(row["_hlo"], cfg, mesh, cluster, row["n_params"])
        row["prediction"] = {k: v for k, v in pred.items() if k != "lines"}
        return [f"{name} on {describe(mesh, cluster)}"] + op_lines(pred, cluster)
    tokens, devices = cfg.train.batch_size * m.seq_len, math.prod(row["mesh"].values())
    notes, flops, hbm = [], row["flops_per_device"], row.get("hbm_bytes")
    if m.n_experts:  # MFU's count, active parameters (jaxtp.hardware.model_flops_per_token)
        flops = step_flops(cfg) * tokens / devices
        notes.append(f"flops: the {m.moe_top_k} of {m.n_experts} experts a token takes (6 x "
                     "active parameters + attention, x remat's recomputation); the compiled "
                     "step's dense dispatch and combine and its capacity's padded slots not "
                     "counted")
    elif m.scan_layers or p.pp > 1 or not math.isfinite(flops):
        ticks, useful = compute_factor(cfg)
        idle = bubble(p.pp, cfg.train.microbatches, p.pp_repeats)
        flops = step_flops(cfg) * tokens / devices * ticks / useful
        notes.append("flops: model flops x remat's recomputation over the devices ("
                     + ("XLA's cost analysis counts a scanned stack's body once"
                        if m.scan_layers or p.pp > 1 else "this compile has no cost analysis")
                     + (f"; x {ticks}/{useful}: the {p.pp_schedule} pipeline's compiled over "
                        f"useful block flops, its bubble {idle:.1%} of the ticks computed on "
                        "dropped data" + (" (but not its weight gradients)" if p.pp_schedule
                                          in SPLIT else "") if p.pp > 1 else "") + ")")
    if m.scan_layers or row["compiled_for"].startswith("cpu") or not (hbm and math.isfinite(hbm)):
        hbm = None
        notes.append("HBM time left out: it needs the accelerator's own compile (--hardware) "
                     "with cost analysis and an unscanned stack")
    if row["compiled_for"].startswith("cpu"):
        # XLA's CPU compile carries collectives in f32 and all-reduces where a GPU
        # reduce-scatters: price the ledger the tests hold the accelerator's compile to
        platform = platform_of(cluster)
        traffic = from_budget(expected_collectives(cfg, p.impl, platform))
        notes.append(f"collectives: the {platform.upper()} ledger (expected_collectives), not "
                     "the CPU compile's")
    else:
        traffic = [Traffic(t["kind"], t["bytes"], t["group"], tuple(t["axes"]), t["count"])
                   for t in row["traffic"]]
    overlap = (f"impl {p.impl}, --overlap {p.overlap}: SP's collectives written to run beside "
               "their matmuls" if p.overlap != "none" else
               f"impl {p.impl}, no --overlap: what hides is up to XLA's scheduler")
    pred = predict_step(cluster, mesh, flops, traffic, tokens,
                        model_flops_per_token(cfg, row["n_params"]), hbm, overlap)
    row["prediction"] = pred
    return [f"{name} on {describe(mesh, cluster)}"] + lines(pred) + [f"  {n}" for n in notes]


def platform_of(cluster: Cluster) -> str:
    """The compiler whose ledger prices a step on `cluster` ("tpu" or "gpu")."""
    return "tpu" if cluster.accelerator.name.startswith("tpu") else "gpu"


def predict_config(cfg: Config, cluster: str | Cluster) -> dict:
    """`cfg`'s train step on `cluster` without compiling it: its ledger
    (`expected_collectives` for the cluster's compiler) and its model flops
    per token (x remat's recomputation, x a pipeline's compiled over useful
    ticks) over the devices."""
    cluster = load(cluster) if isinstance(cluster, str) else cluster
    p = cfg.parallel
    mesh = Layout.make(**p.degrees).sizes
    tokens = cfg.train.batch_size * cfg.model.seq_len
    traffic = from_budget(expected_collectives(cfg, p.impl, platform_of(cluster)))
    ticks, useful = compute_factor(cfg)
    return predict_step(cluster, mesh, step_flops(cfg) * tokens / p.devices * ticks / useful,
                        traffic, tokens, model_flops_per_token(cfg, param_count(cfg)))


def step_flops(cfg: Config) -> float:
    """Model flops per token x the recomputation remat adds (full: the forward
    again, 8/6; the others recompute little and count 1), and 1F1B keeping
    its stage inputs another forward (`Schedule.recomputes`)."""
    again = (cfg.model.remat == "full") + schedule_of(cfg).recomputes
    return model_flops_per_token(cfg, param_count(cfg)) * (6 + 2 * again) / 6


def predict_decode(cfg: Config, cluster: Cluster, batch: int, context: int,
                   tps=(1, 2, 4, 8), impl: str = "shard_map") -> list[dict]:
    """Seconds per generated token at batch `batch` with `context` tokens
    cached, at each tp (one node): HBM time for the weights and KV cache a
    device reads plus the decode step's collectives (`decode_budget`)."""
    acc, rows = cluster.accelerator, []
    m = cfg.model
    size = np.dtype(m.dtype).itemsize
    # an untied input table is looked up (B rows), not read whole
    weights = (param_count(cfg) - (0 if m.tie_embeddings else m.padded_vocab * m.d_model)) * size
    kv = 2 * m.n_layers * batch * context * m.kv_heads * m.head_dim * size
    for tp in tps:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, dp=1,
                                                                  sp=False))
        # kv heads split over tp as far as they go (K < tp: replicated in groups)
        hbm = (weights / tp + kv / min(tp, m.kv_heads)) / acc.hbm_bandwidth
        link = axis_links({TP_AXIS: tp}, cluster)[TP_AXIS]
        traffic = from_budget(decode_budget(c, batch, impl))
        comm = sum(collective_time(t, link)[0] for t in traffic)
        latency = sum(collective_time(dataclasses.replace(t, bytes=0), link)[0] for t in traffic)
        rows.append({"tp": tp, "batch": batch, "hbm_s": hbm, "comm_s": comm,
                     "latency_s": latency, "token_s": hbm + comm,
                     "tokens_per_s": batch / (hbm + comm)})
    for r in rows:
        r["speedup"] = rows[0]["token_s"] / r["token_s"]
    return rows


def decode_lines(cfg: Config, cluster: str | Cluster, context: int | None = None) -> list[str]:
    """--plan --cluster's decode lines: per generated token at batch 1 and at
    the train batch, `context` (default seq_len) tokens cached, tp 1, 2, 4, 8
    (those the heads and a node allow)."""
    cluster = load(cluster) if isinstance(cluster, str) else cluster
    m, context = cfg.model, context or cfg.model.seq_len
    tps = [t for t in (1, 2, 4, 8) if m.n_heads % t == 0 and t <= cluster.devices_per_node]
    out = []
    for batch in sorted({1, cfg.train.batch_size}):
        rows = predict_decode(cfg, cluster, batch, context, tps, cfg.parallel.impl)
        out.append(f"decode on {cluster.name}, batch {batch}, {context:,} tokens cached, per "
                   "token (weights and KV cache over HBM + the decode collectives): " + "; ".join(
                       f"tp={r['tp']} {r['token_s'] * 1e3:,.2f} ms ({r['tokens_per_s']:,.0f} "
                       f"tokens/s, {r['speedup']:.2f}x, collectives {r['comm_s'] * 1e3:,.2f} ms)"
                       for r in rows))
    return out
