"""The analytic budget on a hand-worked example, the budget against compiled
HLO for both implementations, and `--compare-hlo` / run.json end to end."""

import dataclasses
import json

import pytest

import train
from jaxtp import hlo
from jaxtp.comm import Budget, budget_for, check, count_sharded
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.sharding import make_mesh
from jaxtp.train_lib import abstract_train_state, compile_train_step

MiB = 2**20


def test_worked_example_by_hand():
    # b=4, s=2048, h=4096 bf16: 4*2048*4096 = 33,554,432 elements * 2 B = 64 MiB;
    # ring: 2*(8-1)/8 * 64 = 112 MiB per rank; 4 per block: 448 MiB.
    b = Budget(tp=8, layers=32, batch=4, seq=2048, d_model=4096, dtype_bytes=2)
    assert b.bytes_per_all_reduce == 64 * MiB
    assert b.ring_bytes_per_all_reduce == 112 * MiB
    assert b.ring_bytes_per_layer == 448 * MiB
    assert b.ring_bytes_per_rank_per_step == 32 * 448 * MiB
    assert dataclasses.replace(b, microbatches=4).ring_bytes_per_rank_per_step == \
        4 * 32 * 448 * MiB
    assert Budget(tp=1, layers=1, batch=1, seq=1, d_model=1, dtype_bytes=4).ring_factor == 0


MODEL = ModelConfig(vocab_size=64, n_layers=3, d_model=32, n_heads=8, d_ff=64, seq_len=16)


def compiled(tp, impl, model=MODEL):
    cfg = Config(model, TrainConfig(batch_size=4), ParallelConfig(tp=tp, impl=impl))
    state = abstract_train_state(cfg, make_mesh(1, tp))
    colls = hlo.collectives(compile_train_step(state, 4, model.seq_len).as_text())
    return cfg, colls, budget_for(cfg, count_sharded(state.param_shardings))


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_budget_holds_in_compiled_hlo(tp, impl):
    cfg, colls, budget = compiled(tp, impl)
    assert check(colls, budget, "f32") is None
    # Besides the blocks' 2 + 2 all-reduces, the only collectives are scalars:
    # the global gradient norm sums squares of every gradient, and for the 6
    # tp-sharded tensors per block (qkv kernel+bias, out kernel, up
    # kernel+bias, down kernel) each local sum is all-reduced over tp.
    assert budget.sharded_tensors == 6 * MODEL.n_layers
    scalars = [c for c in colls if c.shape == ()]
    assert sum(c.count for c in scalars) == 6 * MODEL.n_layers
    assert {(c.kind, c.pass_, c.dtype) for c in scalars} == {("all-reduce", "other", "f32")}
    acts = [c for c in colls if c.shape == (4, 16, 32)]
    assert sum(c.count for c in acts if c.pass_ == "forward") == 2 * MODEL.n_layers
    assert sum(c.count for c in acts if c.pass_ == "backward") == 2 * MODEL.n_layers
    assert {c.bytes for c in acts} == {budget.bytes_per_all_reduce} == {4 * 16 * 32 * 4}
    assert not [c for c in colls if c.kind == "all-gather"]  # no weight is gathered


def test_check_names_the_first_difference():
    cfg, colls, budget = compiled(4, "gspmd")
    drop = next(i for i, c in enumerate(colls) if c.pass_ == "backward" and c.scope == "mlp")
    missing = colls[:drop] + colls[drop + 1:]
    assert check(missing, budget, "f32") == (
        "f: dX entering MLP up-proj: expected 3 x f32[4, 16, 32], found 2")
    extra = colls + [dataclasses.replace(colls[0], kind="all-gather", name="x")]
    assert check(extra, budget, "f32").startswith("unexpected all-gather f32[4, 16, 32] x1")
    doubled = [dataclasses.replace(c, count=2 * c.count) for c in colls]
    assert "expected 3" in check(doubled, budget, "f32")
    wrong_group = [dataclasses.replace(colls[0], group_size=8)] + colls[1:]
    assert "spans 8 devices, not tp=4" in check(wrong_group, budget, "f32")


def test_compare_hlo_end_to_end(tmp_path, capsys):
    assert train.main(["--tp", "8", "--compare-hlo", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "gspmd: matches budget" in printed and "shard_map: matches budget" in printed
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert {"tp", "layers", "batch", "seq", "d_model", "dtype_bytes", "analytic",
            "impls"} <= set(report)
    assert {"all_reduce_per_layer_fwd", "all_reduce_per_layer_bwd", "bytes_per_all_reduce",
            "ring_bytes_per_rank_per_step"} <= set(report["analytic"])
    assert (report["tp"], report["layers"], report["batch"], report["seq"],
            report["d_model"]) == (8, 4, 16, 128, 128)
    assert report["analytic"]["bytes_per_all_reduce"] == 16 * 128 * 128 * 4
    for impl in ("gspmd", "shard_map"):
        r = report["impls"][impl]
        assert r["matches_budget"] is True
        assert all({"kind", "pass", "count", "shape", "dtype", "bytes"} <= set(c)
                   for c in r["collectives"])
        assert (tmp_path / f"hlo_{impl}.txt").read_text().startswith("HloModule")
    # the two implementations communicate identically
    assert report["impls"]["gspmd"]["collectives"] == report["impls"]["shard_map"]["collectives"]


def test_run_json_records_the_experiment(tmp_path):
    out = tmp_path / "run"
    assert train.main(["--tp", "4", "--impl", "shard_map", "--steps", "2", "--check",
                       "--out", str(out), "model.n_layers=2", "model.seq_len=32",
                       "train.batch_size=4", "train.eval_batches=1"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["tp"], run["impl"], run["mesh_device_ids"]) == (4, "shard_map", [[0, 1, 2, 3]])
    assert run["microbatch"] == {"b": 4, "s": 32, "tokens": 128}
    assert run["model"]["d_model"] == 128 and run["model"]["n_kv_heads"] == 8
    assert run["linear_layouts"]["blocks.1.attn.qkv"] == "column"
    assert run["linear_layouts"]["blocks.1.mlp.down"] == "row"
    assert len(run["linear_layouts"]) == 8
    per_layer = {(r["pass"], r["scope"]): r for r in run["collectives_per_layer"]}
    assert set(per_layer) == {(p, s) for p in ("forward", "backward")
                              for s in ("attention", "mlp")}
    assert all(r["count_per_layer"] == 1 and r["payload_bytes"] == 4 * 32 * 128 * 4
               for r in per_layer.values())
    chk = run["check"]
    assert chk["loss_diff"] < 1e-5 and chk["grad_norm_diff"] < 1e-5
    # Adam's first update is lr * g / (|g| + eps): entries whose gradient is
    # round-off-sized (the key bias) make this the most sensitive of the three
    assert chk["param_update_rel_error"] < 1e-4
