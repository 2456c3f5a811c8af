"""The analytic Megatron communication budget, and the HLO comparison report.

Tensor parallelism per Shoeybi et al. 2019 ("Megatron-LM", Sec. 3, Fig. 4):
each Transformer block has two column -> row regions (attention, MLP), each
with one all-reduce forward (g) and one backward (f), so per block and
microbatch 2 + 2 all-reduces of the activation, b*s*h elements. Narayanan et
al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters",
Sec. 3.3) price each with a ring all-reduce: every rank sends and receives
2(t-1)/t of the payload.

Outside the blocks this model needs, per train step:
- embedding lookup and LM head / loss: nothing, while the vocabulary is
  replicated over tp (a vocab-parallel table would add reductions here);
- the global gradient norm: each tp-sharded gradient's local sum of squares
  is a scalar all-reduce over tp, one per sharded tensor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax

from . import hlo
from .config import Config, IMPLS

HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

# (kind, pass, scope) -> the name of that collective in Megatron's terms
NAMES = {
    ("all-reduce", "forward", "attention"): "g: attention out-proj output",
    ("all-reduce", "forward", "mlp"): "g: MLP down-proj output",
    ("all-reduce", "backward", "attention"): "f: dX entering attention QKV",
    ("all-reduce", "backward", "mlp"): "f: dX entering MLP up-proj",
    ("all-reduce", "other", ""): "gradient norm: sum of squares of a tp-sharded tensor",
}


@dataclasses.dataclass(frozen=True)
class Budget:
    """Megatron TP communication of one train step, per tp rank."""

    tp: int
    layers: int
    batch: int  # microbatch size on one dp rank
    seq: int
    d_model: int
    dtype_bytes: int
    microbatches: int = 1
    sharded_tensors: int = 0  # tp-sharded parameter tensors (gradient-norm scalars)
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
    def ring_bytes_per_rank_per_step(self) -> float:
        """Blocks only; the gradient-norm scalars add `extra_ring_bytes`."""
        return self.layers * self.microbatches * self.ring_bytes_per_layer

    @property
    def extra_ring_bytes(self) -> float:
        return self.ring_factor * 4 * self.sharded_tensors  # fp32 scalars

    def expected(self, dtype: str) -> dict[tuple, dict]:
        """(kind, pass, scope, shape, dtype) -> {count, name} the HLO must hold."""
        if self.tp == 1:
            return {}
        act = (self.batch, self.seq, self.d_model)
        n = self.layers * self.microbatches
        rows = {(k, p, s, act, dtype): n for (k, p, s) in NAMES if s}
        if self.sharded_tensors:
            rows[("all-reduce", "other", "", (), "f32")] = self.sharded_tensors
        return {key: {"count": c, "name": NAMES[key[:3]]} for key, c in rows.items()}

    def to_dict(self) -> dict:
        return {
            "all_reduce_per_layer_fwd": self.all_reduce_per_layer_fwd,
            "all_reduce_per_layer_bwd": self.all_reduce_per_layer_bwd,
            "elements_per_all_reduce": self.elements_per_all_reduce,
            "bytes_per_all_reduce": self.bytes_per_all_reduce,
            "ring_factor": self.ring_factor,
            "ring_bytes_per_all_reduce": self.ring_bytes_per_all_reduce,
            "ring_bytes_per_layer": self.ring_bytes_per_layer,
            "ring_bytes_per_rank_per_step": self.ring_bytes_per_rank_per_step,
            "outside_blocks": {
                "embedding": 0, "lm_head_and_loss": 0,
                "grad_norm_scalar_all_reduces": self.sharded_tensors,
                "grad_norm_ring_bytes": self.extra_ring_bytes,
            },
        }


def budget_for(cfg: Config, sharded_tensors: int = 0) -> Budget:
    m, p = cfg.model, cfg.parallel
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    return Budget(tp=p.tp, layers=m.n_layers, batch=cfg.train.batch_size // p.dp,
                  seq=m.seq_len, d_model=m.d_model, dtype_bytes=itemsize,
                  sharded_tensors=sharded_tensors if p.tp > 1 else 0)


def count_sharded(param_shardings) -> int:
    """Parameter tensors split over tp."""
    return sum("tp" in jax.tree.leaves(tuple(s.spec)) for s in jax.tree.leaves(param_shardings))


def _key(c: hlo.Collective) -> tuple:
    return (c.kind, c.pass_, c.scope, c.shape, c.dtype)


def check(colls: list[hlo.Collective], budget: Budget, dtype: str) -> str | None:
    """None if the collectives are exactly the budget, else the first difference."""
    got: dict[tuple, int] = {}
    for c in colls:
        got[_key(c)] = got.get(_key(c), 0) + c.count
        if c.group_size not in (budget.tp, None):
            return (f"{c.kind} {c.dtype}{list(c.shape)} ({c.pass_}, {c.scope or '-'}) "
                    f"spans {c.group_size} devices, not tp={budget.tp}")
    for key, want in budget.expected(dtype).items():
        have = got.pop(key, 0)
        if have != want["count"]:
            return (f"{want['name']}: expected {want['count']} x {key[4]}{list(key[3])}, "
                    f"found {have}")
    for (kind, pass_, scope, shape, dt), n in got.items():
        return f"unexpected {kind} {dt}{list(shape)} x{n} ({pass_}, scope {scope or '-'})"
    return None


def compare_hlo(cfg: Config, out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """Compile the train step under both impls, check each against the budget.

    Writes `hlo_<impl>.txt` (optimized HLO) and `comm_report.json` into
    `out_dir`; returns the report (its `ok` is False on any deviation).
    """
    from .sharding import make_mesh
    from .train_lib import abstract_train_state, compile_train_step

    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.dp != 1:
        raise ValueError(f"--compare-hlo checks the tp budget at dp=1, got dp={p.dp}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(p.dp, p.tp)
    dtype = HLO_DTYPES[m.dtype]
    impls, budget = {}, None
    for impl in IMPLS:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(p, impl=impl))
        log(f"compiling the {impl} train step (tp={p.tp}, {m.n_layers} layers) ...")
        state = abstract_train_state(c, mesh)
        text = compile_train_step(state, t.batch_size, m.seq_len).as_text()
        (out / f"hlo_{impl}.txt").write_text(text)
        colls = hlo.collectives(text)
        budget = budget_for(c, count_sharded(state.param_shardings))
        diff = check(colls, budget, dtype)
        impls[impl] = {"collectives": hlo.summarize(colls), "matches_budget": diff is None,
                       "verdict": "matches budget" if diff is None else diff}
    report = {"tp": p.tp, "layers": m.n_layers, "batch": budget.batch, "seq": m.seq_len,
              "d_model": m.d_model, "dtype_bytes": budget.dtype_bytes,
              "analytic": budget.to_dict(), "impls": impls,
              "ok": all(v["matches_budget"] for v in impls.values())}
    (out / "comm_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for line in format_table(report, budget, dtype):
        log(line)
    log(f"wrote {out / 'comm_report.json'} and hlo_<impl>.txt")
    return report


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f} MiB" if b >= 2**10 else f"{b:.0f} B"


def format_table(report: dict, budget: Budget, dtype: str) -> list[str]:
    """Side-by-side rows: kind, pass, scope, shape, bytes; count per impl and budget."""
    counts: dict[tuple, dict] = {}
    for impl, r in report["impls"].items():
        for row in r["collectives"]:
            key = (row["kind"], row["pass"], row["scope"], tuple(row["shape"]), row["dtype"])
            counts.setdefault(key, {"bytes": row["bytes"]})[impl] = row["count"]
    for key, want in budget.expected(dtype).items():
        counts.setdefault(key, {"bytes": hlo.Collective(
            key[0], key[4], key[3], budget.tp, key[1], key[2], "", "").bytes})["budget"] = \
            want["count"]
    head = ["kind", "pass", "scope", "dtype[shape]", "bytes each", *report["impls"], "budget"]
    rows = [head]
    for key in sorted(counts, key=lambda k: (k[1] != "forward", k[1], k[2], k[0])):
        v = counts[key]
        rows.append([key[0], key[1], key[2] or "-", f"{key[4]}{list(key[3])}", _mib(v["bytes"]),
                     *(str(v.get(i, 0)) for i in report["impls"]), str(v.get("budget", 0))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    a = report["analytic"]
    lines += [
        "",
        f"analytic (Megatron, tp={budget.tp}, b={budget.batch}, s={budget.seq}, "
        f"h={budget.d_model}, {budget.dtype_bytes} B/elem): per block "
        f"{a['all_reduce_per_layer_fwd']} fwd + {a['all_reduce_per_layer_bwd']} bwd all-reduces "
        f"of {_mib(a['bytes_per_all_reduce'])}; ring traffic per rank "
        f"{_mib(a['ring_bytes_per_all_reduce'])} each, {_mib(a['ring_bytes_per_layer'])} per "
        f"block, {_mib(a['ring_bytes_per_rank_per_step'])} per step "
        f"(+ {a['outside_blocks']['grad_norm_scalar_all_reduces']} gradient-norm scalars)",
    ]
    lines += [f"{impl}: {r['verdict']}" for impl, r in report["impls"].items()]
    return lines


def linear_layouts(model) -> dict[str, str]:
    """'blocks.0.attn.qkv' -> 'column' / 'row', for every tensor-parallel linear."""
    from flax import nnx

    from .layers import ColumnParallelLinear, RowParallelLinear

    kinds = {ColumnParallelLinear: "column", RowParallelLinear: "row"}
    return {".".join(map(str, path)): kinds[type(mod)] for path, mod in nnx.iter_modules(model)
            if type(mod) in kinds}


def run_record(cfg: Config, mesh, model, hlo_text: str, check: dict | None = None) -> dict:
    """What an engineer records for a TP experiment (written as run.json)."""
    m, p = cfg.model, cfg.parallel
    b = cfg.train.batch_size // p.dp
    colls = hlo.collectives(hlo_text)
    per_layer = [
        {**row, "count_per_layer": row["count"] / m.n_layers, "payload_bytes": row["bytes"],
         "name": NAMES.get((row["kind"], row["pass"], row["scope"]), "")}
        for row in hlo.summarize(colls) if row["scope"] in ("attention", "mlp")]
    outside = [r for r in hlo.summarize(colls) if r["scope"] not in ("attention", "mlp")]
    return {
        "tp": p.tp, "dp": p.dp, "impl": p.impl,
        "platform": mesh.devices.flat[0].platform,
        "mesh_device_ids": mesh.device_ids.tolist(),  # [dp][tp]
        "model": {"d_model": m.d_model, "d_ff": m.d_ff, "n_heads": m.n_heads,
                  "n_kv_heads": m.n_heads, "n_layers": m.n_layers, "vocab_size": m.vocab_size,
                  "dtype": m.dtype},
        "microbatch": {"b": b, "s": m.seq_len, "tokens": b * m.seq_len},
        "linear_layouts": linear_layouts(model),
        "collectives_per_layer": per_layer,
        "collectives_outside_blocks": outside,
        "check": check,
    }
