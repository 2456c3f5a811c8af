"""The step predictor: its arithmetic on a hand-made ledger against numbers
worked by hand, the axes' links, the cluster file's refusals, decode's two
regimes, the published comparison, and --plan --cluster end to end."""

import dataclasses
import json
import math
import re

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


@pytest.mark.parametrize("text, match", [
    (b"5", "a cluster is a JSON object .*, not 5$"),
    (b"null", "a cluster is a JSON object .*, not null$"),
    (b"[8, 1]", "a cluster is a JSON object .*, not \\[8, 1\\]$"),
    (b"\xff\xfe{}", "not UTF-8 text \\(byte 0xff at offset 0\\)"),
    (json.dumps(SPEC | {"gpus_per_node": 8}).encode(),
     "cluster: unknown field 'gpus_per_node' \\(did you mean 'devices_per_node'\\?\\); the "
     "fields of cluster: name, accelerator, devices_per_node, nodes, intra, inter$"),
    (json.dumps(SPEC | {"intra": SPEC["intra"] | {"per_hops": True}}).encode(),
     "intra: unknown field 'per_hops' \\(did you mean 'per_hop'\\?\\); the fields of intra: "
     "name, bandwidth, latency, per_hop, source$"),
    (json.dumps(SPEC | {"accelerator": SPEC["accelerator"] | {"vendor": "x"}}).encode(),
     "accelerator: unknown field 'vendor'; the fields of accelerator: name, peak_flops, "
     "matmul_fraction, hbm_bandwidth, memory, source$"),
])
def test_a_cluster_file_that_is_no_cluster_is_refused_naming_the_file(tmp_path, text, match):
    """A JSON value that is not an object, bytes that are not UTF-8, and a
    field the cluster does not have (a misspelling would fall back to a
    default, or to "missing" for the field meant): one ClusterError, naming
    the file and, for a field, the ones there are."""
    f = tmp_path / "c.json"
    f.write_bytes(text)
    with pytest.raises(C.ClusterError, match=f"^{re.escape(str(f))}: {match}"):
        C.load(str(f))


@pytest.mark.parametrize("name, said", [
    ("", "--cluster '' is empty: name a preset (h100x8, "),
    ("  ", "--cluster '  ' is empty"),
    (".", "--cluster '.': neither a preset (h100x8, "),
])
def test_a_cluster_name_that_names_nothing_is_refused(name, said):
    with pytest.raises(C.ClusterError) as e:
        C.load(name)
    assert str(e.value).startswith(said), e.value
    assert str(e.value).endswith("a file (a directory)" if name == "." else "JSON file")


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
    # weights (8.03e9 x 2 B, less the untied lookup table, of which B rows are read) and
    # KV cache (2 x 32 x 256 x 8192 x 8 x 128 x 2 B) over HBM
    kv = 2 * 32 * 256 * 8192 * 8 * 128 * 2
    weights = (8_030_261_248 - 128_256 * 4_096) * 2
    assert big[1]["hbm_s"] == pytest.approx((weights + kv) / 2.039e12)
    # 8 kv heads: at tp=8 each device holds one; the cache splits 8 ways too
    assert big[8]["hbm_s"] == pytest.approx((weights + kv) / 8 / 2.039e12)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", ()), ("tiny", ("model.use_bias=false", "model.tie_embeddings=false")),
    ("llama-tiny", ()), ("llama-tiny", ("model.use_bias=true",)), ("gpt2-small", ()),
    ("llama3-8b", ()), ("moe-tiny", ()), ("moe-tiny", ("model.style=gpt2",)),
    ("moe-tiny", ("model.moe_shared_d_ff=64",)),
    ("moe-tiny", ("model.style=gpt2", "model.use_bias=true", "model.moe_shared_d_ff=64")),
    ("moe-tiny", ("model.qk_norm=true", "model.d_head=32", "model.moe_every=2",
                  "model.n_layers=4")),
    # Qwen2-MoE's q/k/v biases and gated shared expert; the loss-free balance's bias
    ("moe-tiny", ("model.qkv_bias=true", "model.moe_shared_d_ff=64",
                  "model.moe_shared_gate=true", "model.moe_balance=bias"))])
def test_param_count_is_the_models(preset, overrides):
    import jax

    from jaxtp.parallel import make_mesh
    from jaxtp.train.state import abstract_train_state

    cfg = _cfg("parallel.tp=1", *overrides, preset=preset)
    state = abstract_train_state(cfg, make_mesh(1, 1, devices=jax.devices()[:1]))
    real = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    assert P.param_count(cfg) == real


def test_the_published_rows_are_present_sourced_and_their_ratios_as_computed():
    from jaxtp.bench.published import bench_predict

    s = bench_predict(compile=False)  # the ledger's pricing (op by op: the test below)
    rows = s["rows"]
    assert len(rows) == 9
    for r in rows:
        assert r["source"] and r["misses"] and r["published"] > 0
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
        assert r["predicted"] == r["ledger_exposed"] <= r["ledger_hidden"]
    sources = " ".join(r["source"] for r in rows)
    for needle in ("llama3_h100_202412_torchtitan.md", "asyncTP_llama3_h100_2025-06",
                   "Table 2, FSDP 2 x CP 4", "Table 5, 1F1B", "Table 5, interleaved",
                   "gpt-fast", "Run_Mixtral.md (v5p-128)", "dgxc-benchmarking maxtext"):
        assert needle in sources
    assert [r["published"] for r in rows] == [5762.0, 4378.0, 1071.0, 100.0, 128.0, 251.94,
                                              74908.99 / 64, 104.9, 328.4]
    # 405B on 512 H100s (M = 32, pp 8): compute priced at each schedule's compiled
    # over useful block flops, interleaved's 71/64 against 1F1B's 39/32 (GPipe's);
    # a row's compute time is its exposed step less its communication share
    compute = lambda r: (1 - r["comm_share"]) / r["ledger_exposed"]
    assert compute(rows[4]) / compute(rows[3]) == pytest.approx((71 / 64) / (39 / 32))
    # by hand: Llama-3-8B's model flops per token at 8192, 6 (N - the untied lookup table)
    # + 12 L h s = 6 (8,030,261,248 - 128,256 x 4,096) + 12 x 32 x 4,096 x 8,192
    fpt = 6 * (8_030_261_248 - 128_256 * 4_096) + 12 * 32 * 4_096 * 8_192
    assert fpt == 57_914_449_920
    # FSDP's traffic hides behind compute: the bound is the H100's MAMF over the flops
    assert rows[0]["ledger_hidden"] == pytest.approx(792.1e12 / fpt)
    # Llama-2-7B at batch 1: 6,738,415,616 bf16 weights less the untied lookup table
    # (32,000 x 4,096, B rows read), and 205 tokens of K and V, over 2.039 TB/s
    read = (6_738_415_616 - 32_000 * 4_096) * 2 + 2 * 32 * 205 * 32 * 128 * 2
    assert rows[7]["predicted"] == pytest.approx(2.039e12 / read)
    # MaxText's Mixtral (TFLOP/s per chip, their count: the k experts' flops, attention
    # not causal, as jaxtp's model flops): below v5p's compute bound, 459 TFLOP/s x 6/8
    # (full remat recomputes the forward), even with the traffic hidden: FSDP gathers
    # every expert's weights over dp (46.7B parameters in bf16, twice under full remat)
    mix = rows[5]
    assert mix["measured"] == "TFLOP/s per chip" and mix["cluster"] == "v5p-128"
    assert mix["ledger_exposed"] < mix["ledger_hidden"] < 459 * 6 / 8
    assert "megablox" in mix["misses"] and "dropless" in mix["misses"]
    assert 251.94 / 459 == pytest.approx(0.5489, abs=1e-4)  # the published MFU, 54.89%


@pytest.mark.slow
def test_plan_cluster_prices_the_compiled_step_as_the_ledger_does(capsys):
    """--plan --cluster end to end (tiny at tp=2): compiled for the H100
    where its compiler is here and priced op by op, else on CPU and priced
    by the GPU ledger; and a CPU-compiled step's collectives priced the same
    as the ledger's."""
    from jaxtp.parallel.targets import TargetUnavailable, target_mesh

    try:
        target_mesh("h100", 1, 1)
        here = True
    except TargetUnavailable:
        here = False
    assert train.main(["--config", "tiny", "--plan", "--tp", "2", "--cluster", "h100x8",
                       "model.n_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 on h100x8 (1 x 8 h100): tp=2 on NVLink 4" in out
    needles = (("op by op from the compiled program: step", "top 5 ops", "exposed collectives",
                "all-reduce over tp") if here else
               ("communication exposed: step", "communication hidden behind compute", "  tp: ",
                "of the exposed step", "the GPU ledger"))
    for needle in needles + ("tokens/s", "MFU", "decode on h100x8, batch 1, 128 tokens cached",
                             "tp=2 "):
        assert needle in out, needle
    from jaxtp.analysis.plan import analyze
    from jaxtp.train.step import compiled_step

    cfg = _cfg("parallel.tp=2", "model.n_layers=1", "model.dtype=float32", preset="tiny")
    row = analyze(cfg, compile_step=compiled_step)
    compiled = sum(t["bytes"] * t["count"] for t in row["traffic"] if t["group"] > 1)
    ledger = sum(t.bytes * t.count for t in P.from_budget(expected_collectives(
        cfg, cfg.parallel.impl, "cpu")) if t.group > 1)
    assert compiled == ledger > 0  # the two readers of the step agree
    # and a CPU plan prices the GPU's ledger (XLA's CPU compile all-reduces in f32)
    P.plan_lines(row, cfg, "h100x8")
    gpu = P.from_budget(expected_collectives(cfg, cfg.parallel.impl, "gpu"))
    wire = sum(P.collective_time(t, C.NVLINK4)[1] for t in gpu)
    assert row["prediction"]["axes"]["tp"]["bytes"] == pytest.approx(wire)


@pytest.mark.parametrize("argv, match", [
    (["--cluster", "h100x8"], "--cluster applies to --plan"),
    (["--plan", "--cluster", "nowhere"], "neither a preset"),
    (["--plan", "--cluster", ""], "--cluster '' is empty"),
    (["--cluster", ""], "--cluster applies to --plan"),
    (["--calibrate"], "--calibrate applies to --plan"),
    (["--plan", "--tp", "8", "--cluster", "FOUR"], "dp*ep*cp*tp = 8 devices at the largest tp, "
     "and hand has 4"),
])
def test_cluster_flag_refusals(argv, match, capsys, tmp_path):
    four = tmp_path / "four.json"
    four.write_text(json.dumps(SPEC | {"devices_per_node": 4, "nodes": 1}))
    assert train.main([str(four) if a == "FOUR" else a for a in argv]) == 2
    assert match in capsys.readouterr().err


def test_every_preset_is_well_formed():
    for name, c in C.PRESETS.items():
        spec = dataclasses.asdict(c)
        assert C.from_dict(spec) == c, name


def test_each_kind_priced_on_its_wire_bytes_and_hops():
    fast = C.Link("f", 1e11, 1e-5)
    torus = C.Link("t", 1e11, 1e-6, per_hop=True)
    ring = lambda kind, link, n=8: P.collective_time(P.Traffic(kind, 8e8, n, ("tp",)), link)
    assert ring("all-reduce", fast) == pytest.approx((1e-5 + 8e8 * 14 / 8 / 1e11, 1.4e9))
    assert ring("all-gather", fast) == pytest.approx((1e-5 + 7e8 / 1e11, 7e8))
    assert ring("reduce-scatter", fast)[1] == pytest.approx(7e8)
    assert ring("collective-permute", fast) == pytest.approx((1e-5 + 8e8 / 1e11, 8e8))
    # a torus: the latency per ring step (all-reduce: 2(n-1) steps)
    assert ring("all-reduce", torus)[0] == pytest.approx(14 * 1e-6 + 1.4e9 / 1e11)
    assert ring("all-reduce", fast, n=1) == (0.0, 0.0)  # a group of one sends nothing
    # ledger rows: a reduce-scatter's elements are its output's, its buffer the input
    from jaxtp.analysis.rows import Expected

    rs = Expected("x", "reduce-scatter", "backward", "mlp", 1000, "bf16", 4, 3)
    ag = Expected("y", "all-gather", "forward", "mlp", 1000, "f32", 4, 1, axes=("dp",))
    assert P.from_budget([rs, ag]) == [P.Traffic("reduce-scatter", 8000, 4, ("tp",), 3),
                                       P.Traffic("all-gather", 4000, 4, ("dp",), 1)]


def test_a_node_size_the_groups_do_not_tile_puts_them_across_nodes():
    six = C.from_dict(SPEC | {"devices_per_node": 6, "nodes": 2})
    assert C.axis_links({"tp": 4}, six)["tp"].name == "slow"  # {4..7} spans two nodes
    assert C.axis_links({"tp": 2}, six)["tp"].name == "fast"
    for k, v, match in (("nodes", 1.5, "nodes=1.5 must be a whole number"),):
        with pytest.raises(C.ClusterError, match=match):
            C.from_dict(SPEC | {k: v})
    with pytest.raises(C.ClusterError, match="per_hop='false' must be true or false"):
        C.from_dict(SPEC | {"intra": SPEC["intra"] | {"per_hop": "false"}})
    assert C.one_device("TPU v5").accelerator is C.V5P
    assert C.one_device("TPU v5 lite") is None
    assert C.one_device("NVIDIA H100 80GB HBM3").accelerator is C.H100


def test_mixtral_param_count_and_active_flops_by_hand():
    """46,702,792,704 parameters (the published count; 32 layers of attention
    2 x 4096^2 + 2 x 4096 x 1024, router 4096 x 8, 8 experts of 3 x 4096 x
    14336, two norms; two 32000 x 4096 tables and the final norm); model
    flops per token count the 2 experts a token takes: 6 x (N - the lookup
    table - 6 idle experts a layer) + 12 L h s."""
    cfg = _cfg(preset="mixtral-8x7b")
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 8 * 3 * 4096 * 14336 + 2 * 4096
    n = 32 * layer + 2 * 32000 * 4096 + 4096
    assert P.param_count(cfg) == n == 46_702_792_704
    idle = 32 * 6 * 3 * 4096 * 14336
    assert P.step_flops(cfg) == 6 * (n - 32000 * 4096 - idle) + 12 * 32 * 4096 * 4096


def test_step_flops_count_each_forward_run_again():
    """6 x model flops per token (2 forward, 4 backward), plus 2 for each
    forward run again: full remat's, and 1F1B's keeping its stage inputs;
    both at once: 10/6."""
    base = P.step_flops(_cfg())
    pp = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.microbatches=4"]
    assert P.step_flops(_cfg(*pp)) == base
    assert P.step_flops(_cfg(*pp, "parallel.pp_stash=inputs")) == pytest.approx(base * 8 / 6)
    assert P.step_flops(_cfg("model.remat=full")) == pytest.approx(base * 8 / 6)
    assert P.step_flops(_cfg(*pp, "parallel.pp_stash=inputs", "model.remat=full")) == \
        pytest.approx(base * 10 / 6)


@pytest.mark.parametrize("cluster, tp, link", [("h100x8", 1, (450e9, 20e-6)),
                                               ("h100x8x8nodes", 8, (48e9, 25e-6))],
                         ids=["nvlink", "infiniband"])
def test_the_ep_all_to_alls_are_priced_on_the_link_ep_crosses(cluster, tp, link):
    """Mixtral at ep 8: inside a node (tp 1: ep's 8 ranks on NVLink) and
    across nodes (tp 8 innermost: ep's stride 8 leaves the node, InfiniBand).
    By hand: 4 all-to-alls per layer (dispatch, combine, their transposes)
    of a rank's slots, E x G_r x C x D = 8 x (64/8) x 1280 x 4096 bf16
    (C = ceil(1.25 x 4096 x 2 / 8)), each sending 7/8 of it: 32 x 4 x
    (latency + bytes x 7/8 / bandwidth)."""
    bandwidth, latency = link
    cfg = _cfg("parallel.ep=8", f"parallel.tp={tp}", preset="mixtral-8x7b")
    pred = P.predict_config(cfg, cluster)
    buffer = 8 * 8 * 1280 * 4096 * 2
    want = 32 * 4 * (latency + buffer * 7 / 8 / bandwidth)
    assert pred["axes"]["ep"]["kinds"]["all-to-all"] == pytest.approx(want, rel=1e-12)
    assert pred["axes"]["ep"]["link"] == ("NVLink 4" if tp == 1 else "InfiniBand NDR")


def test_each_schedule_prices_its_compiled_over_useful_flops():
    """The predictor's compute factor (`pp.compute_factor`) by hand at pp 2,
    M = 4: GPipe and 1F1B (M + p - 1)/M = 5/4; interleaved (vM + p - 1)/(vM)
    = 9/8 at v = 2; zb's weight gradients at v*M trips, a third of the work
    each: (3vM + 2(p - 1))/(3vM) = 14/12 and 26/24."""
    from jaxtp.analysis.pp import compute_factor
    pp = ["parallel.pp=2", "train.microbatches=4"]
    for kind, v, want in (("gpipe", 1, (5, 4)), ("1f1b", 1, (5, 4)), ("interleaved", 2, (9, 8)),
                          ("zb", 1, (14, 12)), ("zb", 2, (26, 24))):
        cfg = _cfg(*pp, f"parallel.pp_schedule={kind}", f"parallel.pp_repeats={v}")
        assert compute_factor(cfg) == want, kind


@pytest.mark.slow
def test_a_published_row_is_priced_op_by_op_from_its_h100_program():
    """The torchtitan 8B FSDP 8 row compiled deviceless for 8 H100s (~10 s):
    priced op by op; its step is no faster than its compiled matmul flops at
    H100's MAMF, and its tokens/s per GPU are the batch over that step."""
    from jaxtp.bench.published import TRAINING, training_row
    from jaxtp.parallel.targets import TargetUnavailable, target_mesh

    try:
        target_mesh("h100", 1, 1)
    except TargetUnavailable as e:
        pytest.skip(str(e))
    r = training_row(*TRAINING[0], log=lambda _: None)
    assert r["priced"] == "op by op"
    tokens, devices = 16 * 8192, 8
    assert r["predicted"] == pytest.approx(tokens / r["step_s"] / devices)
    fpt = 6 * (8_030_261_248 - 128_256 * 4_096) + 12 * 32 * 4_096 * 8_192 / 2  # causal
    assert r["step_s"] > fpt * tokens / devices / 792.1e12
    assert r["ratio"] == pytest.approx(r["predicted"] / 5762.0)
