"""The analytic budget on a hand-worked example, the budget against compiled
HLO for the three implementations, and `--compare-hlo` / run.json end to end."""

import dataclasses
import json
from collections import Counter

import pytest

import train
from jaxtp import hlo
from jaxtp.analysis.budget import Budget, expected_collectives
from jaxtp.analysis.rows import ANY_SCOPE, check, row_cells
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.parallel import make_mesh
from jaxtp.train.state import abstract_train_state
from jaxtp.train.step import compile_train_step

MiB = 2**20


def test_worked_example_by_hand():
    # b=4, s=2048, h=4096 bf16: 4*2048*4096 = 33,554,432 elements * 2 B = 64 MiB;
    # ring: 2*(8-1)/8 * 64 = 112 MiB per rank; 4 per block: 448 MiB.
    b = Budget(tp=8, layers=32, batch=4, seq=2048, d_model=4096, dtype_bytes=2)
    assert b.bytes_per_all_reduce == 64 * MiB
    assert b.ring_bytes_per_all_reduce == 112 * MiB
    assert b.ring_bytes_per_layer == 448 * MiB
    assert b.ring_bytes_blocks_per_step == 32 * 448 * MiB
    assert dataclasses.replace(b, microbatches=4).ring_bytes_blocks_per_step == \
        4 * 32 * 448 * MiB
    assert Budget(tp=1, layers=1, batch=1, seq=1, d_model=1, dtype_bytes=4).ring_factor == 0


# 2 layers: the fewest that tell a per-layer collective from a per-step one
MODEL = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16)
LLAMA = ModelConfig(style="llama", vocab_size=61, n_layers=2, d_model=64, n_heads=8,
                    n_kv_heads=2, d_ff=64, seq_len=16, tie_embeddings=False, use_bias=False)


def compiled(tp, impl, model=MODEL):
    cfg = Config(model, TrainConfig(batch_size=4), ParallelConfig(tp=tp, impl=impl))
    state = abstract_train_state(cfg, make_mesh(1, tp))
    colls = hlo.collectives(compile_train_step(state, 4, model.seq_len).as_text())
    return cfg, colls


# tp=8 under each impl, and the smallest group (2) once; tp=4 (with dp=2):
# tests/train/test_scale.py
@pytest.mark.parametrize("tp, impl", [(2, "gspmd"), (8, "gspmd"), (8, "shard_map"),
                                      (8, "explicit")])
def test_budget_holds_in_compiled_hlo(tp, impl):
    cfg, colls = compiled(tp, impl)
    assert check(colls, expected_collectives(cfg, impl)) is None
    # Independently of jaxtp.analysis.budget, by hand: per block 2 forward + 2 backward
    # all-reduces of b*s*h = 4*16*32; outside the blocks the vocab-parallel
    # embedding (forward), the LM head's dX (backward), three b*s fp32
    # cross-entropy reductions, and one scalar for the gradient norm.
    L, act = MODEL.n_layers, 4 * 16 * 32
    count = lambda **kw: sum(c.count for c in colls
                             if all(getattr(c, k) == v for k, v in kw.items()))
    for scope in ("attention", "mlp"):
        for pass_ in ("forward", "backward"):
            assert count(scope=scope, pass_=pass_, elements=act, kind="all-reduce") == L
    assert count(scope="embed", pass_="forward", elements=act) == 1
    assert count(scope="cross_entropy", pass_="backward", elements=act) == 1
    assert count(scope="cross_entropy", pass_="forward", elements=4 * 16, dtype="f32") == 3
    assert count(pass_="other", elements=1) == 1
    assert sum(c.count for c in colls) == 4 * L + 6
    assert {c.group_size for c in colls} == {tp} and {c.kind for c in colls} == {"all-reduce"}
    assert all(c.bytes == act * 4 for c in colls if c.elements == act)


test_budget_holds_in_compiled_hlo.fast_cases = {'8-shard_map', '8-gspmd', '8-explicit'}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_a_float16_step_holds_the_budget_as_xla_cpu_carries_it(impl):
    """model.dtype=float16 at tp=8 on XLA:CPU: the activations' all-reduces
    travel in f16 (bf16's in fp32: jaxtp.analysis.backends); GSPMD reduces
    the LM head's dX in the fp32 of the logits' gradient, shard_map in f16."""
    cfg, colls = compiled(8, impl, dataclasses.replace(MODEL, dtype="float16"))
    assert check(colls, expected_collectives(cfg, impl, "cpu")) is None
    act = 4 * 16 * 32
    dtypes = lambda **kw: {c.dtype for c in colls if all(getattr(c, k) == v
                                                         for k, v in kw.items())}
    assert dtypes(scope="attention", elements=act) == dtypes(scope="mlp", elements=act) == {
        "f16"}
    assert dtypes(scope="cross_entropy", pass_="backward", elements=act) == {
        "f32" if impl == "gspmd" else "f16"}


@pytest.mark.parametrize("tp, impl", [(2, "shard_map"), (8, "gspmd"), (8, "shard_map"),
                                      (8, "explicit")])
def test_llama_gqa_budget(tp, impl):
    """2 kv heads: sharded at tp=2; at tp=8 replicated, so the kv gradient
    (b*s*2*K*H per block) is summed over the ranks sharing each kv head:
    shard_map and explicit (which picks each rank's kv head by a contraction
    over tp) in one all-reduce, GSPMD in two steps."""
    cfg, colls = compiled(tp, impl, LLAMA)
    assert check(colls, expected_collectives(cfg, impl)) is None
    kv = Counter()
    for c in colls:
        if c.elements in (4 * 16 * 2 * 2 * 8, 4 * 16 * 2 * 8):
            kv[(c.kind, c.elements, c.group_size)] += c.count
    if tp == 2:
        assert kv == {}
    elif impl != "gspmd":  # one all-reduce over tp of the whole kv gradient, per block
        assert kv == {("all-reduce", 4 * 16 * 2 * 2 * 8, 8): 2}
    else:  # GSPMD: within each 4-rank group, then gathered over the 2 groups
        assert kv == {("all-reduce", 4 * 16 * 2 * 8, 4): 2,
                      ("all-gather", 4 * 16 * 2 * 2 * 8, 2): 2}


test_llama_gqa_budget.fast_cases = {'8-gspmd'}


@pytest.mark.slow
@pytest.mark.parametrize("model, tp", [(MODEL, 2), (MODEL, 8), (LLAMA, 4)])
def test_sequence_parallel_budget_in_shard_map(model, tp):
    """SP: no all-reduce of activations is left; per block 2 all-gathers and 2
    reduce-scatters forward and backward, the same ring bytes as 4 all-reduces."""
    cfg = Config(model, TrainConfig(batch_size=4),
                 ParallelConfig(tp=tp, impl="shard_map", sp=True))
    state = abstract_train_state(cfg, make_mesh(1, tp))
    colls = hlo.collectives(compile_train_step(state, 4, model.seq_len).as_text())
    assert check(colls, expected_collectives(cfg, "shard_map")) is None
    act = 4 * 16 * model.d_model
    L = model.n_layers
    blocks = [c for c in colls if c.scope in ("attention", "mlp") and act in
              (c.elements, c.elements * tp)]
    assert sum(c.count for c in blocks if c.kind == "all-gather") == 4 * L
    assert sum(c.count for c in blocks if c.kind == "reduce-scatter") == 4 * L
    assert not [c for c in colls if c.kind == "all-reduce" and c.elements == act]
    ring = sum(c.count * (c.group_size - 1) / c.group_size * c.bytes for c in blocks)
    no_sp = 4 * L * 2 * (tp - 1) / tp * act * 4  # the 2 + 2 all-reduces per block
    assert ring == pytest.approx(no_sp)
    # and the budget prices it the same way
    in_blocks = lambda rows: sum(e.count * e.ring_bytes for e in rows
                                 if e.scope in ("attention", "mlp") and e.bytes == act * 4)
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sp=False))
    assert in_blocks(expected_collectives(cfg, "shard_map")) == pytest.approx(no_sp)
    assert in_blocks(expected_collectives(plain, "shard_map")) == pytest.approx(no_sp)




@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, LLAMA], ids=["gpt2", "llama-gqa"])
def test_sequence_parallel_budget_in_explicit(model):
    """impl explicit with SP at tp=8 holds the budget as XLA's CPU pipeline
    carries it out: each exit reshard is an all-reduce and a slice there (no
    reduce-scatter creator, as for GSPMD); by hand, per block 2 all-gathers
    into the regions and 2 of the output gradients, 2 + 2 all-reduces of
    b*s*h for the exits and the backward entries."""
    tp, L, act = 8, model.n_layers, 4 * 16 * model.d_model
    cfg = Config(model, TrainConfig(batch_size=4),
                 ParallelConfig(tp=tp, impl="explicit", sp=True))
    state = abstract_train_state(cfg, make_mesh(1, tp, impl="explicit"))
    colls = hlo.collectives(compile_train_step(state, 4, model.seq_len).as_text())
    assert check(colls, expected_collectives(cfg, "explicit", "cpu")) is None
    blocks = Counter()
    for c in colls:
        if c.scope in ("attention", "mlp") and c.elements == act:
            blocks[(c.kind, c.pass_)] += c.count
    assert blocks == {("all-gather", "forward"): 2 * L, ("all-reduce", "forward"): 2 * L,
                      ("all-gather", "backward"): 2 * L, ("all-reduce", "backward"): 2 * L}




@pytest.mark.parametrize("model, dp, tp, remat, bidi", [
    (MODEL, 1, 8, "none", False), (MODEL, 2, 4, "none", False), (MODEL, 1, 8, "minimal", False),
    (LLAMA, 1, 8, "dots", False), (MODEL, 1, 8, "none", True), (MODEL, 2, 4, "dots", True)],
    ids=["gpt2-tp8", "gpt2-dp2-tp4", "gpt2-remat", "llama-gqa-remat-dots", "gpt2-tp8-bidi",
         "gpt2-dp2-tp4-dots-bidi"])
def test_collective_matmul_budget_in_shard_map(model, dp, tp, remat, bidi):
    """overlap=collective_matmul: inside the blocks no all-gather or
    reduce-scatter is left; each region's entry and exit is tp - 1
    collective-permutes of one sequence chunk (b*s*h/tp) forward and tp - 1
    backward (a remat policy runs the entry's ring once more), the ring bytes
    of the SP collectives they replace. Bidirectional: twice the permutes,
    of half a chunk each, the same bytes."""
    # 2 layers: the rings (tp - 1 steps each, unrolled) make long programs
    model = dataclasses.replace(model, remat=remat, n_layers=2)
    cfg = Config(model, TrainConfig(batch_size=4 * dp),
                 ParallelConfig(dp=dp, tp=tp, impl="shard_map", sp=True,
                                overlap="collective_matmul_bidi" if bidi else
                                "collective_matmul"))
    state = abstract_train_state(cfg, make_mesh(dp, tp))
    colls = hlo.collectives(compile_train_step(state, 4 * dp, model.seq_len).as_text())
    assert check(colls, expected_collectives(cfg, "shard_map")) is None
    L, act = model.n_layers, 4 * 16 * model.d_model
    blocks = [c for c in colls if c.scope in ("attention", "mlp")]
    assert not [c for c in blocks if c.kind in ("all-gather", "reduce-scatter")]
    # by the mesh axes each spans: the rings over tp; the blocks' all-reduces
    # over tp only sum the gradients of weights tp does not split (a bias under
    # SP, a replicated kv projection), none activation-sized; the others are
    # the weight gradients' over dp
    sizes = {"dp": dp, "tp": tp}
    assert {c.axes(sizes) for c in blocks if c.kind == "collective-permute"} == {("tp",)}
    reduced = [c for c in blocks if c.kind == "all-reduce"]
    assert {c.axes(sizes) for c in reduced} <= {("tp",), ("dp",)}
    assert all(c.pass_ == "backward" and c.elements < act
               for c in reduced if c.axes(sizes) == ("tp",))
    assert any(c.axes(sizes) == ("dp",) for c in reduced) == (dp > 1)
    k = 1 + bidi  # permutes per ring step, each of 1/k of a chunk
    permutes = lambda pass_: sum(c.count for c in blocks if c.kind == "collective-permute"
                                 and c.pass_ == pass_ and c.elements == act // tp // k)
    regathers = 2 if remat != "none" else 0  # attention's and the MLP's entry, again
    assert permutes("forward") == 4 * (tp - 1) * L * k
    assert permutes("backward") == (4 + regathers) * (tp - 1) * L * k
    assert sum(c.count for c in blocks if c.kind == "collective-permute") == \
        (8 + regathers) * (tp - 1) * L * k
    # the budget prices the rings at the ring bytes of the collectives they replace
    no_sp = 4 * L * 2 * (tp - 1) / tp * act * 4  # the 2 + 2 all-reduces per block
    rows = [e for e in expected_collectives(cfg, "shard_map") if e.kind == "collective-permute"]
    assert sum(e.count * e.ring_bytes for e in rows) == pytest.approx(no_sp * (8 + regathers) / 8)


test_collective_matmul_budget_in_shard_map.fast_cases = set()  # the fast tier: test_overlap


@pytest.mark.parametrize("model, dp, tp, remat, fsdp, impl", [
    (MODEL, 1, 8, "none", False, "gspmd"), (MODEL, 2, 4, "full", True, "gspmd"),
    (LLAMA, 1, 8, "dots", False, "explicit"), (LLAMA, 1, 2, "full", False, "explicit")],
    ids=["gpt2-tp8", "gpt2-dp2-tp4-fsdp-full", "llama-kv-replicated-dots",
         "llama-kv-sharded-full"])
def test_windowed_overlap_budget_below_the_threshold(model, dp, tp, remat, fsdp, impl):
    """GSPMD's overlap below XLA's CPU threshold: SP's collectives, each
    entry's input gathered once more for its weight gradient (one more for
    remat "full"'s recomputed entry), a kv-replicating attention (K < tp) at
    SP's plain entry; each on its mesh axis, FSDP's weights gathered over dp
    once (outside the rematerialised matmul)."""
    model = dataclasses.replace(model, remat=remat)
    cfg = Config(model, TrainConfig(batch_size=4 * dp),
                 ParallelConfig(dp=dp, tp=tp, impl=impl, sp=True, fsdp=fsdp,
                                overlap="collective_matmul"))
    state = abstract_train_state(cfg, make_mesh(dp, tp, impl=impl))
    colls = hlo.collectives(compile_train_step(state, 4 * dp, model.seq_len).as_text())
    expected = expected_collectives(cfg, impl, "cpu")
    assert check(colls, expected, {"dp": dp, "tp": tp}) is None
    assert not [c for c in colls if c.kind == "collective-permute"]
    again = Counter()
    for e in expected:
        if e.name.startswith("SP overlap"):
            again[e.scope] += e.count
    L, grouped = model.n_layers, model.kv_heads >= tp
    # a kv-replicating attention keeps SP's own remat regather (remat != none)
    assert again == {"mlp": (1 + (remat == "full")) * L, "cross_entropy": 1,
                     "attention": (1 + (remat == "full")) * L if grouped else L}


test_windowed_overlap_budget_below_the_threshold.fast_cases = {"gpt2-tp8"}


@pytest.mark.slow
def test_collective_matmul_under_gspmd_on_cpu_below_the_threshold(tmp_path, capsys):
    """At ordinary shapes XLA's CPU compiler forms no windowed loop (its
    threshold is 100000 MiB): GSPMD's and explicit's overlapped step is SP's
    collectives with x split along T into each entry's matmul, gathered again
    for the weight gradient, and --compare-hlo says why no loop formed."""
    assert train.main(["--tp", "4", "--sp", "--overlap", "collective_matmul", "--compare-hlo",
                       "--out", str(tmp_path), "model.n_layers=1", "model.d_model=32",
                       "model.d_ff=64", "model.n_heads=4", "model.seq_len=16",
                       "train.batch_size=4"]) == 0
    out = capsys.readouterr().out
    for impl in ("gspmd", "explicit"):
        assert (f"{impl} on cpu: no windowed-einsum loop: XLA's CPU compiler windows a dot only "
                "past 100,000 MiB of global operand bytes; this step's [b, s, h] activation is "
                "0.008 MiB") in out
    report = json.loads((tmp_path / "comm_report.json").read_text())
    for impl in ("gspmd", "explicit"):
        got = report["impls"][impl]
        assert got["windowed_einsum"]["loops"] == [] and "past 100,000 MiB" in \
            got["windowed_einsum"]["why"]
        kinds = {c["kind"] for c in got["collectives"]}
        assert "collective-permute" not in kinds and "all-gather" in kinds
        # the regather: the attention's, the MLP's and the LM head's input, once more
        again = [e for e in got["expected"] if e["name"].startswith("SP overlap")]
        assert sorted(e["scope"] for e in again) == ["attention", "cross_entropy", "mlp"]
    assert "collective-permute" in {c["kind"] for c in report["impls"]["shard_map"]["collectives"]}
    assert report["ok"]
    # the picture holds one entry per collective row and impl (the full check
    # of its contents: tests/plot/test_plot.py)
    svg = (tmp_path / "collectives.svg").read_text()
    assert svg.count('class="collective"') == sum(
        1 for r in report["table"] for i in report["impls"] if r["counts"][i] or r["budget"][i])


def test_check_names_the_first_difference():
    cfg, colls = compiled(4, "gspmd")
    expected = expected_collectives(cfg, "gspmd")
    drop = next(i for i, c in enumerate(colls) if c.pass_ == "backward" and c.scope == "mlp")
    missing = colls[:drop] + colls[drop + 1:]
    assert check(missing, expected) == (
        "f: dX entering the MLP up-proj: expected 2 x all-reduce of 2048 f32 over 4 devices "
        "(backward, mlp), found 1")
    extra = colls + [dataclasses.replace(colls[0], kind="all-gather", name="x")]
    assert check(extra, expected).startswith("unexpected all-gather of 2048 f32 over 4")
    doubled = [dataclasses.replace(c, count=2 * c.count) for c in colls]
    assert "expected 1 x" in check(doubled, expected)
    wrong_group = [dataclasses.replace(c, group_size=8) for c in colls]
    assert "found 0" in check(wrong_group, expected)


@pytest.mark.slow
def test_compare_hlo_end_to_end(tmp_path, capsys):
    assert train.main(["--tp", "8", "--compare-hlo", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for impl in ("gspmd", "shard_map", "explicit"):
        assert f"{impl}: matches budget" in printed
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert {"tp", "layers", "batch", "seq", "d_model", "dtype_bytes", "analytic",
            "impls"} <= set(report)
    assert {"all_reduce_per_layer_fwd", "all_reduce_per_layer_bwd", "bytes_per_all_reduce",
            "ring_bytes_per_rank_per_step"} <= set(report["analytic"])
    assert (report["tp"], report["layers"], report["batch"], report["seq"],
            report["d_model"]) == (8, 4, 16, 128, 128)
    assert report["analytic"]["bytes_per_all_reduce"] == 16 * 128 * 128 * 4
    assert set(report["impls"]) == {"gspmd", "shard_map", "explicit"}
    for impl in report["impls"]:
        r = report["impls"][impl]
        assert r["matches_budget"] is True
        assert all({"kind", "pass", "count", "shape", "dtype", "bytes", "axes"} <= set(c)
                   for c in r["collectives"])
        assert (tmp_path / f"hlo_{impl}.txt").read_text().startswith("HloModule")
    # the three implementations communicate identically
    # tp=8 alone: every collective spans tp (31.541 MiB of ring traffic is the budget's;
    # by_axis sums full buffers)
    for impl in report["impls"]:
        assert set(report["impls"][impl]["by_axis"]) == {"tp"}
        assert f"{impl} by mesh axis: tp " in printed
    assert report["impls"]["gspmd"]["collectives"] == report["impls"]["shard_map"]["collectives"]
    assert report["impls"]["gspmd"]["collectives"] == report["impls"]["explicit"]["collectives"]


@pytest.mark.slow
def test_compare_hlo_of_a_pipeline(tmp_path, capsys):
    """pp=2 x tp=4: gspmd and shard_map match the ledger (with rows on the
    pp axis), explicit is refused in one line, the ticks and the bubble are
    read from each program and printed beside the analytic ones."""
    assert train.main(["--pp", "2", "--tp", "4", "--compare-hlo", "--out", str(tmp_path),
                       "model.d_model=32", "model.d_ff=64", "model.n_heads=4",
                       "model.seq_len=16"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["ok"] and set(report["impls"]) == {"gspmd", "shard_map"}
    assert "explicit: refused before compiling: pipeline parallelism" in printed
    assert report["pipeline"]["ticks"] == {"gspmd": 5, "shard_map": 5}  # M=4 (2N) + 2 - 1
    assert "bubble (p-1)/(v*M+p-1) = 20.0% analytic, 20.0% (gspmd), 20.0% (shard_map)" \
        in printed
    for impl in ("gspmd", "shard_map"):
        assert f"{impl}: matches budget" in printed
        assert any(e["axes"] == ["pp"] and e["kind"] == "collective-permute"
                   for e in report["impls"][impl]["expected"])
    assert (tmp_path / "pipeline.svg").read_text().count('class="cell"') == 2 * 2 * 5
    # per rank: a stage's 2 of the 4 layers over 5 ticks
    a = report["analytic"]
    assert (report["layers"], report["pp"]) == (4, 2)
    assert a["ring_bytes_blocks_per_step"] == 2 * 5 * a["ring_bytes_per_layer"]
    # the table reads without its totals: a dp gradient summed with the others
    # over pp x dp shows "(any)" as its budget, not 0, and the total's row the
    # elements it found against those it books
    folded = [r for r in report["table"] if r["in_total"]]
    totals = [r for r in report["table"] if r["scope"] == ANY_SCOPE]
    assert folded and totals and all(r["budget"]["gspmd"] == 0 for r in folded)
    for r in report["table"]:
        for impl in report["impls"]:
            assert row_cells(r, impl)[2], (impl, r)
    assert all(row_cells(r, "gspmd")[1] == "(any)" for r in folded)
    found, booked = totals[0]["total"]["gspmd"]
    assert found == booked > 0 and f"{booked} el  " in printed


@pytest.mark.slow
def test_run_json_records_the_experiment(tmp_path):
    out = tmp_path / "run"
    assert train.main(["--tp", "4", "--impl", "shard_map", "--steps", "2", "--check",
                       "--out", str(out), "model.style=llama", "model.n_kv_heads=2",
                       "model.tie_embeddings=false", "model.use_bias=false",
                       "model.n_layers=2", "model.seq_len=32", "train.batch_size=4",
                       "train.eval_batches=1"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["tp"], run["impl"], run["mesh_device_ids"]) == (4, "shard_map", [[0, 1, 2, 3]])
    assert run["microbatch"] == {"b": 4, "s": 32, "tokens": 128, "microbatches": 1}
    # dp=1: every collective of the step spans tp, each counted per step
    assert set(run["collectives_by_axis"]) == {"tp"}
    assert run["collectives_by_axis"]["tp"]["collectives"] == sum(
        r["count"] for r in run["collectives_per_layer"] + run["collectives_outside_blocks"])
    assert (run["model"]["n_heads"], run["model"]["n_kv_heads"]) == (8, 2)
    assert run["model"]["attention"] == "xla"  # auto, resolved for CPU at 32 positions
    assert run["host_ms_per_step"] is None  # 2 steps: both log (no step to measure)
    # the run's config keeps the kernel as asked: a requeue on a GPU picks its own
    assert json.loads((out / "config.json").read_text())["model"]["attention"] == "auto"
    assert run["linear_layouts"] == {
        **{f"blocks.{i}.{name}": kind for i in range(2) for name, kind in (
            ("attn.q", "column"), ("attn.kv", "replicated"), ("attn.out", "row"),
            ("mlp.up", "column"), ("mlp.down", "row"))},
        "wte": "vocab-parallel", "lm_head": "vocab-parallel"}
    act = 4 * 32 * 128 * 4
    per_layer = [r for r in run["collectives_per_layer"] if r["payload_bytes"] == act]
    assert sorted((r["pass"], r["scope"], r["count_per_layer"]) for r in per_layer) == [
        ("backward", "attention", 1), ("backward", "mlp", 1),
        ("forward", "attention", 1), ("forward", "mlp", 1)]
    kv = [r for r in run["collectives_per_layer"] if r["payload_bytes"] != act]
    assert [(r["pass"], r["payload_bytes"]) for r in kv] == [("backward", 4 * 32 * 2 * 2 * 16 * 4)]
    chk = run["check"]
    assert chk["after_step"] == 2  # step 1 runs at lr 0 (warmup from 0)
    assert chk["loss_diff"] < 1e-5 and chk["grad_norm_diff"] < 1e-5
    assert 0 < chk["param_rel_error"] < 1e-5
    # Relative to the update itself (~1e-5 measured): Adam's early updates are
    # nearly lr * sign(g), so gradients near round-off size move it most.
    assert 0 < chk["param_update_rel_error"] < 1e-4


@pytest.mark.slow
def test_compare_hlo_on_the_llama_preset(tmp_path):
    """GQA with kv heads replicated at tp=8, vocab-parallel loss: the three
    impls hold the extended budget (one of the preset's blocks: the budget is
    per block, the 2-layer tests above count it per layer)."""
    assert train.main(["--tp", "8", "--config", "llama-tiny", "--compare-hlo",
                       "--out", str(tmp_path), "model.n_layers=1"]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert len(report["impls"]) == 3
    assert all(r["matches_budget"] for r in report["impls"].values())
    names = {e["name"] for e in report["impls"]["gspmd"]["expected"]}
    assert "kv gradient: gathered across the K groups" in names


@pytest.mark.slow
def test_gspmd_sequence_parallel_on_the_cpu_pipeline(tmp_path):
    """XLA's CPU pipeline forms no reduce-scatter: GSPMD's SP exits are an
    all-reduce of the full buffer and a slice (the same ring bytes as
    reduce-scatter + all-gather). The budget for the CPU says so, and each of the three
    impls holds it, as does a chunked loss with remat (the region input
    gathered again for the weight gradient)."""
    assert train.main(["--tp", "8", "--sp", "--compare-hlo", "--out", str(tmp_path),
                       "model.n_layers=2", "model.remat=minimal", "model.loss_chunk=600"]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    rows = report["impls"]["gspmd"]["expected"]
    exits = [e for e in rows if e["name"].startswith("SP exit: reduce-scatter")]
    assert exits and all(e["kind"] == "all-reduce" and e["name"].endswith("+ slice]")
                         for e in exits)
    regather = [e for e in rows if e["name"].startswith("SP remat")]
    assert [e["count"] for e in regather] == [2, 2]  # attention and MLP, 2 layers
    assert all(r["matches_budget"] for r in report["impls"].values())


TARGETS = {"h100": "jax_cuda12_plugin", "tpu-v5p": "libtpu"}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("config, extra", [
    ("tiny", ["--sp"]), ("llama-tiny", ["--sp"]), ("llama-tiny", ["--bf16"]),
    ("tiny", ["--sp", "--overlap", "collective_matmul"])],
    ids=["gpt2-sp", "llama-gqa-sp", "llama-gqa-bf16", "gpt2-sp-overlap"])
def test_budgets_hold_compiled_for_an_accelerator(target, config, extra, tmp_path):
    """--compare-hlo --hardware: the step compiled for 8 H100s or a v5p 2x2x2
    without having them; each impl holds the budget as that compiler carries
    it out (jaxtp.analysis.backends.on_backend)."""
    import importlib.util

    if importlib.util.find_spec(TARGETS[target]) is None:
        pytest.skip(f"{TARGETS[target]} is not installed: cannot compile for {target} here")
    assert train.main(["--tp", "8", "--config", config, *extra, "--compare-hlo",
                       "--hardware", target, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["platform"] == ("gpu" if target == "h100" else "tpu")




@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--sp"], ["--microbatches", "2"], ["--bf16"],
                                   ["--bf16", "--sp"], ["model.loss_chunk=64"]],
                         ids=["plain", "sp", "mb2", "bf16", "bf16-sp", "8-loss-chunks"])
def test_dp_budgets_hold_compiled_for_an_h100(extra, tmp_path):
    """dp=2 x tp=4 compiled for 8 H100s: XLA's GPU pipeline sums the tied
    table's two parts before one dp reduction (shard_map, explicit) and the
    replicated weights on sequence shards over dp and tp at once
    (jaxtp.analysis.backends); the LM head's gradient once after the loss's
    chunks (XLA:CPU sums it per chunk); in slices over dp each gradient once; in bf16
    each gradient summed in the dtype its weight is used in (the kernels' in
    bf16, the norms' in fp32: jaxtp.analysis.grads.part_dtypes). (SP in
    slices and FSDP are not yet budgeted for the GPU: docs/scale.md.)"""
    import importlib.util

    if importlib.util.find_spec(TARGETS["h100"]) is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    assert train.main(["--dp", "2", "--tp", "4", *extra, "--compare-hlo", "--hardware", "h100",
                       "--out", str(tmp_path)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("config, extra", [
    ("tiny", []), ("tiny", ["--bf16"]), ("llama-tiny", ["--bf16"]),
    ("tiny", ["--pp", "2", "--microbatches", "2", "--pp-schedule", "1f1b", "--bf16"])],
    ids=["gpt2", "gpt2-bf16", "llama-bf16", "pp-1f1b-bf16"])
def test_dp_budgets_hold_compiled_for_a_v5p(config, extra, tmp_path):
    """dp > 1 compiled for a v5p 2x2x2: libtpu sums a 16-bit model's LM-head
    table gradient over dp in bf16 under GSPMD and explicit, and adds a tied
    table's two parts before one dp sum under explicit (and under shard_map
    where both are fp32): jaxtp.analysis.backends._tpu_dp."""
    import importlib.util

    if importlib.util.find_spec(TARGETS["tpu-v5p"]) is None:
        pytest.skip("libtpu is not installed: cannot compile for tpu-v5p here")
    dp = ["--dp", "2"] if "--pp" in extra else ["--dp", "4"]
    assert train.main([*dp, "--tp", "2", "--config", config, *extra, "--compare-hlo",
                       "--hardware", "tpu-v5p", "--out", str(tmp_path)]) == 0


def test_slices_over_dp_are_kept_off_cudnn_under_gspmd_and_explicit():
    """cuDNN attention's custom partitioning fails (jax 0.10.2) inside a
    shard_map that leaves tp to GSPMD: there the slices reduce one by one."""
    from jaxtp.parallel import Layout
    from jaxtp.parallel.schedule import _mode

    def over_dp(dp, fsdp, M, impl, attention, cp=1):
        return _mode(Layout.make(dp=dp, cp=cp, impl=impl, fsdp=fsdp), M, attention) == "over_dp"

    assert over_dp(2, False, 2, "gspmd", "xla")
    assert not over_dp(2, False, 2, "gspmd", "cudnn")
    assert not over_dp(2, False, 2, "explicit", "cudnn")
    assert over_dp(2, False, 2, "shard_map", "cudnn")
    assert not over_dp(2, True, 2, "gspmd", "xla")  # FSDP: per slice
    assert not over_dp(1, False, 2, "gspmd", "xla")
    assert not over_dp(2, False, 1, "gspmd", "xla")
    assert not over_dp(2, False, 2, "gspmd", "xla", cp=2)  # cp: per slice


@pytest.mark.slow
def test_cudnn_attention_in_slices_over_dp_compiles_for_an_h100():
    """bf16 Llama at dp=2 x tp=4 in 2 slices picks cuDNN attention on an H100;
    under gspmd and explicit its step compiles (the slices keep their
    per-slice reduction) and so does shard_map's (slices over dp)."""
    import importlib.util

    if importlib.util.find_spec(TARGETS["h100"]) is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    from jaxtp.parallel.targets import target_mesh
    from jaxtp.config import apply_overrides, load_config
    from jaxtp.parallel import mesh_for
    from jaxtp.model.build import resolve_attention

    base = apply_overrides(load_config("llama-tiny"), [
        "parallel.dp=2", "parallel.tp=4", "model.dtype=bfloat16", "train.microbatches=2"])
    mesh = target_mesh("h100", 2, 4)
    for impl in ("gspmd", "explicit", "shard_map"):
        cfg = apply_overrides(base, [f"parallel.impl={impl}"])
        assert resolve_attention(cfg, mesh.devices.flat[0]).model.attention == "cudnn"
        m = mesh_for(mesh, impl)
        text = compile_train_step(abstract_train_state(cfg, m), cfg.train.batch_size,
                                  cfg.model.seq_len).as_text()
        assert "custom-call" in text


def test_a_budget_row_without_a_collective_shows_its_element_count():
    from jaxtp.analysis.rows import Expected
    from jaxtp.analysis.picture import format_table

    row = Expected("SP embedding: its rows", "reduce-scatter", "forward", "embed", 32768,
                   "f32", 8, 1)
    table = format_table({"gspmd": []}, {"gspmd": [row]})
    assert table[0].split()[-3:] == ["gspmd", "budget", "role"]
    # found 0, budgeted 1, and the role: the row's name up to its colon
    assert "f32[32768 elements]" in table[2] and table[2].split()[-4:] == ["0", "1", "SP",
                                                                           "embedding"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2", "--cp", "2", "--tp", "2"],
                                    ["--cp", "2", "--tp", "4"]], ids=["dp2-cp2-tp2", "cp2-tp4"])
def test_compare_hlo_writes_the_report_of_cp_with_fsdp(layout, tmp_path, capsys):
    """cp with FSDP: at dp 2 a gradient sum over dp x cp at once and GSPMD's
    over cp outside the regions; at dp 1 FSDP splits nothing. Every impl
    matches, the roofline agrees on each axis and comm_report.json is
    written (its values plain JSON)."""
    assert train.main([*layout, "--fsdp", "--compare-hlo", "--out", str(tmp_path),
                       "model.n_layers=1", "model.d_model=32", "model.d_ff=64",
                       "model.n_heads=4", "model.seq_len=16", "train.batch_size=4"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["ok"] and report["roofline"]["agree"] is True
    assert {"cp", "tp"} <= set(report["roofline"]["axes"])
    assert "DIFFER" not in printed and printed.count(": matches budget") == 3


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [
    ["gpipe"], ["circular", "--pp-repeats", "2"], ["1f1b"],
    ["1f1b", "--cp", "2", "--cp-attention", "ring"], ["gpipe", "--cp", "2", "--cp-attention",
                                                      "ring"], ["zb", "--pp-repeats", "2"]],
    ids=["gpipe", "circular", "1f1b", "1f1b-cp2", "gpipe-cp2", "zb-v2"])
def test_pp_budgets_hold_compiled_for_an_h100(schedule, tmp_path):
    """pp=2 x tp=4 (with cp: pp2 x cp2 x tp2) compiled for 8 H100s under each
    schedule: gspmd and shard_map hold the ledger as XLA's GPU pipeline
    carries it out (it adds the tied table's two gradients before their one
    sum over pp under shard_map; at cp it sums the weights outside the
    stages over pp and cp at once, the learned positions apart), and each
    program's loop runs the schedule's ticks."""
    import importlib.util

    if importlib.util.find_spec(TARGETS["h100"]) is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    tp = "2" if "--cp" in schedule else "4"
    assert train.main(["--pp", "2", "--tp", tp, "--pp-schedule", *schedule, "--compare-hlo",
                       "--hardware", "h100", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["platform"] == "gpu" and report["pipeline"]["agree"]
    assert {i for i, r in report["impls"].items() if r.get("matches_budget")} == {
        "gspmd", "shard_map"}


@pytest.mark.slow
def test_the_loss_means_around_a_pipeline_at_cp_join_compiled_for_an_h100(tmp_path):
    """GPipe at pp 2 x dp 2 x cp 2 x tp 2 compiled for 16 H100s: XLA's GPU
    pipeline folds the loss's mean over cp and its mean over pp x dp into
    one all-reduce over all three (XLA:CPU keeps the two), under gspmd and
    shard_map; and the whole step holds its ledger."""
    import importlib.util

    if importlib.util.find_spec(TARGETS["h100"]) is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    assert train.main(["--config", "llama-tiny", "--pp", "2", "--dp", "2", "--cp", "2", "--tp",
                       "2", "--cp-attention", "ring", "--compare-hlo", "--hardware", "h100",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    for impl in ("gspmd", "shard_map"):
        r = report["impls"][impl]
        assert r["matches_budget"], impl
        means = [(tuple(c["axes"]), c["count"]) for c in r["collectives"]
                 if c["kind"] == "all-reduce" and c["pass"] == "forward" and not c["shape"]
                 and c["scope"] == ""]
        booked = [(tuple(e["axes"]), e["count"]) for e in r["expected"]
                  if e["role"] == "loss_mean"]
        assert means == booked == [(("pp", "dp", "cp"), 1)], impl


@pytest.mark.slow
def test_five_axes_hold_their_ledger_compiled_for_32_h100s(tmp_path):
    """moe-tiny (dropless) at dp 2 x pp 2 x ep 2 x cp 2 x tp 2 compiled for
    32 H100s without having them: under gspmd and shard_map every collective
    of the step is on the ledger as XLA's GPU pipeline carries it out, with
    rows on each of the five axes."""
    import importlib.util

    if importlib.util.find_spec(TARGETS["h100"]) is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    assert train.main(["--config", "moe-tiny", "model.capacity_factor=0", "--dp", "2", "--pp",
                       "2", "--ep", "2", "--cp", "2", "--tp", "2", "--cp-attention", "ring",
                       "--compare-hlo", "--hardware", "h100", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["platform"] == "gpu" and report["pipeline"]["agree"]
    for impl in ("gspmd", "shard_map"):
        r = report["impls"][impl]
        assert r["matches_budget"], impl
        axes = {a for c in r["collectives"] for a in c["axes"] or ()}
        assert axes == {"pp", "dp", "ep", "cp", "tp"}, (impl, axes)
