"""The analytic Megatron communication budget, and the HLO comparison report.

Tensor parallelism per Shoeybi et al. 2019 ("Megatron-LM", Sec. 3, Fig. 4):
each Transformer block has two column -> row regions (attention, MLP), each
with one all-reduce forward (g) and one backward (f), so per block and
microbatch 2 + 2 all-reduces of the activation, b*s*h elements. Narayanan et
al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters",
Sec. 3.3) price each with a ring all-reduce: every rank sends and receives
2(t-1)/t of the payload ((t-1)/t for an all-gather or reduce-scatter).

Outside the blocks this model needs, per train step (`expected_collectives`):
- vocab-parallel embedding: the lookup's partial rows are summed over tp,
  one forward all-reduce of b*s*h;
- LM head: column-parallel over the vocabulary, so its input gradient is
  all-reduced backward (f), b*s*h;
- vocab-parallel cross-entropy: max, sum of exponentials and target logit,
  three forward all-reduces of b*s fp32 values;
- the global gradient norm: one scalar all-reduce of the partial sums of
  squares of the tp-sharded gradients;
- with fewer kv heads than tp (replicated kv projection): the kv gradient,
  b*s*2*K*H per block, is summed over the ranks that share each kv head.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from . import hlo
from .config import IMPLS, Config

HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class Budget:
    """Megatron's per-block TP communication for one train step, per tp rank."""

    tp: int
    layers: int
    batch: int  # microbatch size on one dp rank
    seq: int
    d_model: int
    dtype_bytes: int
    microbatches: int = 1
    all_reduce_per_layer_fwd: int = 2
    all_reduce_per_layer_bwd: int = 2

    @property
    def ring_factor(self) -> float:
        """Bytes each rank sends per payload byte in a ring all-reduce: 2(t-1)/t."""
        return 2 * (self.tp - 1) / self.tp

    @property
    def elements_per_all_reduce(self) -> int:
        return self.batch * self.seq * self.d_model

    @property
    def bytes_per_all_reduce(self) -> int:
        return self.elements_per_all_reduce * self.dtype_bytes

    @property
    def ring_bytes_per_all_reduce(self) -> float:
        return self.ring_factor * self.bytes_per_all_reduce

    @property
    def ring_bytes_per_layer(self) -> float:
        """Per block and microbatch, forward + backward."""
        per_layer = self.all_reduce_per_layer_fwd + self.all_reduce_per_layer_bwd
        return per_layer * self.ring_bytes_per_all_reduce

    @property
    def ring_bytes_blocks_per_step(self) -> float:
        return self.layers * self.microbatches * self.ring_bytes_per_layer


@dataclasses.dataclass(frozen=True)
class Expected:
    """One line of the budget: `count` collectives of `elements` each per step."""

    name: str
    kind: str
    pass_: str
    scope: str
    elements: int
    dtype: str
    group: int
    count: int

    @property
    def key(self) -> tuple:
        return (self.kind, self.pass_, self.scope, self.elements, self.dtype, self.group)

    @property
    def bytes(self) -> int:
        """Bytes of the full buffer, as `hlo.Collective.bytes`: a reduce-scatter
        returns `elements` per rank from a group-times larger input."""
        full = self.elements * (self.group if self.kind == "reduce-scatter" else 1)
        return full * hlo.DTYPE_BYTES[self.dtype]

    @property
    def ring_bytes(self) -> float:
        """Per rank, per collective: 2(g-1)/g x bytes for all-reduce, (g-1)/g else."""
        share = (self.group - 1) / self.group
        return (2 if self.kind == "all-reduce" else 1) * share * self.bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d | {"bytes": self.bytes}


def budget_for(cfg: Config) -> Budget:
    m, p = cfg.model, cfg.parallel
    return Budget(tp=p.tp, layers=m.n_layers, batch=cfg.train.batch_size // p.dp,
                  seq=m.seq_len, d_model=m.d_model, dtype_bytes=np.dtype(m.dtype).itemsize)


ANY_SCOPE = "(any)"  # a budget row matched by total elements, whatever the scopes


def expected_collectives(cfg: Config, impl: str) -> list[Expected]:
    """Every collective the train step of `cfg` needs under `impl`: over tp,
    and with dp > 1 over dp (`_expected_dp`)."""
    return _expected_tp(cfg, impl) + _expected_dp(cfg)


def param_shard_elements(cfg: Config) -> list[int]:
    """Elements of each parameter one tp rank holds (its shard), no allocation."""
    import jax
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType

    from .train_lib import build_model

    p = cfg.parallel
    mesh = AbstractMesh((p.dp, p.tp), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.sharding.use_abstract_mesh(mesh):
        params = nnx.state(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
    out = []
    for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        spec = v.get_metadata().get("out_sharding") or ()
        split = p.tp if "tp" in jax.tree.leaves(tuple(spec)) else 1
        out.append(int(np.prod(v.shape)) // split)
    return out


def _expected_dp(cfg: Config) -> list[Expected]:
    """Data parallelism: the loss is averaged over dp (one scalar all-reduce),
    and every parameter gradient (each rank's tp shard) is all-reduced over dp
    (a tied embedding twice: its lookup and LM-head gradients are reduced
    before they are added). XLA may combine, split or loop these (a scanned
    stack), so the budget is their total elements, whatever the scopes.
    FSDP (parameters split over dp) is not budgeted: its gathers and
    reduce-scatters are listed, not checked."""
    m, p = cfg.model, cfg.parallel
    if p.dp == 1 or p.fsdp:
        return []
    grads = sum(param_shard_elements(cfg))
    if m.tie_embeddings:
        grads += m.padded_vocab // p.tp * m.d_model
    pd = HLO_DTYPES[m.param_dtype]
    return [Expected("dp: mean of the loss over dp", "all-reduce", "forward", "", 1, "f32",
                     p.dp, 1),
            Expected("dp: every parameter gradient (tp shard), summed over dp", "all-reduce",
                     "backward", ANY_SCOPE, grads, pd, p.dp, 1)]


def _expected_tp(cfg: Config, impl: str) -> list[Expected]:
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return []
    b, s, L, dt = cfg.train.batch_size // cfg.parallel.dp, m.seq_len, m.n_layers, \
        HLO_DTYPES[m.dtype]
    act = b * s * m.d_model
    E = lambda name, kind, pass_, scope, n, count, dtype=dt, group=tp: \
        Expected(name, kind, pass_, scope, n, dtype, group, count)
    if cfg.parallel.sp:
        return _expected_sp(cfg, impl, E, b, s, L, act)
    rows = [
        E("g: vocab-parallel embedding lookup", "all-reduce", "forward", "embed", act, 1),
        E("g: attention out-proj output", "all-reduce", "forward", "attention", act, L),
        E("g: MLP down-proj output", "all-reduce", "forward", "mlp", act, L),
        E("cross-entropy: max, sum of exp, target logit", "all-reduce", "forward",
          "cross_entropy", b * s, 3, "f32"),
        E("f: dX entering the q/kv projection", "all-reduce", "backward", "attention", act, L),
        E("f: dX entering the MLP up-proj", "all-reduce", "backward", "mlp", act, L),
        E("f: dX entering the LM head", "all-reduce", "backward", "cross_entropy", act, 1),
        E("gradient norm: one sum of squares", "all-reduce", "other", "", 1, 1, "f32"),
    ]
    K, H = m.kv_heads, m.head_dim
    if K < tp:  # kv projection replicated: sum its gradient over the sharing ranks
        kv = b * s * 2 * K * H
        if impl == "shard_map" or K == 1:
            rows.append(E("kv gradient: sum over the ranks sharing a kv head", "all-reduce",
                          "backward", "attention", kv, L))
        else:  # GSPMD splits the same sum: within each kv group, then gathered
            rows += [E("kv gradient: sum within each group of tp/K ranks", "all-reduce",
                       "backward", "attention", kv // K, L, group=tp // K),
                     E("kv gradient: gathered across the K groups", "all-gather", "backward",
                       "attention", kv, L, group=K)]
    return rows


def _expected_sp(cfg: Config, impl: str, E, b: int, s: int, L: int, act: int):
    """Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2): each all-reduce of a
    region becomes an all-gather at its entry and a reduce-scatter at its exit
    (their mirrors in the backward pass), the same ring bytes. Elements count
    the result: a reduce-scatter returns b*s*h/tp. Replicated parameters used
    on sequence shards (norm scales, row-parallel biases, learned positions)
    get partial gradients, all-reduced over tp."""
    m, tp = cfg.model, cfg.parallel.tp
    shard, pd = act // tp, HLO_DTYPES[m.param_dtype]  # parameter gradients: param dtype
    rows = []
    for scope in ("attention", "mlp"):
        rows += [E(f"SP entry: all-gather into {scope}", "all-gather", "forward", scope, act, L),
                 E(f"SP exit: reduce-scatter out of {scope}", "reduce-scatter", "forward",
                   scope, shard, L),
                 E(f"SP exit, backward: all-gather of the {scope} output gradient",
                   "all-gather", "backward", scope, act, L),
                 E(f"SP entry, backward: reduce-scatter of dX into {scope}",
                   "reduce-scatter", "backward", scope, shard, L)]
    norm_params = (2 * L + 1) * (1 if m.style == "llama" else 2)
    rows += [
        E("SP embedding: reduce-scatter of the looked-up rows", "reduce-scatter", "forward",
          "embed", shard, 1),
        E("SP embedding, backward: all-gather", "all-gather", "backward", "embed", act, 1),
        E("SP LM head entry: all-gather", "all-gather", "forward", "cross_entropy", act, 1),
        E("SP LM head, backward: reduce-scatter of dX", "reduce-scatter", "backward",
          "cross_entropy", shard, 1),
        E("cross-entropy: max, sum of exp, target logit", "all-reduce", "forward",
          "cross_entropy", b * s, 3, "f32"),
        E("gradient norm: one sum of squares", "all-reduce", "other", "", 1, 1, "f32"),
        E("norm weights used on sequence shards: gradient sum", "all-reduce", "backward", "",
          m.d_model, norm_params, pd),
    ]
    if m.use_bias:
        rows += [E(f"{scope} row-parallel bias on sequence shards: gradient sum",
                   "all-reduce", "backward", scope, m.d_model, L, pd)
                 for scope in ("attention", "mlp")]
    if m.style != "llama":
        rows.append(E("learned positions on sequence shards: gradient sum", "all-reduce",
                      "backward", "", s * m.d_model, 1, pd))
    K, H = m.kv_heads, m.head_dim
    if K < tp:  # replicated kv projection fed the gathered x: its weight gradient
        rows.append(E("replicated kv weight gradient: sum over tp", "all-reduce", "backward",
                      "attention", m.d_model * 2 * K * H, L, pd))
    return rows


def _key(c: hlo.Collective) -> tuple:
    return (c.kind, c.pass_, c.scope, c.elements, c.dtype, c.group_size)


def check(colls: list[hlo.Collective], expected: list[Expected]) -> str | None:
    """None if the collectives are exactly the budget, else the first difference."""
    got = Counter()
    for c in colls:
        got[_key(c)] += c.count
    for e in expected:
        if e.scope == ANY_SCOPE:
            continue
        have = got.pop(e.key, 0)
        # a surplus of the same kind, size and group size may belong to an
        # any-scope row (a dp gradient as big as a tp activation); if not, it is
        # reported as unexpected below
        if have > e.count and any(x.scope == ANY_SCOPE for x in expected):
            got[e.key], have = have - e.count, e.count
        if have != e.count:
            return (f"{e.name}: expected {e.count} x {e.kind} of {e.elements} {e.dtype} over "
                    f"{e.group} devices ({e.pass_}, {e.scope or '-'}), found {have}")
    for e in expected:
        if e.scope != ANY_SCOPE:
            continue
        same = [k for k in got if (k[0], k[1], k[4], k[5]) ==
                (e.kind, e.pass_, e.dtype, e.group)]
        have = sum(k[3] * got.pop(k) for k in same)
        if have != e.elements * e.count:
            return (f"{e.name}: expected {e.elements * e.count} {e.dtype} elements in "
                    f"{e.kind}s over {e.group} devices ({e.pass_}), found {have}")
    for (kind, pass_, scope, n, dt, group), count in got.items():
        return (f"unexpected {kind} of {n} {dt} over {group} devices x{count} "
                f"({pass_}, scope {scope or '-'})")
    return None


# XLA's GPU combiners concatenate small collectives into one flat buffer (the
# CPU ones build tuples, which jaxtp.hlo splits again): the bytes stay, the
# per-tensor labels go. The comparison compiles without them.
GPU_UNCOMBINED = {"xla_gpu_all_reduce_combine_threshold_bytes": 0,
                  "xla_gpu_all_gather_combine_threshold_bytes": 0,
                  "xla_gpu_reduce_scatter_combine_threshold_bytes": 0}
CPU_SP_NOTE = ("XLA's CPU pipeline has no reduce-scatter creator, so GSPMD's sequence-"
               "parallel exits stay all-reduce + slice there (same ring bytes as "
               "reduce-scatter + all-gather); the GPU pipeline forms them")


def compare_hlo(cfg: Config, out_dir: str | Path, log: Callable[[str], None] = print,
                mesh=None) -> dict:
    """Compile the train step under both impls, check each against the budget.

    Writes `hlo_<impl>.txt` (optimized HLO) and `comm_report.json` into
    `out_dir`; returns the report (its `ok` is False on any deviation).
    `mesh`: a (dp, tp) mesh to compile for, e.g. of compile-only devices of
    another platform (`jax.experimental.topologies`); default: this machine's.
    """
    from .sharding import make_mesh
    from .train_lib import abstract_train_state, compile_train_step

    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(p.dp, p.tp) if mesh is None else mesh
    platform = mesh.devices.flat[0].platform
    options = GPU_UNCOMBINED if platform in ("gpu", "cuda", "rocm") else None
    impls, colls_by_impl, expected_by_impl = {}, {}, {}
    for impl in IMPLS:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(p, impl=impl))
        log(f"compiling the {impl} train step (tp={p.tp}, {m.n_layers} layers) ...")
        text = compile_train_step(abstract_train_state(c, mesh), t.batch_size, m.seq_len,
                                  compiler_options=options).as_text()
        (out / f"hlo_{impl}.txt").write_text(text)
        colls_by_impl[impl] = hlo.collectives(text)
        expected_by_impl[impl] = expected_collectives(c, impl)
        diff = check(colls_by_impl[impl], expected_by_impl[impl])
        impls[impl] = {"collectives": hlo.summarize(colls_by_impl[impl]),
                       "expected": [e.to_dict() for e in expected_by_impl[impl]],
                       "matches_budget": diff is None,
                       "verdict": "matches budget" if diff is None else diff + (
                           f" ({CPU_SP_NOTE})" if platform == "cpu" and p.sp and
                           impl == "gspmd" else "")}
    budget = budget_for(cfg)
    ring = {impl: sum(e.count * e.ring_bytes for e in rows)
            for impl, rows in expected_by_impl.items()}
    report = {
        "platform": platform, "tp": p.tp, "dp": p.dp, "layers": m.n_layers, "batch": budget.batch, "seq": m.seq_len,
        "d_model": m.d_model, "dtype_bytes": budget.dtype_bytes,
        "analytic": {
            "all_reduce_per_layer_fwd": budget.all_reduce_per_layer_fwd,
            "all_reduce_per_layer_bwd": budget.all_reduce_per_layer_bwd,
            "bytes_per_all_reduce": budget.bytes_per_all_reduce,
            "ring_bytes_per_all_reduce": budget.ring_bytes_per_all_reduce,
            "ring_bytes_per_layer": budget.ring_bytes_per_layer,
            "ring_bytes_blocks_per_step": budget.ring_bytes_blocks_per_step,
            # everything in the budget, blocks and outside them, per impl
            "ring_bytes_per_rank_per_step": ring,
        },
        "impls": impls,
        "ok": all(v["matches_budget"] for v in impls.values()),
    }
    (out / "comm_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for line in format_table(colls_by_impl, expected_by_impl):
        log(line)
    per_block = ("2 all-gathers + 2 reduce-scatters forward and backward, priced as" if p.sp
                 else "") + (f" {budget.all_reduce_per_layer_fwd} fwd + "
                             f"{budget.all_reduce_per_layer_bwd} bwd all-reduces")
    log(f"analytic (Megatron{'-SP' if p.sp else ''}): per block {per_block.strip()} "
        f"of b*s*h = {budget.batch}*"
        f"{budget.seq}*{budget.d_model} = {_size(budget.bytes_per_all_reduce)}; ring traffic per "
        f"rank {_size(budget.ring_bytes_per_all_reduce)} each, "
        f"{_size(budget.ring_bytes_per_layer)} per block, "
        f"{_size(budget.ring_bytes_blocks_per_step)} for the blocks per step; with the "
        "collectives outside the blocks: " + ", ".join(
            f"{_size(v)} ({k})" for k, v in ring.items()))
    for impl, r in impls.items():
        log(f"{impl}: {r['verdict']}")
    log(f"wrote {out / 'comm_report.json'} and hlo_<impl>.txt")
    return report


def _size(b: float) -> str:
    return f"{b / 2**20:.3f} MiB" if b >= 2**10 else f"{b:.0f} B"


def format_table(colls_by_impl: dict, expected_by_impl: dict) -> list[str]:
    """Side by side: each collective (kind, pass, scope, dtype[shape], devices,
    bytes) with its count per impl and in the budget."""
    impls = list(colls_by_impl)
    cells: dict[tuple, dict] = {}
    for impl in impls:
        for c in colls_by_impl[impl]:
            cell = cells.setdefault(_key(c), {"shape": c.shape, "bytes": c.bytes})
            cell[impl] = cell.get(impl, 0) + c.count
        for e in expected_by_impl[impl]:
            cell = cells.setdefault(e.key, {"shape": None, "bytes": e.bytes})
            cell[f"budget {impl}"] = e.count
    head = ["kind", "pass", "scope", "dtype[shape]", "devices", "bytes each"]
    for impl in impls:
        head += [impl, "budget"]
    rows = [head]
    order = {"forward": 0, "backward": 1, "other": 2}
    for key in sorted(cells, key=lambda k: (order.get(k[1], 3), k[2], k[0], -k[3])):
        kind, pass_, scope, n, dt, group = key
        cell = cells[key]
        shape = list(cell["shape"]) if cell["shape"] is not None else f"{n} elements"
        row = [kind, pass_, scope or "-", f"{dt}{shape}", str(group), _size(cell["bytes"])]
        for impl in impls:
            row += [str(cell.get(impl, 0)), str(cell.get(f"budget {impl}", 0))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
