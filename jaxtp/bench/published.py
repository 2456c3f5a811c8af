"""The step predictor against runs others published (`python -m jaxtp.bench
--only predict`).

Each row: the source, the configuration as jaxtp expresses it, the published
figure, the prediction and predicted / published, whatever it comes out; the
mean and max error over the rows. Training rows are compiled deviceless for
the cluster's accelerator (with the XLA flags the run set, where it names
them) and priced op by op (`jaxtp.analysis.price`); where that compiler is
not installed, by the configuration's ledger (`jaxtp.analysis.predict`).
Decode rows use `predict_decode`. No constant is fitted to these rows: each
is cited where it is defined.
"""

from __future__ import annotations

import numpy as np

from ..analysis import predict as P
from ..analysis.cluster import PRESETS
from ..analysis.price import accelerator_costs, price
from ..parallel.targets import TargetUnavailable, target_mesh
from ..train.step import compiled_step
from ..config import apply_overrides, load_config, validate
from ..hardware import model_flops_per_token
from .report import section

TITAN = "torchtitan benchmarks/"
# Llama-2-7B (meta-llama/Llama-2-7b-hf config.json): MHA, 32 x 4096, F 11008, V 32000
LLAMA2_7B = ("model.vocab_size=32000", "model.n_kv_heads=0", "model.d_ff=11008",
             "model.rope_theta=10000.0", "model.rope_scaling_factor=0.0")

# (source, configuration, preset, overrides, cluster, published tokens/s per GPU, misses)
TRAINING = [
    (TITAN + "llama3_h100_202412_torchtitan.md (Table 1, FSDP, eager)",
     "Llama-3.1-8B, 8 H100, FSDP 8, local batch 2 x 8192, bf16, selective AC", "llama3-8b",
     ("parallel.dp=8", "parallel.fsdp=true", "train.batch_size=16", "model.remat=minimal"),
     "h100x8", 5762.0,
     "eager PyTorch's kernels, attention at its own efficiency, selective AC's recompute; "
     "their H100s: HBM2e at 2.4 TB/s and 500 W, below the SXM peak used here"),
    (TITAN + "asyncTP_llama3_h100_2025-06_torchtitan.md (bf16, vanilla TP)",
     "Llama-3.1-8B, 64 H100, FSDP 8 x TP 8 (SP), local batch 12 x 8192, bf16, per-op SAC, "
     "compiled", "llama3-8b",
     ("parallel.dp=8", "parallel.tp=8", "parallel.sp=true", "parallel.fsdp=true",
      "train.batch_size=96", "model.remat=minimal"), "h100x8x8nodes", 4378.0,
     "NCCL contention between the tp and FSDP streams (one communication stream here); "
     "torch.compile's kernels against XLA's; 500 W H100s"),
    (TITAN + "llama3_h100_202412_torchtitan.md (Table 2, FSDP 2 x CP 4)",
     "Llama-3.1-8B, 8 H100, FSDP 2 x CP 4, 131072 tokens, local batch 1, full AC "
     "(published in Float8; predicted in bf16)", "llama3-8b",
     ("parallel.dp=2", "parallel.cp=4", "parallel.fsdp=true", "train.batch_size=2",
      "model.seq_len=131072", "model.remat=full"), "h100x8", 1071.0,
     "Float8 matmuls there (up to 2x bf16's peak) against bf16 here; their ring attention "
     "over cp (load-balanced chunks, SDPA per block) against jaxtp's all-gathered keys and "
     "cuDNN's kernel at its published rate; eager PyTorch"),
]
# Llama-3.1-405B (meta-llama/Llama-3.1-405B config.json): 126 x 16384, 128 heads, 8 kv,
# F 53248; as 128 layers here (jaxtp splits layers evenly over pp x v chunks)
LLAMA31_405B = ("model.n_layers=128", "model.d_model=16384", "model.n_heads=128",
                "model.n_kv_heads=8", "model.d_ff=53248")
# torchtitan's Table 5: 512 H100, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256) of 8192,
# full AC, Float8 and async TP; one row per microbatch (M = 32)
PP405 = (*LLAMA31_405B, "parallel.dp=8", "parallel.fsdp=true", "parallel.tp=8",
         "parallel.sp=true", "parallel.pp=8", "train.batch_size=256", "train.microbatches=32",
         "model.remat=full")
PP405_MISSES = ("Float8 matmuls there (up to 2x bf16's peak) against bf16 here; 126 layers as "
                "128; ")
TRAINING += [
    (TITAN + "llama3_h100_202412_torchtitan.md (Table 5, 1F1B)",
     "Llama-3.1-405B, 512 H100, FSDP 8 x TP 8 x PP 8, M = 32, full AC, 1F1B", "llama3-70b",
     (*PP405, "parallel.pp_schedule=1f1b"), "h100x8x64nodes", 100.0,
     PP405_MISSES + "jaxtp's 1F1B is one SPMD program whose bubble ticks compute on dropped "
     "data ((M+p-1)/M of the blocks' flops, GPipe's), where torchtitan's idles its "
     "bubble; async TP"),
    (TITAN + "llama3_h100_202412_torchtitan.md (Table 5, interleaved 1F1B)",
     "Llama-3.1-405B, 512 H100, FSDP 8 x TP 8 x PP 8, M = 32, full AC, interleaved (v = 2)",
     "llama3-70b", (*PP405, "parallel.pp_schedule=interleaved", "parallel.pp_repeats=2"),
     "h100x8x64nodes", 128.0,
     PP405_MISSES + "jaxtp's interleaved 1F1B at v = 2 (torchtitan's v unstated): the bubble "
     "(p-1)/(vM+p-1) computed on dropped data; async TP"),
]
# MaxText (AI-Hypercomputer/maxtext) end_to_end/tpu/mixtral/Run_Mixtral.md: Mixtral 8x7B on
# v5p-128, 251.94 TFLOP/s per chip, 54.89% MFU (added in 7534e5e21, 2024-07-04). The row
# names no configuration; the one assumed is that commit's end_to_end/tpu/mixtral/8x7b/
# 2_test_mixtral.sh pre-training run: ici_fsdp_parallelism=64 (v5p-128 = 64 chips),
# per_device_batch_size=8, max_target_length=1024, bf16 weights (weight_dtype=bfloat16),
# flash attention, megablox (dropless) and base.yml's remat_policy=full and scan_layers.
# MaxText's TFLOP count then (maxtext_utils.calculate_tflops_training_per_device): the k
# experts' FFN flops and the gate's, attention not causal: jaxtp's 6 x active + 12*L*h*s.
MAXTEXT = "MaxText end_to_end/tpu/mixtral/"
TRAINING += [
    (MAXTEXT + "Run_Mixtral.md (v5p-128)",
     "Mixtral 8x7B, 64 v5p chips, FSDP 64, local batch 8 x 1024, bf16 weights, full remat, "
     "dropless (config from 8x7b/2_test_mixtral.sh at 7534e5e21)", "mixtral-8x7b",
     ("parallel.dp=64", "parallel.fsdp=true", "train.batch_size=512", "model.seq_len=1024",
      "model.param_dtype=bfloat16", "model.remat=full", "model.capacity_factor=0"),
     "v5p-128", 251.94,
     "megablox's grouped GEMM over the routed tokens' rows there, against jaxtp's dense "
     "one-hot dispatch and combine (dropless: C = s slots per expert, E/k = 4x the experts' "
     "active flops, which the prediction does not count); the run's configuration assumed "
     "(the README names none); the 4x4x4 torus priced as one ring per axis; v5p's matmul "
     "fraction 1.0 (none published)", "TFLOP/s per chip"),
]
# NVIDIA/dgxc-benchmarking maxtext/README_70b.md (143b90dd9, GSW 25.01): MaxText (JAX, image
# ghcr.io/nvidia/jax:maxtext-2024-12-09) Llama-2-70B in BF16 on 64 DGX H100s, FSDP 64 (ici 8
# x dcn 8), per-device batch 2 of 4096 (GBS 128), remat_policy save_qkv_proj, cuDNN flash
# attention, scan_layers: 6.999 s a step, 74,908.99 tokens/s. Its XLA flags (configure.sh)
# pipeline the collectives across the scanned layers; the deviceless compile takes them.
# Llama-2-70B (meta-llama/Llama-2-70b-hf config.json): 80 x 8192, 64 heads, 8 kv, F 28672,
# V 32000, rope theta 10000; as llama3-70b with those changed.
MAXTEXT_GPU_FLAGS = {"xla_gpu_enable_pipelined_all_gather": True,
                     "xla_gpu_enable_pipelined_reduce_scatter": True,
                     "xla_gpu_enable_pipelined_all_reduce": True,
                     "xla_gpu_enable_while_loop_double_buffering": True}
TRAINING += [
    ("NVIDIA/dgxc-benchmarking maxtext/README_70b.md (BF16, 64x H100)",
     "Llama-2-70B, 64 H100, FSDP 64, local batch 2 x 4096, bf16, MaxText (JAX) with its "
     "XLA flags", "llama3-70b",
     ("model.vocab_size=32000", "model.rope_theta=10000.0", "model.rope_scaling_factor=0.0",
      "parallel.dp=64", "parallel.fsdp=true", "train.batch_size=128", "model.seq_len=4096",
      "model.remat=full"), "h100x8x8nodes", 74908.99 / 64,
     "MaxText's remat policy save_qkv_proj (keeps q, k, v) as jaxtp's full remat; its "
     "PGLE profile-guided schedule; jaxtp's program compiled with MaxText's pipelining flags "
     "but not its combine thresholds", "tokens/s per GPU", MAXTEXT_GPU_FLAGS),
]
# gpt-fast README (pytorch-labs/gpt-fast): Llama-2-7B, 8 x A100-80GB power-limited
# to 330 W, hybrid cube-mesh NVLink, bf16, batch 1, a 5-token prompt
DECODE = [("gpt-fast README (Llama-2-7B, base bf16)", 1, 104.9),
          ("gpt-fast README (Llama-2-7B, tensor parallel 8)", 8, 328.4)]
DECODE_CONTEXT = 205  # the prompt and the 200 tokens its benchmark generates: the last token


def op_priced(cfg, cluster, options: dict | None = None) -> dict | None:
    """`cfg`'s train step compiled for `cluster`'s accelerator (deviceless,
    `jaxtp.parallel.targets`) and priced op by op (`jaxtp.analysis.price`);
    None where that compiler or topology is not available here."""
    name = {"h100": "h100", "h200": "h200", "tpu-v5p": "tpu-v5p"}.get(cluster.accelerator.name)
    try:
        if name is None:
            raise TargetUnavailable(f"no compile-only target for {cluster.accelerator.name}")
        mesh = target_mesh(name, **cfg.parallel.degrees)
    except TargetUnavailable as e:
        return {"why": str(e)}
    _, compiled = compiled_step(cfg, mesh, options)
    return price(compiled.as_text(), accelerator_costs(cluster.accelerator),
                 dict(mesh.shape), cluster)


def training_row(source, what, preset, overrides, cluster, published, misses,
                 unit="tokens/s per GPU", options=None, log=print, compile: bool = True) -> dict:
    """One published training run against its prediction, in `unit`:
    tokens/s per device, or model TFLOP/s per chip (MaxText's: model flops
    per token x tokens/s per device). Priced op by op from the step
    compiled for the cluster's accelerator where that compiles here (and
    `compile`); else by the ledger (`predict_config`), communication
    exposed, said so. The ledger's two bounds are kept beside it.
    `options`: the XLA flags the published run set, given to the compile."""
    cfg = validate(apply_overrides(load_config(preset), ["model.dtype=bfloat16", *overrides]))
    c = PRESETS[cluster]
    scale = 1.0 if unit.startswith("tokens") else \
        model_flops_per_token(cfg, P.param_count(cfg)) / 1e12
    pred = P.predict_config(cfg, c)
    row = {"source": source, "config": what, "cluster": cluster, "measured": unit,
           "published": published, "misses": misses,
           "ledger_exposed": pred["exposed"]["tokens_per_s_per_device"] * scale,
           "ledger_hidden": pred["hidden"]["tokens_per_s_per_device"] * scale,
           "predicted": pred["exposed"]["tokens_per_s_per_device"] * scale,
           "comm_share": pred["comm_s"] / pred["exposed"]["step_s"],
           "priced": "ledger, communication exposed (not compiled)"}
    if compile:
        log(f"compiling {what} for {c.accelerator.name} (deviceless) ...")
        priced = op_priced(cfg, c, options)
        if "step_s" in priced:
            tokens = cfg.train.batch_size * cfg.model.seq_len
            row |= {"predicted": tokens / priced["step_s"] / cfg.parallel.devices * scale,
                    "priced": "op by op", "comm_share": priced["exposed_s"] / priced["step_s"],
                    "step_s": priced["step_s"]}
        else:
            row["priced"] = f"ledger, communication exposed ({priced['why'][:90]})"
    return row | {"ratio": row["predicted"] / published}


def decode_rows() -> list[dict]:
    cfg = validate(apply_overrides(load_config("llama3-8b"),
                                   ["model.dtype=bfloat16", *LLAMA2_7B]))
    by_tp = {r["tp"]: r for r in P.predict_decode(cfg, PRESETS["a100x8"], 1, DECODE_CONTEXT,
                                                  tps=(1, 8), impl=cfg.parallel.impl)}
    rows = []
    for source, tp, published in DECODE:
        r = by_tp[tp]
        rows.append({
            "source": source, "config": f"Llama-2-7B decode, batch 1, tp={tp}, A100-80GB, bf16",
            "cluster": "a100x8", "measured": "tokens/s", "published": published,
            "predicted": r["tokens_per_s"], "ratio": r["tokens_per_s"] / published,
            "ledger_exposed": r["tokens_per_s"], "ledger_hidden": r["tokens_per_s"],
            "priced": "decode: weights and KV cache over HBM + collectives",
            "comm_share": r["comm_s"] / r["token_s"],
            "misses": "their A100s at 330 W (about 1,700 GB/s peak by their measure, 1,397 "
                      "reached) against the datasheet's 2,039; norms, rotary, sampling, "
                      "launches" if tp == 1 else
                      "704 GB/s reached per GPU at tp=8 (gpt-fast); a hybrid cube-mesh, not "
                      "NVSwitch; the all-reduce's 20 us measured on H100s (marin#6736)"})
    return rows


def bench_predict(log=print, compile: bool = True) -> dict:
    rows = [training_row(*r, log=log, compile=compile) for r in TRAINING] + decode_rows()
    err = [abs(r["ratio"] - 1) for r in rows]
    ops = [abs(r["ratio"] - 1) for r in rows if r["priced"] == "op by op"]
    return section("predict", "Predicted step against published runs", [
        ("source", "source"), ("config", "configuration"), ("cluster", "cluster preset"),
        ("measured", "unit"), ("published", "published"), ("predicted", "predicted"),
        ("ratio", "predicted / published"), ("priced", "priced"),
        ("comm_share", "exposed comm. share of the step"), ("misses", "what the model misses")],
        rows, [
        f"|predicted / published - 1|: mean {np.mean(err):.1%}, max {np.max(err):.1%} over "
        f"{len(rows)} rows" + (f"; over the {len(ops)} rows priced op by op: mean "
                               f"{np.mean(ops):.1%}, max {np.max(ops):.1%}" if ops else ""),
        "op by op: jaxtp.analysis.price over the step compiled deviceless for the cluster's "
        "accelerator (Calculon's matmul tiers capped at the MAMF fraction, cuDNN attention by "
        "sequence from the FlashAttention-3 paper, HBM at 2.8/3.35 of its bandwidth, NCCL at "
        "370/450 of NVLink, InfiniBand at its measured 48 GB/s), the overlap XLA scheduled; "
        "nothing fitted to these rows",
        "ledger: rows whose target cannot be compiled here (jaxlib 0.10.2 builds up to 64 "
        "compile-only H100s; no libtpu installed) keep the ledger's pricing, communication "
        "exposed"])
