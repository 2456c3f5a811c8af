"""Absolute speed on one accelerator: `python -m jaxtp.bench --gpu` (bench/gpu.sh).

Trains a preset at tp=1 for a fixed number of steps on the first device and
reports tokens/s, step time, model TFLOP/s and MFU: model flops per token
6N + 12*L*h*s (`jaxtp.hardware.model_flops_per_token`, recomputation
not counted, as in PaLM's MFU) against the device's dense bf16 peak
(`jaxtp.hardware.HARDWARE`). Then the same model at half the batch with
each attention kernel in the train step (cuDNN's flash attention against
XLA's einsum/softmax/einsum, which does not fit the full batch), and the
kernels alone (`jaxtp.model.kernels.attend`, forward + backward) at the train
shapes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.cluster import one_device
from ..analysis.predict import predict_step, step_flops
from ..config import Config, apply_overrides, load_config, validate
from ..model import kernels
from ..parallel import Layout, make_mesh
from ..train.data import Dataset, load_tokens, to_mesh
from ..hardware import model_flops_per_token, peak_flops
from ..model.build import resolve_attention
from ..train.state import init_train_state
from ..train.step import compile_train_step, step_controls
from . import collectives as bc
from .report import RATIO_COLUMNS, format_section, machine_info, section

# llama-1b on one 80 GB GPU, from the planner compiling for an H100 (jaxtp.
# targets): bf16 compute, fp32 master weights and Adam (14 GB), scanned
# layers, the "minimal" remat policy, the loss in 4096-token chunks and
# attention=auto (cuDNN): 8 x 4096 needs 44.6 GiB; 16 x 4096 or 8 x 8192 need
# 71.1 GiB, above 90% of the device. With XLA attention 8 x 4096 needs 91.1.
GPU_PRESET_OVERRIDES = {"llama-1b": ("train.batch_size=8", "model.seq_len=4096",
                                     "model.dtype=bfloat16", "model.scan_layers=true",
                                     "model.remat=minimal", "model.attention=auto",
                                     "model.loss_chunk=4096")}
COLUMNS = RATIO_COLUMNS + [("detail", "detail")]


def _row(case, measured, value, unit, detail=""):
    return {"case": case, "measured": measured, "value": value, "unit": unit, "detail": detail}


def gpu_config(preset: str = "llama-1b", overrides=()) -> Config:
    """The preset, its GPU defaults, then `overrides`, at tp=1 and dp=1 (validated)."""
    cut = [*GPU_PRESET_OVERRIDES.get(preset, ()), *overrides, "parallel.tp=1", "parallel.dp=1"]
    return validate(apply_overrides(load_config(preset), cut))


def check_accelerator(preset: str = "llama-1b") -> None:
    """A ValueError where jax.devices()[0] is the host's CPU: --gpu's presets
    are sized for an 80 GB accelerator (llama-1b at 8 x 4096 asks 86 GB of a
    CPU host, and dies after minutes out of memory). JAXTP_BENCH_ANY_DEVICE=1
    runs it anyway (bench/gpu.sh's dry run, with small overrides)."""
    device = jax.devices()[0]
    if device.platform == "cpu" and not os.environ.get("JAXTP_BENCH_ANY_DEVICE"):
        raise ValueError(
            f"--gpu times training on a GPU, and none was found: jax.devices()[0] is "
            f"{device.platform} ({device.device_kind}); run it where jax has CUDA (pip install "
            "'jax[cuda12]'); here, python -m jaxtp.bench --quick runs the CPU suite and "
            f"python train.py --plan --config {preset} --tp 1 plans the preset's memory")


def train_timed(cfg: Config, steps: int, warmup: int, peak: float | None) -> dict:
    """Train `cfg` on jax.devices()[0] for warmup + steps steps; timings and memory."""
    m, t = cfg.model, cfg.train
    device = jax.devices()[0]
    mesh = make_mesh(1, 1, devices=[device])
    cfg = resolve_attention(cfg, device)
    state = init_train_state(cfg, mesh)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    t0 = time.perf_counter()
    step = compile_train_step(state, t.batch_size, m.seq_len)
    compile_s = time.perf_counter() - t0
    cost = step.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    xla_flops, hbm_bytes = cost.get("flops"), cost.get("bytes accessed")
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
    mem = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return {"cfg": cfg, "n_params": n_params, "compile_s": compile_s, "xla_flops": xla_flops,
            "hbm_bytes": hbm_bytes,
            "step": s, "tokens_s": tokens_s, "flops_token": flops_token, "tflops": tflops,
            "mfu": 100 * tflops * 1e12 / peak if peak else None, "peak_mem": mem,
            "losses": losses, "steps": steps, "warmup": warmup}


def _predicted(r: dict, device, case: str) -> dict:
    """What `jaxtp.analysis.predict` expects of this run on one such device."""
    one = one_device(device.device_kind)
    if one is None:
        return _row(case, "predicted throughput (jaxtp.analysis.predict)", None, "tokens/s",
                    f"{device.device_kind!r} is not a known accelerator")
    cfg = r["cfg"]
    tokens = cfg.train.batch_size * cfg.model.seq_len
    # a scanned stack's body counts once in XLA's cost analysis: model flops then
    scanned = cfg.model.scan_layers
    flops = step_flops(cfg) * tokens if scanned or not r["xla_flops"] else r["xla_flops"]
    p = predict_step(one, Layout.make().sizes, flops, [], tokens, r["flops_token"],
                     None if scanned else r.get("hbm_bytes"))
    want = p["hidden"]["tokens_per_s"]
    return _row(case, "predicted throughput (jaxtp.analysis.predict)", want, "tokens/s",
                f"measured / predicted {r['tokens_s'] / want:.3f}; matmuls at "
                f"{one.accelerator.matmul_fraction:.1%} of the peak"
                + ("" if r.get("hbm_bytes") and not scanned else ", HBM time left out"))


def _case(cfg: Config, name: str) -> str:
    m, t = cfg.model, cfg.train
    return (f"{name or 'model'} tp=1 {m.dtype} L={m.n_layers} B={t.batch_size} T={m.seq_len}"
            f"{' scan' if m.scan_layers else ''} remat={m.remat} attention={m.attention}")


def gpu_bench(cfg: Config, steps: int = 40, warmup: int = 3, peak_tflops: float | None = None,
              name: str = "", log=print, kernels_ab=("auto", "xla")) -> dict:
    """Train `cfg` (see `gpu_config`) on jax.devices()[0] and time it; then at
    half the batch once per kernel of `kernels_ab`; then the kernels alone."""
    t_start = time.perf_counter()
    device = jax.devices()[0]
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(device)
    r = train_timed(cfg, steps, warmup, peak)
    m, t = r["cfg"].model, r["cfg"].train
    case, s = _case(r["cfg"], name), r["step"]
    mem, xla_flops = r["peak_mem"], r["xla_flops"]
    rows = [
        _row(case, "throughput", r["tokens_s"], "tokens/s",
             f"{t.batch_size * m.seq_len} tokens/step"),
        _row(case, f"step time (median of {steps} after {warmup} warm-up)", s["median"] * 1e3,
             "ms", f"mean {s['mean'] * 1e3:.1f}, p95 {s['p95'] * 1e3:.1f}"),
        _row(case, "model TFLOP/s (6N + 12Lhs per token)", r["tflops"], "TFLOP/s",
             f"N={r['n_params']:,}, {r['flops_token']:.3e} flops/token"),
        _row(case, "MFU", r["mfu"], "%",
             f"vs {peak / 1e12:g} TFLOP/s dense bf16 peak" if peak else
             f"peak of {device.device_kind!r} unknown: pass --peak-tflops"),
        _row(case, "XLA-counted TFLOP/s (cost_analysis, incl. recompute)",
             xla_flops / s["median"] / 1e12 if xla_flops else None, "TFLOP/s",
             f"{xla_flops:.3e} flops/step" if xla_flops else "no cost analysis"),
        _row(case, "compile (ahead of time)", r["compile_s"], "s", ""),
        _row(case, "peak device memory", mem / 2**30 if mem else None, "GiB",
             "" if mem else "device.memory_stats() has no peak_bytes_in_use"),
        _row(case, "loss, last step", r["losses"][-1], "nats",
             f"first step {r['losses'][0]:.3f}, built-in corpus (bytes)"),
    ]
    rows.append(_predicted(r, device, case))
    train = section("gpu_train", f"Training on one {device.device_kind}", COLUMNS, rows, [
        f"attention in the train step: {m.attention} (model.attention="
        f"{cfg.model.attention})", "MFU counts model flops only (recomputation is not useful "
        "work)"])
    log(format_section(train))
    ab = kernel_ab(cfg, kernels_ab, max(steps // 2, 1), warmup, peak, name)
    log(format_section(ab))
    attn = attention_compare(m.n_heads, m.kv_heads, m.head_dim, t.batch_size, m.seq_len)
    log(format_section(attn))
    meta = machine_info("gpu", time.perf_counter() - t_start)
    return {"meta": meta | {"preset": name, "config": r["cfg"].to_dict()},
            "sections": [train, ab, attn]}


def kernel_ab(cfg: Config, kernels_ab, steps: int, warmup: int, peak, name: str) -> dict:
    """The train step at half the batch with each attention kernel."""
    half = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, batch_size=max(cfg.train.batch_size // 2, 1)))
    rows = []
    for kernel in kernels_ab:
        c = dataclasses.replace(half, model=dataclasses.replace(half.model, attention=kernel))
        try:
            r = train_timed(c, steps, warmup, peak)
            rows += [_row(_case(r["cfg"], name), "throughput", r["tokens_s"], "tokens/s",
                          f"median of {steps} steps"),
                     _row(_case(r["cfg"], name), "MFU", r["mfu"], "%", "")]
        except Exception as e:  # out of memory, or a kernel this device lacks
            msg = (str(e).strip().splitlines() or [""])[0][:160]
            rows.append(_row(_case(c, name), "throughput", None, "tokens/s",
                             f"unavailable: {type(e).__name__}: {msg}"))
    return section("gpu_kernels", "The train step with each attention kernel", COLUMNS, rows,
                   [f"half the batch of the training section ({half.train.batch_size} x "
                    f"{half.model.seq_len}), where XLA attention fits too"])


def attention_compare(N: int, K: int, H: int, B: int, T: int, samples: int = 10) -> dict:
    """Forward + backward of jaxtp's attention kernels in bf16 at the train shapes."""
    case = f"B={B} T={T} N={N} K={K} H={H} bf16 causal, fwd+bwd"
    keys = jax.random.split(jax.random.key(0), 3)
    q_BTKGH = jax.random.normal(keys[0], (B, T, K, N // K, H), jnp.bfloat16)
    k_BTKH, v_BTKH = (jax.random.normal(k, (B, T, K, H), jnp.bfloat16) for k in keys[1:])
    rows, medians = [], {}
    for kernel in ("xla", "blockwise", "cudnn"):
        loss = lambda q, k, v: kernels.attend(q, k, v, kernel).astype(jnp.float32).sum()
        try:
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            jax.block_until_ready(fn(q_BTKGH, k_BTKH, v_BTKH))
            times = []
            for _ in range(samples):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q_BTKGH, k_BTKH, v_BTKH))
                times.append(time.perf_counter() - t0)
            medians[kernel] = float(np.median(times))
            rows.append(_row(case, f"time, {kernel} (median of {samples})",
                             medians[kernel] * 1e3, "ms", ""))
        except Exception as e:  # cuDNN is absent off NVIDIA GPUs; XLA may not fit
            msg = (str(e).strip().splitlines() or [""])[0][:160]
            rows.append(_row(case, f"time, {kernel}", None, "ms",
                             f"unavailable: {type(e).__name__}: {msg}"))
    for kernel in ("blockwise", "cudnn"):
        ratio = medians[kernel] / medians["xla"] if {kernel, "xla"} <= set(medians) else None
        rows.append(_row(case, f"{kernel} / xla", ratio, "ratio", "" if ratio else "needs both"))
    return section("attention", "Attention kernels alone (jaxtp.model.kernels.attend)", COLUMNS, rows,
                   ["forward + backward of the causal attention core, no projections"])
