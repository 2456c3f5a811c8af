"""The step predictor: its arithmetic on a hand-made ledger against numbers
worked by hand, the axes' links, the cluster file's refusals, decode's two
regimes, the published comparison, and --plan --cluster end to end."""

import dataclasses
import json
import math

import pytest

import train
from jaxtp.analysis import cluster as C
from jaxtp.analysis import predict as P
from jaxtp.analysis.budget import expected_collectives
from jaxtp.config import apply_overrides, load_config, validate

SPEC = {"name": "hand", "devices_per_node": 4, "nodes": 2,
        "accelerator": {"name": "x", "peak_flops": 1e15, "matmul_fraction": 0.5,
                        "hbm_bandwidth": 1e12, "memory": 8e10},
        "intra": {"name": "fast", "bandwidth": 1e11, "latency": 1e-5},
        "inter": {"name": "slow", "bandwidth": 1e10, "latency": 2e-5}}


def test_step_arithmetic_on_a_hand_made_ledger():
    cluster = C.from_dict(SPEC)
    mesh = {"dp": 2, "tp": 4}  # tp inside a node of 4, dp across the 2 nodes
    traffic = [P.Traffic("all-reduce", 4e8, 4, ("tp",), 2),
               P.Traffic("all-gather", 1e8, 2, ("dp",), 1)]
    p = P.predict_step(cluster, mesh, flops=1e13, traffic=traffic, tokens=1000,
                       flops_per_token=2e9, hbm_bytes=5e9)
    # by hand: matmul 1e13 / (1e15 * 0.5) = 20 ms; HBM 5e9 / 1e12 = 5 ms;
    # tp: 2 x (10 us + 4e8 * 2*3/4 / 1e11) = 12.02 ms; dp: 20 us + 1e8 * 1/2 / 1e10 = 5.02 ms
    assert p["compute_s"] == pytest.approx(0.020) and p["memory_s"] == pytest.approx(0.005)
    assert p["axes"]["tp"]["seconds"] == pytest.approx(0.01202)
    assert p["axes"]["dp"]["seconds"] == pytest.approx(0.00502)
    assert p["axes"]["tp"]["link"] == "fast" and p["axes"]["dp"]["link"] == "slow"
    assert p["axes"]["tp"]["bytes"] == pytest.approx(2 * 6e8)
    assert p["exposed"]["step_s"] == pytest.approx(0.020 + 0.01704)
    assert p["hidden"]["step_s"] == pytest.approx(0.020)
    assert p["exposed"]["tokens_per_s"] == pytest.approx(1000 / 0.03704)
    assert p["hidden"]["tokens_per_s_per_device"] == pytest.approx(1000 / 0.020 / 8)
    assert p["hidden"]["mfu"] == pytest.approx(2e9 * 1000 / 0.020 / (8 * 1e15))
    assert p["axes"]["tp"]["share"] == pytest.approx(0.01202 / 0.03704)
    text = "\n".join(P.lines(p))
    assert "communication exposed: step 37.0 ms" in text and "tp: 2 collectives" in text


def test_axes_map_onto_links_for_one_and_eight_nodes():
    one, eight = C.PRESETS["h100x8"], C.PRESETS["h100x8x8nodes"]
    assert C.axis_links({"dp": 8, "tp": 1}, one)["dp"] is C.NVLINK4
    links = C.axis_links({"dp": 8, "tp": 8}, eight)
    assert links["tp"] is C.NVLINK4 and links["dp"] is C.IB_NDR
    links = C.axis_links({"dp": 2, "cp": 2, "tp": 2}, eight)  # 8 devices: one node
    assert {a: k.name for a, k in links.items()} == dict.fromkeys(("dp", "cp", "tp"), "NVLink 4")
    links = C.axis_links({"dp": 4, "cp": 4, "tp": 4}, eight)  # cp spans 16: two nodes
    assert (links["tp"], links["cp"], links["dp"]) == (C.NVLINK4, C.IB_NDR, C.IB_NDR)
    assert "tp=8 on NVLink 4" in C.describe({"dp": 8, "tp": 8}, eight)
    assert "dp=8 on InfiniBand NDR" in C.describe({"dp": 8, "tp": 8}, eight)
    with pytest.raises(C.ClusterError, match="needs 16 devices; h100x8 has 8"):
        C.axis_links({"dp": 2, "tp": 8}, one)


@pytest.mark.parametrize("path, value, match", [
    (("accelerator", "hbm_bandwidth"), None, "accelerator: missing field 'hbm_bandwidth'"),
    (("intra", "bandwidth"), -1.0, "intra: bandwidth=-1.0 must be a positive number"),
    (("nodes",), 0, "cluster: nodes=0 must be a positive number"),
    (("inter", "latency"), "fast", "inter: latency='fast' must be a positive number"),
    (("accelerator", "matmul_fraction"), 1.5, "matmul_fraction=1.5 is above 1"),
    (("accelerator",), None, "cluster: missing field 'accelerator'"),
])
def test_a_cluster_file_with_a_bad_field_is_refused_naming_it(tmp_path, path, value, match):
    spec = json.loads(json.dumps(SPEC))
    *parents, key = path
    d = spec
    for p in parents:
        d = d[p]
    if value is None:
        del d[key]
    else:
        d[key] = value
    f = tmp_path / "c.json"
    f.write_text(json.dumps(spec))
    with pytest.raises(C.ClusterError, match=match):
        C.load(str(f))
    f.write_text(json.dumps(SPEC))
    assert C.load(str(f)).devices == 8
    with pytest.raises(C.ClusterError, match="neither a preset .*h100x8"):
        C.load("h100x9")


def _cfg(*overrides, preset="llama3-8b"):
    return validate(apply_overrides(load_config(preset), ["model.dtype=bfloat16", *overrides]))


def test_decode_is_latency_bound_at_batch_1_and_bandwidth_bound_at_large_batch():
    cfg, a100 = _cfg(), C.PRESETS["a100x8"]
    small = {r["tp"]: r for r in P.predict_decode(cfg, a100, batch=1, context=256)}
    big = {r["tp"]: r for r in P.predict_decode(cfg, a100, batch=256, context=8192)}
    assert small[1]["comm_s"] == 0 and small[8]["latency_s"] > 0.99 * small[8]["comm_s"]
    # shard_map: 2 all-reduces per layer and the embedding's, plus sampling's 2: 67 x 20 us
    assert small[8]["latency_s"] == pytest.approx((2 * 32 + 1 + 2) * 20e-6)
    # the latency caps tp's speed-up far below 8
    assert small[8]["hbm_s"] == pytest.approx(small[1]["hbm_s"] / 8)
    assert 1 < small[8]["speedup"] < 4
    # at batch 256 the KV cache's reads dominate: HBM bandwidth-bound
    assert big[8]["hbm_s"] > 0.85 * big[8]["token_s"] and big[8]["speedup"] > 6.5
    # weights (8.03e9 x 2 B) and KV cache (2 x 32 x 256 x 8192 x 8 x 128 x 2 B) over HBM
    kv = 2 * 32 * 256 * 8192 * 8 * 128 * 2
    assert big[1]["hbm_s"] == pytest.approx((P.param_count(cfg) * 2 + kv) / 2.039e12)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "gpt2-small", "llama3-8b"])
def test_param_count_is_the_models(preset):
    import jax

    from jaxtp.parallel import make_mesh
    from jaxtp.train.state import abstract_train_state

    cfg = _cfg("parallel.tp=1", preset=preset)
    state = abstract_train_state(cfg, make_mesh(1, 1, devices=jax.devices()[:1]))
    real = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    assert P.param_count(cfg) == real


def test_the_published_rows_are_present_sourced_and_their_ratios_as_computed():
    from jaxtp.bench.published import bench_predict

    s = bench_predict()
    rows = s["rows"]
    assert len(rows) == 5
    for r in rows:
        assert r["source"] and r["misses"] and r["published"] > 0
        assert r["ratio_exposed"] == pytest.approx(r["predicted_exposed"] / r["published"])
        assert r["predicted_exposed"] <= r["predicted_hidden"]
    sources = " ".join(r["source"] for r in rows)
    for needle in ("llama3_h100_202412_torchtitan.md", "asyncTP_llama3_h100_2025-06",
                   "Table 2, FSDP 2 x CP 4", "gpt-fast"):
        assert needle in sources
    assert [r["published"] for r in rows] == [5762.0, 4378.0, 1071.0, 104.9, 328.4]


def test_plan_cluster_prices_the_compiled_step_as_the_ledger_does(capsys):
    """--plan --cluster end to end (tiny at tp=2 on CPU), and the compiled
    step's collectives priced the same as the ledger's."""
    assert train.main(["--config", "tiny", "--plan", "--tp", "2", "--cluster", "h100x8",
                       "model.n_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 on h100x8 (1 x 8 h100): tp=2 on NVLink 4" in out
    for needle in ("communication exposed: step", "communication hidden behind compute",
                   "tokens/s", "MFU", "  tp: ", "of the exposed step"):
        assert needle in out, needle
    from jaxtp.analysis.plan import analyze

    cfg = _cfg("parallel.tp=2", "model.n_layers=1", "model.dtype=float32", preset="tiny")
    row = analyze(cfg)
    compiled = sum(t["bytes"] * t["count"] for t in row["traffic"] if t["group"] > 1)
    ledger = sum(t.bytes * t.count for t in P.from_budget(expected_collectives(
        cfg, cfg.parallel.impl, "cpu")) if t.group > 1)
    assert compiled == ledger > 0


@pytest.mark.parametrize("argv, match", [
    (["--cluster", "h100x8"], "--cluster applies to --plan"),
    (["--plan", "--cluster", "nowhere"], "neither a preset"),
])
def test_cluster_flag_refusals(argv, match, capsys):
    assert train.main(argv) == 2
    assert match in capsys.readouterr().err


def test_every_preset_is_well_formed():
    for name, c in C.PRESETS.items():
        spec = dataclasses.asdict(c)
        assert C.from_dict(spec) == c, name
