"""GPU-only tests: cuDNN flash attention and a train step that uses it, on a
real NVIDIA GPU. Run them there with

    JAXTP_GPU_TESTS=1 python -m pytest -q -n 0 tests/test_gpu.py

(bench/gpu.sh does). Everywhere else they skip with the reason; what can be
checked without a GPU (the cuDNN custom calls in a step compiled for an
H100, `auto`'s choice, the CPU refusal) is in tests/test_kernels.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtp.model import kernels

pytestmark = pytest.mark.skipif(
    not os.environ.get("JAXTP_GPU_TESTS") or jax.default_backend() != "gpu"
    or "nvidia" not in jax.devices()[0].device_kind.lower(),
    reason="needs an NVIDIA GPU and JAXTP_GPU_TESTS=1 (the suite otherwise runs on 8 CPU "
           "devices)")


def _inputs(dtype, B=2, T=512, K=2, G=4, H=64):
    rng = np.random.default_rng(0)
    q, c = (jnp.asarray(rng.normal(size=(B, T, K, G, H)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), dtype) for _ in range(2))
    return q, k, v, c


@pytest.mark.parametrize("kernel", ["cudnn", "blockwise"])
def test_bf16_kernels_match_fp32_xla_on_the_gpu(kernel):
    """Forward and every gradient within bf16 accuracy of the fp32 reference
    computed from the same (bf16-rounded) inputs."""
    q, k, v, c = _inputs(jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, c)]
    fn = lambda q, k, v: kernels.attend(q, k, v, kernel, 128)
    ref = lambda q, k, v: kernels.xla_attention(q, k, v)
    grads = lambda f, q, k, v, c: jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * c), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v), np.float32),
                               ref(*f32[:3]), rtol=2e-2, atol=2e-2)
    for got, want in zip(grads(fn, q, k, v, c), grads(ref, *f32)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=5e-2, atol=5e-2)


def test_train_steps_with_cudnn_follow_xla_on_the_gpu():
    """Three bf16 train steps of a small Llama at tp=1, cuDNN against XLA
    attention: the same losses to bf16 accuracy."""
    from jaxtp.config import apply_overrides, load_config, validate
    from jaxtp.parallel import make_mesh
    from jaxtp.train.state import init_train_state
    from jaxtp.train.step import make_train_step, step_controls

    losses = {}
    tokens = np.random.default_rng(0).integers(0, 256, (4, 257)).astype(np.int32)
    for kernel in ("xla", "cudnn"):
        cfg = validate(apply_overrides(load_config("llama-tiny"), [
            "model.dtype=bfloat16", "model.seq_len=256", "model.n_kv_heads=8",
            f"model.attention={kernel}", "train.batch_size=4", "train.warmup_steps=0"]))
        mesh = make_mesh(1, 1, devices=jax.devices()[:1])
        state = init_train_state(cfg, mesh)
        step = make_train_step(state, use_dropout=False)
        p, o, out = state.params, state.opt_state, []
        with jax.set_mesh(mesh):
            for i in range(3):
                p, o, m = step(p, o, tokens, jax.random.key(i), step_controls())
                out.append(float(m["loss"]))
        losses[kernel] = out
    np.testing.assert_allclose(losses["cudnn"], losses["xla"], rtol=2e-2)
