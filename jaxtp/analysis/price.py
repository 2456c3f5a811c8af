"""A step's time priced op by op from the program the compiler will run.

`price(text, costs, mesh, cluster)` reads the optimized HLO of a compiled
step (`jaxtp.hlo_ops.program`) and times each op at a roofline with the
efficiency its class reaches (`Costs`):

- matmul: flops over (peak for its dtype x the efficiency of a matmul of
  its size), or its bytes over the memory rate, whichever is longer;
- attention (cuDNN's kernel): flops over the rate cuDNN reaches at its
  sequence length;
- memory-bound (every other fusion or op): bytes over the HBM rate an op of
  its size reaches;
- each op also pays `Costs.overhead` (a kernel launch), a loop iteration
  `Costs.loop`;
- a collective: its group's link (`cluster.axis_links`, NVLink at
  `Costs.link_efficiency` of the line rate) as `predict.collective_time`
  prices it (latency plus a ring's bytes), or, where `Costs.collectives`
  holds a measured curve for its kind and group, that curve. A group of
  k nodes with m ranks in each runs in two phases: among the m inside each
  node, then among the k nodes with each of the m ranks' own NIC carrying
  1/m of the buffer (rail-optimized nodes, one NIC a GPU as in a DGX H100;
  NCCL gives each NIC channels of its own), each phase priced as above.

Loops run their body `trip` times. Overlap is read off the schedule XLA
chose, not assumed: the ops of a computation run in the order printed, on
one compute stream; an async collective (`*-start` ... `*-done`) runs on one
communication stream from its start, once the previous collective is done,
and its done waits for it. So a collective is charged only where the
compute scheduled between its start and its done does not cover it; a
synchronous collective (XLA:CPU's, or one XLA:GPU marks `is_sync`) is
charged whole.

The same code prices every target; only `Costs` differ: an accelerator's
from published measurements (`accelerator_costs`, each constant cited), the
CPU's from micro-benchmarks on this machine (`jaxtp.bench.calibrate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..groups import axes_of
from ..hlo_ops import Op, program
from .cluster import Accelerator, Cluster, axis_links
from .predict import Traffic, collective_time, link_of


@dataclasses.dataclass(frozen=True)
class Curve:
    """A rate (per second) by an op's size, from (size, rate) points in
    ascending size: `step` takes the rate of the largest size at or below
    (a tiered table), else interpolates log-log between points (a measured
    curve); sizes outside take the nearest end."""

    points: tuple[tuple[float, float], ...]
    step: bool = False

    def __call__(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        i = next(i for i, (x, _) in enumerate(pts) if x > size)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        if self.step:
            return y0
        f = math.log(size / x0) / math.log(x1 / x0)
        return math.exp(math.log(y0) + f * math.log(y1 / y0))


@dataclasses.dataclass(frozen=True)
class Costs:
    """What a device's ops cost, by class."""

    name: str
    matmul: Curve  # FLOP/s by one matmul's flops, in the reference dtype
    dtypes: dict  # matmul rate by operand dtype, a multiple of the reference
    memory: Curve  # bytes/s by the bytes one op moves
    attention: Curve | None = None  # FLOP/s by key length
    overhead: float = 0.0  # seconds per op launched
    loop: float = 0.0  # seconds per loop iteration
    step: float = 0.0  # seconds per step outside the program (dispatch)
    link_efficiency: float = 1.0  # of a link's line rate a collective reaches
    collectives: dict = dataclasses.field(default_factory=dict)  # "kind/group" -> Curve of B/s
    # bytes/s of the other memory-bound classes (`jaxtp.hlo_ops.MEMORY_CLASSES`);
    # a class not here moves at `memory`'s rate
    memory_classes: dict = dataclasses.field(default_factory=dict)
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @staticmethod
    def load(path) -> "Costs":
        d = json.loads(Path(path).read_text())
        curve = lambda c: Curve(tuple(tuple(p) for p in c["points"]), c["step"]) if c else None
        return Costs(**{**d, "matmul": curve(d["matmul"]), "memory": curve(d["memory"]),
                        "attention": curve(d["attention"]),
                        "collectives": {k: curve(v) for k, v in d["collectives"].items()},
                        "memory_classes": {k: curve(v) for k, v in
                                           d.get("memory_classes", {}).items()}})


# Calculon (Isaev et al., SC 2023, Sec. 4): a matmul's efficiency by its
# size, 0.95 / 0.9 / 0.6 / 0.1 of the peak at >= 128, >= 16, >= 1, < 1
# GFLOP; capped here by the accelerator's measured maximum (its MAMF
# fraction, `cluster.Accelerator.matmul_fraction`)
CALCULON_TIERS = ((0.0, 0.1), (1e9, 0.6), (16e9, 0.9), (128e9, 0.95))
# Dense peaks relative to bf16 (NVIDIA H100 SXM datasheet: TF32 494.7, FP64
# tensor 66.9 of bf16's 989.4 TFLOP/s; A100's ratios are the same to 2%)
GPU_DTYPES = {"bf16": 1.0, "f16": 1.0, "f32": 0.5, "f64": 0.0676, "f8e4m3fn": 2.0,
              "f8e5m2": 2.0}
# cuDNN's fused attention forward on H100 SXM5, head dim 128, not causal,
# by sequence length (Shah et al. 2024, FlashAttention-3, Fig. 5): 497, 574,
# 617, 609, 600, 595 TFLOP/s at 512 ... 16k; its backward's is not
# published there: the forward's is used
CUDNN_ATTENTION_H100 = ((512, 497e12), (1024, 574e12), (2048, 617e12), (4096, 609e12),
                        (8192, 600e12), (16384, 595e12))
# Memory-bound kernels: 2.8 of H100's 3.35 TB/s for coalesced loads
# (Nsight Compute measurements, mikamirai.com "GPU Memory Bandwidth", 2026)
HBM_FRACTION = 2.8 / 3.35
# NCCL over NVLink 4: 370 of the 450 GB/s line rate after the protocol's
# overhead (NCCL's maintainer, NVIDIA/nccl-tests#212); the InfiniBand link
# figure (48 GB/s) is already measured (`cluster.IB_NDR`), so both links
# are priced at this fraction of `cluster.Link.bandwidth` only on NVLink
NCCL_NVLINK_FRACTION = 370 / 450
# A kernel's launch: about 2 us inside a CUDA graph, as XLA:GPU runs them
# (NVIDIA, "Getting Started with CUDA Graphs", 2019: launch costs of a few
# microseconds per kernel); not measured here
GPU_LAUNCH = 2e-6


def accelerator_costs(acc: Accelerator) -> Costs:
    """An accelerator's costs from its cited figures (none fitted)."""
    cap = acc.matmul_fraction
    tiers = tuple((f, acc.peak_flops * min(e, cap)) for f, e in CALCULON_TIERS)
    attention = Curve(tuple((s, r * acc.peak_flops / 989e12) for s, r in CUDNN_ATTENTION_H100))
    gpu = not acc.name.startswith("tpu")
    return Costs(acc.name, Curve(tiers, step=True), GPU_DTYPES,
                 Curve(((1.0, acc.hbm_bandwidth * HBM_FRACTION),)), attention,
                 GPU_LAUNCH if gpu else 0.0, 0.0, 0.0, NCCL_NVLINK_FRACTION if gpu else 1.0,
                 source="Calculon's matmul tiers capped at MAMF; cuDNN attention (FA3 paper); "
                        "HBM at 2.8/3.35; NCCL at 370/450 of NVLink")


@dataclasses.dataclass
class Line:
    """One op's total over the step."""

    name: str
    cls: str
    op_name: str
    count: int = 0
    seconds: float = 0.0
    exposed: float = 0.0  # a collective's: not covered by compute
    flops: float = 0.0
    bytes: float = 0.0
    axes: str = ""


class _Pricer:
    def __init__(self, comps, costs: Costs, mesh: dict[str, int], cluster: Cluster | None):
        self.comps, self.costs, self.mesh = comps, costs, mesh
        self.links = axis_links(mesh, cluster) if cluster else {}
        self.cluster = cluster
        self.lines: dict[tuple, Line] = {}

    def compute_s(self, op: Op) -> float:
        c = self.costs
        rate = c.memory_classes.get(op.mem, c.memory)
        mem = op.bytes / rate(op.bytes) if op.bytes else 0.0
        if op.cls == "matmul":
            rate = c.matmul(op.flops) * c.dtypes.get(op.dtype, 1.0)
            return c.overhead + max(op.flops / rate if rate else 0.0, mem)
        if op.cls == "attention" and c.attention is not None:
            return c.overhead + max(op.flops / c.attention(op.seq), mem)
        return c.overhead + mem

    def comm_s(self, op: Op) -> tuple[float, str]:
        axes = axes_of(op.groups, self.mesh) if self.mesh else ()
        curve = self.costs.collectives.get(f"{op.kind}/{op.group}")
        if curve is not None:
            return op.bytes / curve(op.bytes), "+".join(axes)
        if not self.links:
            return 0.0, "+".join(axes)
        spread = self.spread(op)
        if spread is not None:  # across nodes: inside each, then over the m NICs at once
            k, m = spread
            inside = self.fast(self.cluster.intra)
            return collective_time(Traffic(op.kind, op.bytes, m, axes), inside)[0] + \
                collective_time(Traffic(op.kind, op.bytes / m, k, axes), self.cluster.inter)[0], \
                "+".join(axes)
        link = self.fast(link_of(axes, self.links))
        return collective_time(Traffic(op.kind, op.bytes, op.group, axes), link)[0], \
            "+".join(axes)

    def fast(self, link):
        """NVLink at the fraction NCCL reaches (the other links' figures are measured)."""
        if not link.name.startswith("NVLink"):
            return link
        return dataclasses.replace(link, bandwidth=link.bandwidth * self.costs.link_efficiency)

    def spread(self, op: Op) -> tuple[int, int] | None:
        """(k nodes, m ranks in each) of a group that spans several nodes
        evenly (devices fill nodes in order, as `cluster.axis_links` has it);
        None inside one node, for a permute, or spread unevenly."""
        per = self.cluster.devices_per_node
        if op.kind == "collective-permute" or not op.groups:
            return None
        nodes = {}
        for d in op.groups[0]:
            nodes[d // per] = nodes.get(d // per, 0) + 1
        counts = set(nodes.values())
        if len(nodes) < 2 or len(counts) != 1:
            return None
        return len(nodes), counts.pop()

    def line(self, op: Op, comp: str, mult: int, seconds: float, exposed: float = 0.0,
             axes: str = "") -> None:
        key = (comp, op.name)
        ln = self.lines.setdefault(key, Line(op.name, op.kind or op.cls, op.op_name, axes=axes))
        ln.count += mult
        ln.seconds += mult * seconds
        ln.exposed += mult * exposed
        ln.flops += mult * op.flops
        ln.bytes += mult * op.bytes

    def run(self, comp: str, mult: int = 1, depth: int = 0) -> float:
        """Seconds one call of `comp` takes (its ops at `mult` calls a step)."""
        t, link_free, pending = 0.0, 0.0, {}
        for op in self.comps.get(comp, []) if depth < 64 else []:
            if op.cls == "free":
                continue
            if op.cls == "loop":
                once = sum(self.run(c, mult * op.trip, depth + 1) for c in op.calls if c)
                t += op.trip * (once + self.costs.loop)
            elif op.cls == "call":
                t += max([self.run(c, mult, depth + 1) for c in op.calls if c] or [0.0])
            elif op.cls == "start":
                s, axes = self.comm_s(op)
                begin = max(t, link_free)
                link_free = begin + s
                pending[op.name] = (op, link_free, s, axes)
            elif op.cls == "done":
                start, end, s, axes = pending.pop(op.src, (None, t, 0.0, ""))
                wait = max(0.0, end - t)
                t += wait
                if start is not None:
                    self.line(start, comp, mult, s, wait, axes)
            elif op.cls == "collective":
                s, axes = self.comm_s(op)
                before, t = t, max(t, link_free) + s
                link_free = t
                self.line(op, comp, mult, s, t - before, axes)
            else:
                s = self.compute_s(op)
                t += s
                self.line(op, comp, mult, s)
        return t


def price(text: str, costs: Costs, mesh: dict[str, int] | None = None,
          cluster: Cluster | None = None) -> dict:
    """A compiled step's predicted time on one device: {"step_s", "compute_s"
    (every op's own time), "comm_s" (every collective's), "exposed_s" (the
    collectives' time not covered), "lines" (each op's total, `Line`)}."""
    comps, entry = program(text)
    p = _Pricer(comps, costs, mesh or {}, cluster)
    elapsed = p.run(entry) + costs.step
    lines = sorted(p.lines.values(), key=lambda ln: -ln.seconds)
    comm = [ln for ln in lines if ln.cls not in ("matmul", "attention", "memory")]
    return {"step_s": elapsed, "compute_s": sum(ln.seconds for ln in lines if ln not in comm),
            "comm_s": sum(ln.seconds for ln in comm),
            "exposed_s": sum(ln.exposed for ln in comm), "flops": sum(ln.flops for ln in lines),
            "lines": lines, "costs": costs.name}
