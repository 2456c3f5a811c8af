"""The attention kernel choice (jaxtp.model.kernels): `auto` picks per
device, dtype and shape; cuDNN refuses CPU and lowers for an H100. (The
blockwise kernel's own tests: test_blockwise.py.)"""

import collections
import importlib.util

import pytest

from jaxtp.model import kernels

Device = collections.namedtuple("Device", "platform device_kind")


@pytest.mark.parametrize("kernel, dtype, H, T, device, want", [
    ("auto", "float32", 16, 64, Device("cpu", "cpu"), "xla"),
    ("auto", "float32", 16, 128, Device("cpu", "cpu"), "blockwise"),
    ("auto", "bfloat16", 128, 8192, Device("cpu", "cpu"), "blockwise"),
    ("auto", "bfloat16", 128, kernels.BLOCKWISE_FROM_SEQ, Device("tpu", "TPU v5p"), "blockwise"),
    ("auto", "bfloat16", 128, 2048, Device("gpu", "NVIDIA H100 80GB HBM3"), "cudnn"),
    ("auto", "float16", 64, 128, Device("cuda", "NVIDIA H200"), "cudnn"),
    # cuDNN needs 16-bit inputs, a head dim that is a multiple of 8 and <= 256, NVIDIA
    ("auto", "float32", 128, 8192, Device("gpu", "NVIDIA H100 80GB HBM3"), "blockwise"),
    ("auto", "bfloat16", 12, 128, Device("gpu", "NVIDIA H100 80GB HBM3"), "xla"),
    ("auto", "bfloat16", 512, 4096, Device("gpu", "NVIDIA H100 80GB HBM3"), "blockwise"),
    ("auto", "bfloat16", 128, 4096, Device("gpu", "AMD Instinct MI300X"), "blockwise"),
    ("xla", "bfloat16", 128, 8192, Device("gpu", "NVIDIA H100 80GB HBM3"), "xla"),
    ("blockwise", "float32", 16, 16, Device("cpu", "cpu"), "blockwise"),
])
def test_auto_picks_per_platform_dtype_and_shape(kernel, dtype, H, T, device, want):
    assert kernels.choose(kernel, dtype, H, T, device) == want


@pytest.mark.parametrize("dtype, H, device, match", [
    ("bfloat16", 128, Device("cpu", "cpu"), "needs an NVIDIA GPU"),
    ("float32", 128, Device("gpu", "NVIDIA H100 80GB HBM3"), "bfloat16 or float16"),
    ("bfloat16", 100, Device("gpu", "NVIDIA H100 80GB HBM3"), "multiple of 8"),
])
def test_cudnn_where_it_cannot_run_is_a_clear_error(dtype, H, device, match):
    with pytest.raises(kernels.KernelError, match=match):
        kernels.choose("cudnn", dtype, H, 1024, device)


def test_cudnn_on_a_cpu_machine_fails_before_compiling(capsys):
    import train

    assert train.main(["--attention", "cudnn", "--bf16", "--steps", "1", "--out", "/dev/null/x",
                       "model.n_layers=1"]) == 2
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU" in err and "compiled" not in err


CUDA = importlib.util.find_spec("jax_cuda12_plugin") is not None


@pytest.mark.skipif(not CUDA, reason="the CUDA plugin (pip install 'jax[cuda12]') is not "
                    "installed: cannot compile for an H100 here")
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
def test_cudnn_lowers_for_an_h100_inside_each_impl(impl):
    """The train step compiled for 8 H100s without one: cuDNN's fused attention
    forward and backward per rank's heads, and no gather of q, k or v (the
    collectives are exactly the budget)."""
    from jaxtp import hlo
    from jaxtp.analysis.budget import expected_collectives
    from jaxtp.analysis.rows import check
    from jaxtp.config import apply_overrides, load_config, validate
    from jaxtp.parallel.targets import target_mesh
    from jaxtp.model.build import resolve_attention
    from jaxtp.train.state import abstract_train_state
    from jaxtp.train.step import compile_train_step

    cfg = validate(apply_overrides(load_config("llama-tiny"), [
        "parallel.tp=8", f"parallel.impl={impl}", "model.dtype=bfloat16",
        "model.attention=cudnn", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=8"]))
    mesh = target_mesh("h100", 1, 8)
    cfg = resolve_attention(cfg, mesh.devices.flat[0])
    from jaxtp.analysis.compare import GPU_UNCOMBINED  # one collective per tensor, as budgeted

    text = compile_train_step(abstract_train_state(cfg, mesh), cfg.train.batch_size,
                              cfg.model.seq_len, compiler_options=GPU_UNCOMBINED).as_text()
    assert "__cudnn$fmhaSoftmax\"" in text and "__cudnn$fmhaSoftmaxBackward" in text
    assert check(hlo.collectives(text), expected_collectives(cfg, impl, "gpu")) is None


def test_auto_on_cpu_runs_blockwise_in_blocks_of_at_most_64():
    cpu, gpu = Device("cpu", "cpu"), Device("gpu", "NVIDIA H100 80GB HBM3")
    assert kernels.choose_block("auto", 512, cpu) == kernels.CPU_BLOCK == 64
    assert kernels.choose_block("auto", 32, cpu) == 32
    assert kernels.choose_block("blockwise", 512, cpu) == 512  # a block asked for is kept
    assert kernels.choose_block("auto", 512, gpu) == 512
    # the planner's CPU compile stands in for an accelerator: its choice, not the CPU's
    assert kernels.choose("auto", "float32", 16, 128, cpu, cpu_tuned=False) == "xla"
    assert kernels.choose_block("auto", 512, cpu, cpu_tuned=False) == 512
