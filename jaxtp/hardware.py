"""The one hardware table: each accelerator's peak FLOP/s (MFU's
denominator), memory, links and compile-only target, and the model FLOPs a
token costs. Read by the training loop's metrics, the planner, the predictor
and the compile-only targets."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: how to recognise it and what it offers per chip."""

    name: str
    kinds: tuple[str, ...]  # substrings of `device.device_kind` that name it
    peak_flops: float  # dense bf16 FLOP/s
    memory: int | None = None  # bytes one device offers
    link: float | None = None  # bytes/s one chip moves along the tp axis, each way
    platform: str = ""  # "cuda" or "tpu": what a compile-only topology takes
    sms: int = 0  # GPUs: streaming multiprocessors
    hbm_bandwidth: float = 0.0
    topology: str = ""  # TPUs: the topology string for 8 chips
    description: str = ""  # GPUs: the device kind the driver reports


# The one hardware table: MFU's peak by device kind, the planner's memory and
# link, the compile-only targets (jaxtp.parallel.targets). First match of a
# device kind wins: "TPU v5" (what a v5p VM reports) after the v5e names.
HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: 132 SMs, 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s
    # dense bf16, NVLink 4 at 900 GB/s bidirectional (450 each way). Memory:
    # what CUDA reports for an "NVIDIA H100 80GB HBM3" (79.1 GiB).
    "h100": Hardware("h100", ("H100",), 989e12, 84_942_979_072, 450e9, "cuda", sms=132,
                     hbm_bandwidth=3.35e12, description="NVIDIA H100 80GB HBM3"),
    # NVIDIA H200 SXM datasheet: H100's compute and NVLink, 141 GB HBM3e at
    # 4.8 TB/s (CUDA reports 141.0 GiB).
    "h200": Hardware("h200", ("H200",), 989e12, 151_397_597_184, 450e9, "cuda", sms=132,
                     hbm_bandwidth=4.8e12, description="NVIDIA H200 141GB HBM3e"),
    # NVIDIA A100 datasheet: 312 TFLOP/s dense bf16.
    "a100": Hardware("a100", ("A100",), 312e12),
    # Google Cloud TPU v5e: 197 TFLOP/s bf16; v4: 275.
    "tpu-v5e": Hardware("tpu-v5e", ("TPU v5 lite", "TPU v5e"), 197e12),
    # Google Cloud TPU v5p: 95 GiB HBM2e, 459 TFLOP/s bf16; ICI 9e10 B/s per
    # link each way, a ring along one torus axis uses both directions: 1.8e11
    # (Austin et al. 2025, "How to Scale Your Model").
    "tpu-v5p": Hardware("tpu-v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GiB, 1.8e11, "tpu",
                        topology="v5p:2x2x2"),
    "tpu-v4": Hardware("tpu-v4", ("TPU v4",), 275e12),
}
# the accelerators --plan and --compare-hlo can compile for (memory, link and
# a compile-only topology known)
TARGET_NAMES = tuple(k for k, h in HARDWARE.items() if h.memory and h.platform)


def hardware_of(device) -> Hardware | None:
    kind = getattr(device, "device_kind", "")
    return next((h for h in HARDWARE.values() if any(k in kind for k in h.kinds)), None)


def peak_flops(device) -> float | None:
    """The device's dense bf16 peak (MFU's denominator), where it is known.
    fp32 runs measure MFU against the bf16 peak too."""
    hw = hardware_of(device)
    return hw.peak_flops if hw else None


def model_flops_per_token(cfg, n_params: int) -> float:
    """6N + 12*L*h*s: matmul flops of forward and backward per token
    (Chowdhery et al. 2022, App. B: h = heads x head dim, which is d_model
    unless `model.d_head` sets it apart), recomputation not counted. N counts the
    parameters that multiply: not the input lookup table (when untied from the
    LM head) nor learned positions; of a mixture of experts only the k
    experts a token takes (its active parameters, as MaxText's and
    Megatron-Core's MFU count them; slots past a token's k, capacity's
    padding, are not useful work)."""
    m = cfg.model
    lookup = (0 if m.tie_embeddings else m.padded_vocab * m.d_model) + \
        (0 if m.style == "llama" else m.seq_len * m.d_model)
    idle = 0
    if m.n_experts:  # each expert's up (gate and up for SwiGLU) and down matmuls
        per_expert = (3 if m.style == "llama" else 2) * m.d_model * m.expert_d_ff
        idle = m.n_moe_layers * (m.n_experts - m.moe_top_k) * per_expert
    return 6 * (n_params - lookup - idle) + 12 * m.n_layers * m.n_heads * m.head_dim * m.seq_len


