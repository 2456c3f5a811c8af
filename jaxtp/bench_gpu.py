"""Absolute speed on one accelerator: `python -m jaxtp.bench --gpu` (see bench/gpu.sh).

Trains a preset at tp=1 for a fixed number of steps on the first device and
reports tokens/s, step time, model TFLOP/s and MFU: model flops per token
6N + 12*L*h*s (`jaxtp.plan.model_flops_per_token`, recomputation not
counted, as in PaLM's MFU) against the device's dense bf16 peak
(`jaxtp.metrics.PEAK_FLOPS`). jaxtp's attention is plain XLA (einsum, fp32
softmax, einsum); a second section times `jax.nn.dot_product_attention` with
implementation="xla" and "cudnn" (flash attention, where JAX offers it) on the
same shapes, to show what a fused kernel would change.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import bench_collectives as bc
from .bench_report import RATIO_COLUMNS, format_section, machine_info, section
from .config import Config, apply_overrides, load_config, validate
from .data import Dataset, load_tokens, to_mesh
from .plan import model_flops_per_token
from .sharding import make_mesh
from .train_lib import compile_train_step, init_train_state, step_controls

# llama-1b on one 80-141 GB GPU: fp32 master weights + Adam (~20 GB), bf16
# compute; batch 4 x 2048 keeps the fp32 [B, T, V] logits near 4 GB; "dots"
# keeps the weight-matmul outputs and recomputes attention probabilities.
GPU_PRESET_OVERRIDES = {"llama-1b": ("train.batch_size=4", "model.seq_len=2048",
                                     "model.dtype=bfloat16", "model.scan_layers=true",
                                     "model.remat=dots")}
COLUMNS = RATIO_COLUMNS + [("detail", "detail")]


def _row(case, measured, value, unit, detail=""):
    return {"case": case, "measured": measured, "value": value, "unit": unit, "detail": detail}


def gpu_config(preset: str = "llama-1b", overrides=()) -> Config:
    """The preset, its GPU defaults, then `overrides`, at tp=1 and dp=1 (validated)."""
    cut = [*GPU_PRESET_OVERRIDES.get(preset, ()), *overrides, "parallel.tp=1", "parallel.dp=1"]
    return validate(apply_overrides(load_config(preset), cut))


def gpu_bench(cfg: Config, steps: int = 40, warmup: int = 3, peak_tflops: float | None = None,
              name: str = "", log=print) -> dict:
    """Train `cfg` (see `gpu_config`) on jax.devices()[0] and time it."""
    from .metrics import peak_flops

    t_start = time.perf_counter()
    m, t = cfg.model, cfg.train
    device = jax.devices()[0]
    mesh = make_mesh(1, 1, devices=[device])
    state = init_train_state(cfg, mesh)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    t0 = time.perf_counter()
    step = compile_train_step(state, t.batch_size, m.seq_len)
    compile_s = time.perf_counter() - t0
    cost = step.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, (list, tuple)) else cost or {}).get("flops")
    batches = Dataset(load_tokens(None), m.seq_len, m.vocab_size).train_batches(
        t.batch_size, t.seed)
    batches = [to_mesh(next(batches), mesh) for _ in range(warmup + steps)]
    params, opt_state, times, losses = state.params, state.opt_state, [], []
    with jax.set_mesh(mesh):
        for i, tokens in enumerate(batches):
            t0 = time.perf_counter()
            params, opt_state, metrics = step(params, opt_state, tokens,
                                              jax.random.key(i), step_controls())
            jax.block_until_ready((params, opt_state, metrics))
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
    del params, opt_state
    s = bc.summary(times[warmup:])
    tokens_s = t.batch_size * m.seq_len / s["median"]
    flops_token = model_flops_per_token(cfg, n_params)
    tflops = tokens_s * flops_token / 1e12
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(device)
    mem = (device.memory_stats() or {}).get("peak_bytes_in_use")
    case = (f"{name or 'model'} tp=1 {m.dtype} L={m.n_layers} B={t.batch_size} T={m.seq_len}"
            f"{' scan' if m.scan_layers else ''} remat={m.remat}")
    rows = [
        _row(case, "throughput", tokens_s, "tokens/s", f"{t.batch_size * m.seq_len} tokens/step"),
        _row(case, f"step time (median of {steps} after {warmup} warm-up)", s["median"] * 1e3,
             "ms", f"mean {s['mean'] * 1e3:.1f}, p95 {s['p95'] * 1e3:.1f}"),
        _row(case, "model TFLOP/s (6N + 12Lhs per token)", tflops, "TFLOP/s",
             f"N={n_params:,}, {flops_token:.3e} flops/token"),
        _row(case, "MFU", 100 * tflops * 1e12 / peak if peak else None, "%",
             f"vs {peak / 1e12:g} TFLOP/s dense bf16 peak" if peak else
             f"peak of {device.device_kind!r} unknown: pass --peak-tflops"),
        _row(case, "XLA-counted TFLOP/s (cost_analysis, incl. recompute)",
             xla_flops / s["median"] / 1e12 if xla_flops else None, "TFLOP/s",
             f"{xla_flops:.3e} flops/step" if xla_flops else "no cost analysis"),
        _row(case, "compile (ahead of time)", compile_s, "s", ""),
        _row(case, "peak device memory", mem / 2**30 if mem else None, "GiB",
             "" if mem else "device.memory_stats() has no peak_bytes_in_use"),
        _row(case, "loss, last step", losses[-1], "nats", f"first step {losses[0]:.3f}, "
             "built-in corpus (bytes)"),
    ]
    train = section("gpu_train", f"Training on one {device.device_kind}", COLUMNS, rows, [
        "attention in the train step: jaxtp's XLA attention (einsum, fp32 softmax, einsum); "
        "no flash/cuDNN kernel", "MFU counts model flops only (recomputation is not useful work)"])
    log(format_section(train))
    attn = attention_compare(m.n_heads, m.kv_heads, m.head_dim, t.batch_size, m.seq_len)
    log(format_section(attn))
    meta = machine_info("gpu", time.perf_counter() - t_start)
    return {"meta": meta | {"preset": name, "config": cfg.to_dict()},
            "sections": [train, attn]}


def attention_compare(N: int, K: int, H: int, B: int, T: int, samples: int = 10) -> dict:
    """Forward + backward of causal jax.nn.dot_product_attention in bf16, XLA vs cuDNN."""
    case = f"B={B} T={T} N={N} K={K} H={H} bf16 causal, fwd+bwd"
    keys = jax.random.split(jax.random.key(0), 3)
    q_BTNH = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k_BTKH, v_BTKH = (jax.random.normal(k, (B, T, K, H), jnp.bfloat16) for k in keys[1:])
    rows, medians = [], {}
    for impl in ("xla", "cudnn"):
        loss = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl).astype(jnp.float32).sum()
        try:
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(fn(q_BTNH, k_BTKH, v_BTKH))
            times = []
            for _ in range(samples):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q_BTNH, k_BTKH, v_BTKH))
                times.append(time.perf_counter() - t0)
            medians[impl] = float(np.median(times))
            rows.append(_row(case, f"time, implementation={impl!r} (median of {samples})",
                             medians[impl] * 1e3, "ms", ""))
        except Exception as e:  # cuDNN is absent off NVIDIA GPUs, or rejects the shape
            msg = (str(e).strip().splitlines() or [""])[0][:160]
            rows.append(_row(case, f"time, implementation={impl!r}", None, "ms",
                             f"unavailable: {type(e).__name__}: {msg}"))
    ratio = medians["cudnn"] / medians["xla"] if len(medians) == 2 else None
    rows.append(_row(case, "cudnn / xla", ratio, "ratio", "" if ratio else "needs both"))
    return section("attention", "Attention kernels: jax.nn.dot_product_attention",
                    COLUMNS, rows, ["not jaxtp's attention: what a fused kernel would change"])
