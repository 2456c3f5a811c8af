"""What a cluster offers a step: the accelerator and the links its mesh axes cross.

A `Cluster` is an accelerator (dense bf16 peak, the fraction of it large
bf16 matmuls reach, HBM bandwidth and size) times a topology (devices per
node, nodes, the link inside a node and the one between nodes). Presets
(`PRESETS`, `--cluster h100x8`) or a JSON file a user writes (`load`; a field
it does not know, a misspelling, is refused by name):

    {"name": "my-h100s", "devices_per_node": 8, "nodes": 2,
     "accelerator": {"name": "h100", "peak_flops": 989e12, "matmul_fraction": 0.801,
                     "hbm_bandwidth": 3.35e12, "memory": 85899345920},
     "intra": {"name": "NVLink 4", "bandwidth": 450e9, "latency": 20e-6},
     "inter": {"name": "InfiniBand NDR", "bandwidth": 48e9, "latency": 25e-6}}

Bandwidths are bytes/s one device moves each way; a latency is seconds per
collective (`per_hop`: per step of the ring instead, as on a TPU torus).

Mesh axes map onto it innermost first (`axis_links`): jaxtp's meshes are
(dp, [cp,] tp) with tp's devices adjacent, so a group along an axis of
stride s and size n stays inside a node while s * n <= devices_per_node;
otherwise it crosses nodes and runs at the inter-node link.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    matmul_fraction: float  # of the peak, large bf16 matmuls, measured (see `source`)
    hbm_bandwidth: float  # bytes/s
    memory: float  # bytes
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per device, each way
    latency: float  # seconds per collective (per ring step with per_hop)
    per_hop: bool = False
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    accelerator: Accelerator
    devices_per_node: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


class ClusterError(ValueError):
    pass


# Maximum achievable matmul FLOPS (bf16, no sparsity) over the datasheet peak,
# Bekman, "Machine Learning Engineering", compute/accelerator (MAMF table,
# CUDA 12.1): H100 SXM 792.1 of 989 TFLOP/s, A100 SXM 267.9 of 312.
_MAMF = "ml-engineering MAMF table (stas00/ml-engineering, compute/accelerator)"
H100 = Accelerator("h100", 989e12, 792.1 / 989, 3.35e12, 80e9,
                   f"NVIDIA H100 SXM datasheet; matmul fraction: {_MAMF}")
# H200: H100's compute with 141 GB HBM3e at 4.8 TB/s (datasheet); its MAMF is
# not in the table: H100's fraction, the same chip
H200 = Accelerator("h200", 989e12, 792.1 / 989, 4.8e12, 141e9,
                   f"NVIDIA H200 SXM datasheet; matmul fraction: H100's ({_MAMF})")
A100 = Accelerator("a100-80gb", 312e12, 267.9 / 312, 2.039e12, 80e9,
                   f"NVIDIA A100 80GB SXM datasheet; matmul fraction: {_MAMF}")
# TPU v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2.765e12 B/s (Google Cloud TPU
# v5p docs); no published large-matmul microbenchmark: the peak itself
V5P = Accelerator("tpu-v5p", 459e12, 1.0, 2.765e12, 95 * 2**30,
                  "Google Cloud TPU v5p docs; matmul fraction 1.0: none published")

# NVLink 4: 900 GB/s bidirectional per H100 (datasheet), 450 each way; one
# NCCL all-reduce of 4 B to 1 MiB takes 20-25 us on 8 H100 (marin-community/marin#6736)
NVLINK4 = Link("NVLink 4", 450e9, 20e-6, source="H100 datasheet; latency marin#6736")
NVLINK3 = Link("NVLink 3", 300e9, 20e-6, source="A100 datasheet (600 GB/s bidirectional); "
               "latency as NVLink 4 (marin#6736)")
# InfiniBand NDR 400 Gb/s, one NIC per GPU: 46-48 GB/s measured per NIC
# (NVIDIA/nccl-tests#290, NCCL's maintainer); NCCL's tuner puts a small
# inter-node ring all-reduce at 25.2 us on H100 nodes (NVIDIA/nccl#1453)
IB_NDR = Link("InfiniBand NDR", 48e9, 25e-6, source="nccl-tests#290; latency nccl#1453")
# TPU v5p ICI: 9e10 B/s per link each way, a ring along a torus axis uses both
# directions (1.8e11), about 1 us per hop; DCN 6.25e9 B/s per chip (Austin
# et al. 2025, "How to Scale Your Model", TPU chapter)
ICI_V5P = Link("ICI", 1.8e11, 1e-6, per_hop=True, source="Austin et al. 2025")
# (its latency: none published there; InfiniBand's per collective, nccl#1453)
DCN = Link("DCN", 6.25e9, 25e-6, source="Austin et al. 2025; latency as IB_NDR's")

PRESETS = {
    "h100x8": Cluster("h100x8", H100, 8, 1, NVLINK4, IB_NDR),
    "h100x8x8nodes": Cluster("h100x8x8nodes", H100, 8, 8, NVLINK4, IB_NDR),
    "h100x8x64nodes": Cluster("h100x8x64nodes", H100, 8, 64, NVLINK4, IB_NDR),
    "h200x8": Cluster("h200x8", H200, 8, 1, NVLINK4, IB_NDR),
    "a100x8": Cluster("a100x8", A100, 8, 1, NVLINK3, IB_NDR),
    # v5p-32: 32 TensorCores, 16 chips (a 2x2x4 slice), one ICI domain
    "v5p-32": Cluster("v5p-32", V5P, 16, 1, ICI_V5P, DCN),
    # v5p-128: 64 chips (a 4x4x4 slice), one ICI domain
    "v5p-128": Cluster("v5p-128", V5P, 64, 1, ICI_V5P, DCN),
}


def one_device(device_kind: str) -> Cluster | None:
    """A one-device cluster of the accelerator a device reports, if known."""
    v5p = "TPU v5" in device_kind and "lite" not in device_kind  # a v5p VM says "TPU v5"
    acc = V5P if v5p else next((a for key, a in (("H200", H200), ("H100", H100),
                                                 ("A100", A100)) if key in device_kind), None)
    return None if acc is None else Cluster(acc.name, acc, 1, 1, NVLINK4, IB_NDR)


def _positive(d: dict, keys, where: str) -> None:
    for k in keys:
        if k not in d:
            raise ClusterError(f"{where}: missing field {k!r}")
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                or not math.isfinite(v):
            raise ClusterError(f"{where}: {k}={v!r} must be a positive number")


def _known(d: dict, cls, where: str) -> None:
    """Refuse a field `cls` does not have: a misspelt one would be dropped
    silently, its value replaced by a default or reported as missing."""
    known = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in known:
            near = difflib.get_close_matches(k, known, 1)
            raise ClusterError(f"{where}: unknown field {k!r}"
                               + (f" (did you mean {near[0]!r}?)" if near else "")
                               + f"; the fields of {where}: {', '.join(known)}")


def from_dict(d: dict) -> Cluster:
    """A cluster from its JSON form; an unknown field, or a missing, zero,
    negative or non-numeric one, is refused with its name."""
    if not isinstance(d, dict):
        raise ClusterError('a cluster is a JSON object ({"devices_per_node": 8, "nodes": 1, '
                           '"accelerator": {...}, "intra": {...}, "inter": {...}}: '
                           f"jaxtp.analysis.cluster), not {json.dumps(d)[:60]}")
    _known(d, Cluster, "cluster")
    for part, cls in (("accelerator", Accelerator), ("intra", Link), ("inter", Link)):
        if isinstance(d.get(part), dict):
            _known(d[part], cls, part)
    _positive(d, ("devices_per_node", "nodes"), "cluster")
    for k in ("devices_per_node", "nodes"):
        if not isinstance(d[k], int):
            raise ClusterError(f"cluster: {k}={d[k]!r} must be a whole number")
    for part in ("intra", "inter"):
        hop = d.get(part, {}).get("per_hop", False) if isinstance(d.get(part), dict) else False
        if not isinstance(hop, bool):
            raise ClusterError(f"{part}: per_hop={hop!r} must be true or false")
    for part in ("accelerator", "intra", "inter"):
        if not isinstance(d.get(part), dict):
            raise ClusterError(f"cluster: missing field {part!r} (an object)")
    a = d["accelerator"]
    _positive(a, ("peak_flops", "matmul_fraction", "hbm_bandwidth", "memory"), "accelerator")
    if a["matmul_fraction"] > 1:
        raise ClusterError(f"accelerator: matmul_fraction={a['matmul_fraction']} is above 1")
    links = {}
    for part in ("intra", "inter"):
        _positive(d[part], ("bandwidth", "latency"), part)
        links[part] = Link(str(d[part].get("name", part)), float(d[part]["bandwidth"]),
                           float(d[part]["latency"]), bool(d[part].get("per_hop", False)),
                           str(d[part].get("source", "")))
    acc = Accelerator(str(a.get("name", "accelerator")), float(a["peak_flops"]),
                      float(a["matmul_fraction"]), float(a["hbm_bandwidth"]),
                      float(a["memory"]), str(a.get("source", "")))
    return Cluster(str(d.get("name", "cluster")), acc, int(d["devices_per_node"]),
                   int(d["nodes"]), links["intra"], links["inter"])


def load(name_or_path: str) -> Cluster:
    """A preset by name, or a cluster JSON file (UTF-8); a ClusterError names
    the file and what in it is wrong."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    presets = ", ".join(PRESETS)
    if not name_or_path.strip():
        raise ClusterError(f"--cluster {name_or_path!r} is empty: name a preset ({presets}) "
                           "or a cluster JSON file")
    path = Path(name_or_path)
    if not path.is_file():
        raise ClusterError(f"--cluster {name_or_path!r}: neither a preset ({presets}) nor a "
                           + ("file (a directory)" if path.is_dir() else "file"))
    try:
        return from_dict(json.loads(path.read_text(encoding="utf-8")))
    except UnicodeDecodeError as e:
        raise ClusterError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                           f"{e.start}); a cluster file is JSON (jaxtp.analysis.cluster)") \
            from None
    except json.JSONDecodeError as e:
        raise ClusterError(f"{path}: not JSON ({e})") from None
    except ClusterError as e:
        raise ClusterError(f"{path}: {e}") from None


def axis_links(mesh: dict[str, int], cluster: Cluster) -> dict[str, Link]:
    """{axis: the link its groups cross}, for a mesh {axis: size} listed
    outermost first (jaxtp's (dp, [cp,] tp)); devices fill nodes in order."""
    n = math.prod(mesh.values())
    if n > cluster.devices:
        raise ClusterError(f"the mesh {mesh} needs {n} devices; {cluster.name} has "
                           f"{cluster.devices}")
    out, stride = {}, 1
    for axis in reversed(list(mesh)):
        size = mesh[axis]
        # a group stays in one node when the groups tile the nodes exactly
        inside = cluster.devices_per_node % (stride * size) == 0
        out[axis] = cluster.intra if inside or size == 1 else cluster.inter
        stride *= size
    return dict(reversed(out.items()))


def describe(mesh: dict[str, int], cluster: Cluster) -> str:
    """One line: where each mesh axis runs."""
    links = axis_links(mesh, cluster)
    axes = ", ".join(f"{a}={mesh[a]} on {links[a].name} ({links[a].bandwidth / 1e9:g} GB/s "
                     "each way)" for a in mesh if mesh[a] > 1)
    return f"{cluster.name} ({cluster.nodes} x {cluster.devices_per_node} " \
        f"{cluster.accelerator.name}): {axes or 'one device, no link'}"
