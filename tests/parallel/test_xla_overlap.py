"""GSPMD's overlap: the compiler options asked for, which of XLA's windowed
loops each backend forms (its rules, against numbers worked by hand), and
the known jaxlib bug it meets, with its workaround applied."""

import dataclasses

import pytest

from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.parallel import xla_overlap
from jaxtp.parallel.xla_overlap import compiler_options, forms, known_bugs, xla_options

MiB = 2**20


def cfg_of(b=8, s=2**20, d=8192, dtype="bfloat16", dp=1, tp=8, impl="gspmd", overlap=True,
           d_ff=32768, microbatches=1):
    return Config(ModelConfig(d_model=d, n_heads=64, d_ff=d_ff, seq_len=s, dtype=dtype),
                  TrainConfig(batch_size=b * dp, microbatches=microbatches),
                  ParallelConfig(dp=dp, tp=tp, impl=impl, sp=True,
                                 overlap="collective_matmul" if overlap else "none"))


def test_xla_is_asked_for_windowed_einsum_on_gpu_and_tpu_only():
    assert xla_options("cpu") == {}
    gpu = xla_options("cuda")
    assert gpu == xla_options("gpu") and gpu["xla_gpu_threshold_for_windowed_einsum_mib"] == 0
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert xla_options("tpu")["xla_tpu_enable_windowed_einsum_for_all_gather"] is True
    assert compiler_options(cfg_of(impl="shard_map"), "gpu") is None  # its rings are its own
    assert compiler_options(cfg_of(overlap=False), "gpu") is None
    assert compiler_options(cfg_of(), "cpu") is None


def test_the_cpu_threshold_is_one_dp_groups_activation_in_the_compute_dtype():
    # bf16 [8, 2^20, 8192] = 2^37 B = 131072 MiB: past 100000; [6, ...] = 98304 MiB: short
    # (both measured: the loops form at 7 rows, not at 6)
    assert xla_overlap.activation_bytes(cfg_of()) == 131072 * MiB
    past, short = forms(cfg_of(), "cpu"), forms(cfg_of(b=6), "cpu")
    assert past.all_gather and past.reduce_scatter and "131,072 MiB >= 100,000 MiB" in past.why
    assert not short.all_gather and not short.reduce_scatter
    assert "98,304.000 MiB" in short.why and "--only windowed" in short.why
    # fp32 doubles the bytes: 6 rows are past it then
    assert forms(cfg_of(b=6, dtype="float32"), "cpu").reduce_scatter
    # per dp group and microbatch: 16 rows over dp=2 are 8 a group; in 2 microbatches, 4
    assert forms(cfg_of(dp=2, tp=4), "cpu").reduce_scatter
    assert not forms(cfg_of(microbatches=2), "cpu").reduce_scatter


def test_at_dp_2_only_the_reduce_scatter_loops_form_on_cpu():
    f = forms(cfg_of(dp=2, tp=4), "cpu")
    assert (f.all_gather, f.reduce_scatter) == (False, True) and "dp > 1" in f.why


def test_the_cap_bounds_tp():
    f = forms(cfg_of(tp=8), "cpu", cap=4)
    assert not f.reduce_scatter and "tp=8 is past XLA's CPU iteration cap of 4" in f.why


def test_a_deviceless_gpu_compile_forms_no_loop_and_says_where_they_form():
    f = forms(cfg_of(), "gpu", deviceless=True, cap=0)
    assert not f.all_gather and not f.reduce_scatter
    assert "cap to 0 (logged by a compile for this target)" in f.why and "at run time on a GPU client" in f.why
    assert xla_overlap.GPU_COMMAND in f.why
    assert not forms(cfg_of(), "cuda", cap=0).all_gather  # a cap of 0 anywhere: no loop
    live = forms(cfg_of(), "gpu", cap=8)
    assert live.all_gather and live.reduce_scatter
    assert forms(cfg_of(), "").all_gather  # the analytic form: every loop
    assert not forms(cfg_of(overlap=False), "cpu").reduce_scatter


def test_jax_39200_is_met_on_gpu_with_jaxlib_0_10_2_past_1024_per_device():
    cfg = cfg_of()  # per device: 8 x 2^20 / 8 tokens, F/tp = 4096
    (bug,) = known_bugs(cfg, "gpu", jaxlib="0.10.2")
    assert bug.issue == "jax-ml/jax#39200" and bug.options == {
        "xla_gpu_multi_streamed_windowed_einsum": False}
    assert bug.line().startswith("known bug jax-ml/jax#39200: ") and "workaround: " in bug.line()
    assert known_bugs(cfg, "gpu", jaxlib="0.10.1") == []
    assert known_bugs(cfg, "cpu", jaxlib="0.10.2") == []
    assert known_bugs(dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, impl="shard_map")), "gpu", jaxlib="0.10.2") == []
    # per device 2 x 512 / 8 = 128 tokens, F/tp = 128, N*H/tp = 1024: not past it
    small = cfg_of(b=2, s=512, d=8192, d_ff=1024)
    assert xla_overlap.per_device_matmul_dim(small) == 1024
    assert known_bugs(small, "gpu", "0.10.2") == []


@pytest.mark.skipif(xla_overlap.metadata.version("jaxlib") != "0.10.2",
                    reason="the workaround applies to jaxlib 0.10.2")
def test_the_workaround_is_in_the_compiler_options():
    options = compiler_options(cfg_of(), "gpu")
    assert options["xla_gpu_multi_streamed_windowed_einsum"] is False
    assert options["xla_gpu_threshold_for_windowed_einsum_mib"] == 0


def test_a_run_meeting_the_bug_says_so_at_start_up(monkeypatch):
    """The start-up lines of a GPU run with GSPMD's overlap at jaxlib 0.10.2:
    the overlap asked for, and one line naming jax#39200 and its workaround
    (the run records the same in run.json: `jaxtp.train.record`)."""
    from jaxtp.train import start

    monkeypatch.setattr(start.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(xla_overlap.metadata, "version", lambda pkg: "0.10.2")
    lines = start.config_warnings(cfg_of())
    assert lines == [known_bugs(cfg_of(), "gpu", "0.10.2")[0].line()]
    assert start._overlap(cfg_of()).startswith(
        ", overlap: XLA's windowed einsum, loops: asked for on a GPU client")
    monkeypatch.setattr(start.jax, "default_backend", lambda: "cpu")
    assert start.config_warnings(cfg_of()) == []
    assert "no loop here: XLA's CPU compiler windows a dot only past" in start._overlap(
        cfg_of(b=1, s=16))
