"""jaxtp.bench: the quick suite end to end, the bandwidth arithmetic, the GPU mode's code path.

No test asserts a wall-clock time: only that every number is there, finite
and positive, and that the arithmetic is nccl-tests'.
"""

import json
import math

import jax
import pytest

from jaxtp.bench import collectives as bc, suite as bench
from jaxtp.bench.__main__ import main as bench_main
from jaxtp.bench.gpu import GPU_PRESET_OVERRIDES, gpu_bench, gpu_config
from jaxtp.bench.report import write_report
from jaxtp.bench.timing import paired_ratio


def _within_rounds(row: dict, ratio: float) -> None:
    """`ratio` (of two medians timed apart) within the row's paired rounds:
    every round's time(run) >= ratio_min * time(base), so the medians obey the
    same bounds; a ratio computed from mismatched or swapped timings does not."""
    assert row["ratio_min"] <= row["ratio_max"], row
    assert row["ratio_min"] * (1 - 1e-9) <= ratio <= row["ratio_max"] * (1 + 1e-9), (row, ratio)


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_sections(report, ids):
    assert [s["id"] for s in report["sections"]] == list(ids)
    for s in report["sections"]:
        assert s["rows"] and s["title"] and s["notes"] and s["wall_s"] >= 0
        keys = [k for k, _ in s["columns"]]
        for row in s["rows"]:
            assert set(keys) <= set(row), (s["id"], set(keys) - set(row))


@pytest.mark.slow
def test_quick_suite_end_to_end(tmp_path):
    report = bench.run_suite(quick=True, log=lambda _: None)
    _check_sections(report, bench.SECTIONS)
    meta = report["meta"]
    for k in ("mode", "machine", "platform", "device_kind", "device_count", "fake_devices",
              "date", "python", "versions", "wall_s"):
        assert meta[k] is not None, k
    assert meta["mode"] == "quick" and meta["device_count"] == 8
    assert set(meta["versions"]) >= {"jax", "jaxlib", "flax", "optax"}
    by_id = {s["id"]: s for s in report["sections"]}

    impl_rows = by_id["impl"]["rows"]  # quick: tiny at tp=8, each impl against gspmd
    assert [r["impl"] for r in impl_rows] == ["shard_map", "explicit"]
    for impl in impl_rows:
        assert impl["unit"] == "ratio" and _positive(impl["value"])
        assert _positive(impl["gspmd_ms"]) and _positive(impl["impl_ms"])
        # the ratio of the two step times, each timed on its own, lies within the
        # paired rounds' ratios: ties the ratio to the times it was paired from
        _within_rounds(impl, impl["impl_ms"] / impl["gspmd_ms"])
        assert impl["measured"] == f"train step time, {impl['impl']} / gspmd"

    tp_rows = by_id["scaling"]["rows"]
    assert {(r["tp"], r["sp"]) for r in tp_rows} == {(1, False), (8, False), (8, True)}
    base_ms = next(r for r in tp_rows if r["tp"] == 1)["step_ms"]
    for r in tp_rows:
        assert _positive(r["step_ms"]) and _positive(r["value"])
        _within_rounds(r, r["step_ms"] / base_ms)

    (ring,) = by_id["overlap"]["rows"]  # quick: shard_map at tp=8
    assert (ring["impl"], ring["tp"]) == ("shard_map", 8)
    assert _positive(ring["none_ms"]) and _positive(ring["ring_ms"])
    _within_rounds(ring, ring["ring_ms"] / ring["none_ms"])

    cpu = by_id["predict_cpu"]["rows"]  # quick: tiny at tp 1 and 8, one round
    assert [r["layout"] for r in cpu] == ["tiny tp=1", "tiny tp=8"]
    assert all(_positive(r["predicted_ms"]) and _positive(r["measured_ms"]) for r in cpu)
    assert all(r["priced"].startswith(("ledger", "decode")) for r in by_id["predict"]["rows"])

    compile_rows = by_id["compile"]["rows"]
    assert [r["case"].split()[2:] for r in compile_rows] == [
        ["L=2", "scanned"], ["L=8", "scanned"]]
    assert all(_positive(r["compile_s"]) for r in compile_rows)

    coll = by_id["collectives"]["rows"]
    assert {(r["op"], r["dtype"]) for r in coll} == {
        (op, d) for op in bc.OPS for d in ("float32", "bfloat16")}
    for r in coll:
        for k in ("mean_us", "median_us", "p95_us", "algbw_GBps", "busbw_GBps"):
            assert _positive(r[k]), (r["op"], k)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bc.bus_factor(r["op"], 8))
        assert r["bytes"] == 16 * 128 * 128 * (4 if r["dtype"] == "float32" else 2)
        assert r["wire_dtype"]  # read from the compiled HLO

    # each pipeline schedule at pp=2 x tp=4, M = 4: its ticks, and its pp
    # bytes exactly the ledger's
    pp_rows = by_id["pp"]["rows"]
    # forward ticks: M+p-1 (gpipe, 1f1b), vM+p-1 (circular, interleaved, zb v=2)
    assert [r["ticks"] for r in pp_rows] == [5, 9, 5, 9, 9]
    for r in pp_rows:
        assert r["pp_bytes"] == r["ledger_bytes"] > 0 and _positive(r["value"])
        _within_rounds(r, r["pp_ms"] / r["tp8_ms"])

    for r in by_id["profile"]["rows"]:  # the CPU trace records XLA ops per device
        assert r["reason"] is None and 0 < r["value"] <= 100, r

    kinds = {}  # the step's time by kind of work: each case's shares sum to 100%
    for r in by_id["cpu_profile"]["rows"]:
        kinds.setdefault(r["case"], {})[r["measured"]] = r["value"]
    assert sorted(kinds) == ["tiny gspmd tp=1", "tiny gspmd tp=8"]
    for case, shares in kinds.items():
        assert sum(shares.values()) == pytest.approx(100, abs=1e-6), case
        assert shares["matmuls"] > 0 and shares["optimizer update"] > 0, (case, shares)
    assert kinds["tiny gspmd tp=1"]["matmuls"] > 10  # at tp=8 collectives' waits dominate
    assert "collectives" in kinds["tiny gspmd tp=8"] and "collectives" not in kinds[
        "tiny gspmd tp=1"]

    peers = by_id["peer"]["rows"]  # jaxtp / peer, peer_alt / peer, jaxtp / tuned
    assert len(peers) == 3 and all(_positive(r["value"]) for r in peers)
    for r in peers:
        _within_rounds(r, r["ms"] / r["base_ms"])
    # tp=1 on one device, tp=1 among 8, tp=8: measured where torch imports, else why not
    torch_rows = by_id["torch-peer"]["rows"]
    assert [r["case"].split(" (")[0] for r in torch_rows] == [
        "tiny tp=1, one device", "tiny tp=1, 8 fake devices", "tiny tp=8, 8 fake devices"]
    for r in torch_rows:
        assert _positive(r["value"]) and _positive(r["jaxtp_tokens_per_s"]) \
            if r["reason"] is None else "torch" in r["reason"]

    json_path, md_path = write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["sections"][0]["id"] == "impl"
    md = md_path.read_text()
    assert f"jax {meta['versions']['jax']}, jaxlib" in md.splitlines()[0]
    assert md.count("\n| ") >= sum(len(s["rows"]) + 1 for s in report["sections"])

    # the figures of this report: three, each naming the machine and date
    from jaxtp.plot.__main__ import main as plot_main

    assert plot_main(["bench", str(tmp_path)]) == 0
    for sid in ("scaling", "collectives", "compile"):
        for ext in ("png", "svg"):
            assert (tmp_path / f"bench_{sid}.{ext}").stat().st_size > 1000, (sid, ext)
        svg = (tmp_path / f"bench_{sid}.svg").read_text()
        assert meta["date"] in svg and "measured on" in svg, sid


def test_bandwidth_arithmetic_as_nccl_tests():
    # 1 GiB in 10 ms: algbw = 2**30 / 0.01 = 107.374 GB/s
    algbw, busbw = bc.bandwidths("all-reduce", 2**30, 0.010, 8)
    assert algbw / 1e9 == pytest.approx(107.374, abs=1e-3)
    assert busbw == pytest.approx(algbw * 14 / 8)  # 2(n-1)/n
    for op in ("all-gather", "reduce-scatter"):
        algbw, busbw = bc.bandwidths(op, 2**30, 0.010, 8)
        assert busbw == pytest.approx(algbw * 7 / 8)  # (n-1)/n
    assert bc.bus_factor("all-reduce", 2) == 1.0  # a 2-rank ring moves the buffer once
    assert bc.bus_factor("all-gather", 1) == 0.0
    with pytest.raises(ValueError, match="all-to-all"):
        bc.bus_factor("all-to-all", 8)
    s = bc.summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s["mean"], s["median"], s["n"]) == (22.0, 3.0, 5)
    assert s["p95"] == pytest.approx(80.8)  # linear interpolation between 4 and 100


def test_paired_ratio_pairs_the_rounds():
    # the machine slows down in round 2: both runs take 10x. Paired, the ratio is
    # 2 every round; unpaired medians would say 20 / 10 = 2 only by luck of the order
    times = {"run": [2.0, 20.0, 2.2], "base": [1.0, 10.0, 1.0]}
    assert paired_ratio(times, "run", "base") == pytest.approx((2.0, 2.0, 2.2))
    times = {"run": [3.0, 1.0, 10.0], "base": [1.0, 1.0, 10.0]}
    assert paired_ratio(times, "run", "base") == pytest.approx((1.0, 1.0, 3.0))
    # the ratio of medians here would be 3.0 / 1.0 = 3: not what a paired bench reports


def test_collective_names_from_hlo():
    text = """HloModule jit_step, entry_computation_layout={...}
  %psum_invariant.3 = f32[16,128,128]{2,1,0} all-reduce(%fusion.1), channel_id=1
  %all-gather-start.2 = (f32[4]{0}, f32[32]{0}) all-gather-start(%p), dimensions={0}
  ROOT %reduce-scatter.7 = f32[2]{0} reduce-scatter(%x), dimensions={0}
  %fusion.1 = f32[16,128,128]{2,1,0} fusion(%a), kind=kLoop, calls=%all-reduce-like
"""
    assert bc.collective_names(text) == {"psum_invariant.3", "all-gather-start.2",
                                         "reduce-scatter.7"}


def test_gpu_defaults_are_a_valid_llama_1b_config():
    cfg = gpu_config("llama-1b")
    assert (cfg.model.dtype, cfg.model.scan_layers, cfg.parallel.tp) == ("bfloat16", True, 1)
    assert (cfg.train.batch_size, cfg.model.seq_len, cfg.model.n_layers) == (8, 4096, 16)
    assert (cfg.model.remat, cfg.model.attention, cfg.model.loss_chunk) == ("minimal", "auto",
                                                                          4096)


@pytest.mark.slow
def test_gpu_mode_code_path_on_cpu(tmp_path):
    # the GPU defaults (bf16, scanned, remat) on a tiny Llama, one CPU device
    overrides = [*GPU_PRESET_OVERRIDES["llama-1b"], "model.seq_len=64", "train.batch_size=2",
                 "model.n_layers=2"]
    report = gpu_bench(gpu_config("llama-tiny", overrides), steps=2, warmup=1, peak_tflops=1.0,
                       name="llama-tiny", log=lambda _: None)
    train, ab, attn = report["sections"]
    rows = {r["measured"].split(" (")[0]: r for r in train["rows"]}
    for k in ("throughput", "step time", "model TFLOP/s", "MFU", "compile", "loss, last step"):
        assert _positive(rows[k]["value"]), k
    assert rows["MFU"]["value"] == pytest.approx(100 * rows["model TFLOP/s"]["value"] / 1.0)
    config = report["meta"]["config"]["model"]
    assert config["remat"] == "minimal" and config["attention"] == "xla"  # auto, resolved
    assert [r["case"].split("attention=")[1] for r in ab["rows"]] == ["xla"] * 2 + ["xla"] * 2
    assert all(_positive(r["value"]) for r in ab["rows"])
    xla, blockwise, cudnn, b_ratio, c_ratio = attn["rows"]
    assert _positive(xla["value"]) and _positive(blockwise["value"]) and _positive(b_ratio["value"])
    if jax.default_backend() == "cpu":
        assert cudnn["value"] is None and "unavailable" in cudnn["detail"]
        assert c_ratio["value"] is None
    json_path, _ = write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["meta"]["mode"] == "gpu"


def test_cli_rejects_bad_arguments_before_compiling(capsys, tmp_path):
    out = tmp_path / "never"
    assert bench_main(["--only", "impl,nope", "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err
    assert bench_main(["--gpu", "--gpu-config", "tiny", "model.n_heads=7", "--out", str(out)]) == 2
    assert "model.d_model=128 is not divisible by model.n_heads=7" in capsys.readouterr().err
    assert bench_main(["--quick", "model.n_layers=2", "--out", str(out)]) == 2
    assert "--gpu and --gpu-overlap only" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("only", ["", "impl,", ",", "impl,,loop"])
def test_an_empty_only_is_refused_not_read_as_all(only, capsys, tmp_path):
    """--only '' once ran the whole suite (an empty string read as no --only)."""
    assert bench_main(["--only", only, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --only {only!r}: an empty section name; "
                                               "give sections separated by commas, from impl,")
    assert bench.check_only(None) == list(bench.SECTIONS)
    assert bench.check_only(["loop", "impl"]) == ["loop", "impl"]


class _Device:
    def __init__(self, platform, device_kind):
        self.platform, self.device_kind = platform, device_kind


def test_gpu_mode_is_refused_on_a_cpu_host_before_compiling(monkeypatch, capsys, tmp_path):
    """--gpu where jax.devices()[0] is the CPU: llama-1b's 8 x 4096 once asked
    86 GB of the host and died out of memory after a minute; now one line,
    naming the device and what to run instead. JAXTP_BENCH_ANY_DEVICE=1 (the
    dry run of bench/gpu.sh) and an accelerator pass."""
    from jaxtp.bench import gpu

    monkeypatch.delenv("JAXTP_BENCH_ANY_DEVICE", raising=False)
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device("cpu", "cpu")])
    compiled = []
    monkeypatch.setattr(gpu, "train_timed", lambda *a: compiled.append(a))
    assert bench_main(["--gpu", "--out", str(tmp_path / "never")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("error: --gpu times training on a GPU, and none was found: "
                    "jax.devices()[0] is cpu (cpu); run it where jax has CUDA (pip install "
                    "'jax[cuda12]'); here, python -m jaxtp.bench --quick runs the CPU suite and "
                    "python train.py --plan --config llama-1b --tp 1 plans the preset's memory")
    assert not compiled and not (tmp_path / "never").exists()
    for device, env in ((_Device("gpu", "NVIDIA H100 80GB HBM3"), None),
                        (_Device("tpu", "TPU v5"), None), (_Device("cpu", "cpu"), "1")):
        monkeypatch.setattr(jax, "devices", lambda *a, d=device: [d])
        if env:
            monkeypatch.setenv("JAXTP_BENCH_ANY_DEVICE", env)
        assert gpu.check_accelerator() is None


def test_readme_results_are_spliced_between_the_markers(tmp_path):
    from jaxtp.bench.report import README_BEGIN, README_END, splice_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n\n{README_BEGIN}\nold table\n{README_END}\n\n## More\n")
    splice_readme(readme, "**header**\n\n### Section\n\n| a |\n|---|\n| 1 |\n")
    text = readme.read_text()
    assert "old table" not in text and "#### Section" in text and "| 1 |" in text
    assert text.startswith("# x\n\n## Results\n\n") and text.endswith(f"{README_END}\n\n## More\n")
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="needs one line"):
        splice_readme(readme, "x")


def test_the_overlap_section_takes_the_largest_tp_up_to_8_that_divides_the_heads():
    from jaxtp.bench.gpu_overlap import overlap_tp

    assert [overlap_tp(n, 32) for n in (1, 2, 3, 4, 8, 16)] == [1, 2, 2, 4, 8, 8]
    assert overlap_tp(8, 12) == 4 and overlap_tp(8, 3) == 1


@pytest.mark.slow
def test_the_overlap_section_runs_where_there_are_devices(tmp_path, capsys):
    """--gpu-overlap's code path on the 8 fake CPU devices (its subject is a
    multi-GPU machine: bench/gpu.sh): the cap row, the loops row (none: below
    the CPU threshold) and a paired ratio."""
    assert bench_main(["--gpu-overlap", "--gpu-config", "tiny", "--steps", "2", "--warmup", "1",
                       "--out", str(tmp_path), "model.n_layers=1", "model.seq_len=32",
                       "train.batch_size=8"]) == 0
    (sec,) = json.loads((tmp_path / "bench.json").read_text())["sections"]
    cap, loops, ratio = sec["rows"]
    assert loops["value"] == 0 and _positive(ratio["value"]) and ratio["unit"] == "ratio"
    assert "tiny tp=8 sp gspmd float32 B=8 T=32" in ratio["case"]
