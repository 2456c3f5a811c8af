"""What a config's model holds, from its sizes alone (no JAX, nothing built):
its parameter count, the least memory a training step needs, and the
refusal of a config that no accelerator holds, or that this machine does
not. `--plan` and a training run check it before they build anything: a
model of 10**9 layers would otherwise trace for minutes before failing, and
Mixtral 8x7B on a CPU machine allocate for a minute before running out."""

from __future__ import annotations

import math

from .checks import ONE_F_ONE_B, SPLIT
from .hardware import HARDWARE, GiB

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def param_count(cfg) -> int:
    """Parameters of `cfg`'s model, from its sizes (the model's own count is
    checked against this in the tests)."""
    m = cfg.model
    D, F, L, V, H = m.d_model, m.d_ff, m.n_layers, m.padded_vocab, m.head_dim
    N, K = m.n_heads, m.kv_heads
    llama, bias = m.style == "llama", m.use_bias
    attn = D * N * H + 2 * D * K * H + N * H * D + (N * H + 2 * K * H + D if bias else 0) + \
        (2 * H if m.qk_norm else 0) + (N * H + 2 * K * H if m.qkv_bias and not bias else 0)
    mlp = (3 * D * F if llama else 2 * D * F) + ((2 * F if llama else F) + D if bias else 0)
    dense_mlp = mlp
    if m.n_experts:  # the router [D, E], E expert MLPs without biases (jaxtp.model.moe), a
        S = m.moe_shared_d_ff  # shared expert (a dense MLP, biases where asked; its gate [D,
        # 1]) and the loss-free balance's bias [E]
        mlp = D * m.n_experts + m.n_experts * (3 if llama else 2) * D * m.expert_d_ff + \
            ((3 * D * S if llama else 2 * D * S) + ((2 * S if llama else S) + D if bias else 0)
             if S else 0) + D * m.moe_shared_gate + m.n_experts * m.moe_balance.startswith("bias")
    norms = 2 * D * (1 if llama else 2)  # RMSNorm: a scale; LayerNorm: scale and bias
    table = V * D * (1 if m.tie_embeddings else 2)
    M = m.n_moe_layers  # (the others are dense: `model.moe_every`)
    return L * (attn + norms) + M * mlp + (L - M) * dense_mlp + table + (1 if llama else 2) * D + \
        (0 if llama else m.seq_len * D)


def state_bytes(cfg) -> int:
    """The least a training step holds over all its devices together: the
    parameters, their gradients and Adam's two moments, each in the param
    dtype (`jaxtp.train.optim`), and the batch's residual stream [B, T, D]
    once in the compute dtype. Split without a replica and without
    temporaries: a floor, never an estimate (`--plan` compiles for that)."""
    m, t = cfg.model, cfg.train
    return (4 * param_count(cfg) * ITEMSIZE[m.param_dtype]
            + t.batch_size * m.seq_len * m.d_model * ITEMSIZE[m.dtype])


def _floor(cfg, devices: int) -> str:
    n = param_count(cfg)
    return (f"the model's weights, gradients and Adam state and one batch of activations come "
            f"to at least {_bytes(state_bytes(cfg))} ({_count(n)} parameters in "
            f"{cfg.model.param_dtype}, batch {cfg.train.batch_size} x {cfg.model.seq_len} "
            f"tokens)" + (f", {_bytes(-(-state_bytes(cfg) // devices))} a device split "
                          f"evenly over {devices}" if devices > 1 else ""))


def check_plannable(cfg, devices: int) -> None:
    """Refuse (ValueError) a plan whose floor per device, split evenly over
    the `devices` of its largest mesh, is past the memory of every
    accelerator in the hardware table: nothing could run it, and compiling
    it only takes time."""
    largest = max((h for h in HARDWARE.values() if h.memory), key=lambda h: h.memory)
    if -(-state_bytes(cfg) // devices) > largest.memory:
        raise ValueError(f"{_floor(cfg, devices)}: more than any accelerator holds (the "
                         f"largest jaxtp knows, {largest.name}, has "
                         f"{largest.memory / GiB:.0f} GiB); plan a smaller model or batch, "
                         "or more devices (--dp with --fsdp, --pp, --ep)")


def check_fits(cfg, devices: int, memory: int, where: str) -> None:
    """Refuse (ValueError) a run whose floor, on the `devices` this process
    holds of the mesh, is past the `memory` they offer (`where` says
    whose): said before anything is allocated, not as an allocator's
    traceback a minute later."""
    mesh = cfg.parallel.devices
    need = -(-state_bytes(cfg) * devices // mesh)
    if need > memory:
        raise ValueError(f"{_floor(cfg, mesh)}: {_bytes(need)} on {where}, which "
                         f"has {_bytes(memory)}; python train.py --plan shows what it takes "
                         "on accelerators (memory per device, by layout)")


def _bytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n < 1e15 else f"{n:.3g} bytes"


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,}"


__all__ = ["ITEMSIZE", "check_fits", "check_plannable", "param_count", "state_bytes"]


# the analytic activation memory `--plan` prints beside the compiled one


def capacity(T: int, k: int, E: int, factor: float) -> int:
    """Slots per expert per group of T tokens: ceil(factor * T * k / E), at
    most T (no token takes an expert twice); factor 0: T (dropless)."""
    if factor <= 0:
        return T
    return max(1, min(T, math.ceil(factor * T * k / E)))


def activation_bytes(cfg) -> float:
    """Korthikanti et al. 2022 activation memory of all layers, per device
    (under cp for a rank's s/cp positions, whose scores span all s keys),
    for the microbatches a device holds at once: one without a pipeline
    (slices run one after another); under pp a stage's L/p layers, for all
    M microbatches (GPipe, circular: the backward starts after every
    forward; Huang et al. 2019), or, under 1F1B (Narayanan et al. 2021),
    the 2p - 1 microbatches its stage 0 holds from forward to backward
    (`jaxtp.parallel.pipeline_1f1b`: a lock-step tick's forward output
    reaches the next stage a tick later, so a round trip is 2p - 2 ticks);
    interleaved over v chunks, v*p + p - 1 chunks of L/(p*v) layers; with
    `parallel.pp_stash=inputs` only those chunks' inputs (b*s*h each) and
    one chunk's layers, recomputed from its input; zb adds the weight
    matmuls' output cotangents of the p chunks between their B and W."""
    m, p = cfg.model, cfg.parallel
    t, M = p.tp, cfg.train.microbatches
    # (ep splits the batch as dp does)
    s, b, h, a = m.seq_len, cfg.train.batch_size // (p.dp * p.ep * M), m.d_model, m.n_heads
    sl = s // p.cp  # a cp rank's positions; its queries still see s keys
    if p.sequence_parallel:
        per_layer = sl * b * h / t * (34 + 5 * a * s / h)
    else:
        per_layer = sl * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    width = ITEMSIZE[m.dtype] / 2
    if m.n_experts:  # the MLP's 19sbh (2 + 1 replicated, 16/t split) for the MoE's own,
        # in the MoE layers' share of the layers (`model.moe_every`)
        per_layer += (-sl * b * h * (3 + 16 / t) + moe_activation_bytes(cfg) / width) * \
            m.n_moe_layers / m.n_layers
    layers = m.n_layers // p.pp
    if p.pp == 1:
        return layers * per_layer * width
    if p.pp_schedule in ONE_F_ONE_B:  # its stash: v*p + p - 1 chunks' (v*M when fewer)
        v = p.pp_repeats
        held = min(v * M, v * p.pp + p.pp - 1)
        if p.pp_stash == "inputs":  # their inputs, and one chunk's layers recomputed
            return (held * sl * b * h / (t if p.sequence_parallel else 1) * 2
                    + layers / v * per_layer) * width
        # zb: and what each B hands its W (`jaxtp.parallel.vjp_split`), from B
        # to W: up to p chunks (stage r holds r + 1), each layer's weight
        # matmuls' output cotangents (Qi et al. 2024, Sec. 3: the gradient
        # at each matmul's output, kept for its weight gradient)
        handed = min(v * M, p.pp) * layers / v * _cotangents(cfg, sl * b) \
            if p.pp_schedule in SPLIT else 0
        return (held * layers / v * per_layer + handed) * width
    return M * layers * per_layer * width


def _cotangents(cfg, rows: int) -> float:
    """16-bit bytes of one layer's weight matmuls' output cotangents for
    `rows` token rows on a rank: q/k/v and the MLP's up (and gate) split over
    tp, the attention's and the MLP's outputs whole (split over tp under SP)."""
    m, p = cfg.model, cfg.parallel
    t, out = p.tp, 1 if not p.sequence_parallel else p.tp
    F = (m.moe_d_ff or m.d_ff) * m.moe_top_k if m.n_experts else m.d_ff
    qkv = (m.n_heads + 2 * m.kv_heads) * m.head_dim
    return 2 * rows * (qkv / t + (2 if m.style == "llama" else 1) * F / t + 2 * m.d_model / out)


def moe_activation_bytes(cfg) -> float:
    """What one MoE layer keeps for the backward pass per device and
    microbatch, in place of Korthikanti's MLP terms: the layer's input
    (b*s*D, replicated over tp), the router's fp32 logits and probabilities
    (2 x b*s*E), the dispatch and combine tensors ([G_r, s, E, C] each), and
    over the slots (E * G_r * C of them: `jaxtp.analysis.ep.slots`, the
    experts' buffer after the all-to-all as before it) the experts' input
    and output (D each) and their hidden units (F/tp: gate, up and SwiGLU's
    product, or GELU's input and output); a shared expert's hidden units
    over the tokens (the same count with its own F). b = G_r: the rank's
    sequences."""
    m, p = cfg.model, cfg.parallel
    G = cfg.train.batch_size // (p.dp * p.ep * cfg.train.microbatches)
    s, D, E, w = m.seq_len, m.d_model, m.n_experts, ITEMSIZE[m.dtype]
    C = capacity(s, m.moe_top_k, E, m.capacity_factor)
    hidden = lambda F: (3 if m.style == "llama" else 2) * F / p.tp
    r = 8 if m.dtype == "float64" else 4  # the router's fp32 logits, probabilities (`wide`)
    return (G * s * D * w + 2 * G * s * E * r + 2 * G * s * E * C * w
            + E * G * C * (2 * D + hidden(m.expert_d_ff)) * w
            + G * s * hidden(m.moe_shared_d_ff) * w)


def korthikanti_terms(cfg) -> str:
    """Which terms of the Korthikanti et al. activation count apply to this model."""
    m = cfg.model
    return (f"Korthikanti terms for this model: activations {m.dtype} (estimate scaled by "
            f"{ITEMSIZE[m.dtype] / 2:g} from 16-bit); residual/MLP dropout masks "
            f"(2sbh per block) {'kept' if m.dropout > 0 else 'absent (dropout=0)'}; attention "
            "dropout (as^2b mask + 2as^2b output of the 5as^2b) absent: jaxtp has none; "
            + ("SwiGLU keeps gate and up (more than the GELU count)" if m.style == "llama"
               else "GELU MLP as counted"))
