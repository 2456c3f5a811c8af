"""Configuration: frozen dataclasses, JSON presets, CLI overrides, validation.

A run is described by one `Config` = model shape + training recipe + parallel
layout. Presets live in `configs/*.json` (data, not code; a wheel installs them
as `jaxtp/configs/`). Every error names the offending key or value and says
how to fix it, and is raised before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# the choices a config may make, the error of one it may not, and the rules
# (jaxtp.checks, which imports nothing of this module)
from .checks import (ATTENTIONS, COORDINATOR_TIMEOUT_S, CP_STRATEGIES, DTYPES, IMPLS,
                     INFERENCE_IMPLS, OVERLAPS, PP_SCHEDULES, REMATS, STYLES, ConfigError, check)
from .config_keys import apply_overrides, section_from_dict

# the presets: `jaxtp/configs/` in an installed wheel (pyproject maps the
# repository's top-level `configs/` there), the repository's own in a checkout
_HERE = Path(__file__).resolve().parent
CONFIG_DIR = next((d for d in (_HERE / "configs", _HERE.parent / "configs") if d.is_dir()),
                  _HERE / "configs")
def resumable(default):
    """A field a resumed run may change: it leaves the run the same run (the
    layout, for checkpoints are read into any; the same gradient computed
    another way; what is logged, evaluated and saved, and when to stop)."""
    return dataclasses.field(default=default, metadata={"resumable": True})


def degree(default: int = 1):
    """A parallel degree: the size of the mesh axis of the same name (and
    resumable: checkpoints are read into any layout)."""
    return dataclasses.field(default=default, metadata={"resumable": True, "degree": True})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # "gpt2": LayerNorm, learned positions, GELU MLP;
    # "llama": RMSNorm, rotary positions, SwiGLU MLP.
    style: str = "gpt2"
    vocab_size: int = 256
    vocab_multiple: int = 128  # the table is padded to a multiple of this; tp must divide it
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 8
    n_kv_heads: int = 0  # 0: same as n_heads (MHA); 1: MQA; else GQA
    # each head's dim H (0: d_model // n_heads); q is [D, N, H] and the output
    # projection [N, H, D] whatever N * H is (Qwen3-30B-A3B: D 2048, N 32, H 128)
    d_head: int = 0
    # RMSNorm over each query and key head's H dims after the projections and
    # before RoPE, eps ln_eps, its two [H] scales replicated (Qwen3)
    qk_norm: bool = False
    d_ff: int = 512
    seq_len: int = 128
    dropout: float = 0.0  # residual and embedding dropout
    dtype: str = "float32"  # activation / matmul dtype
    param_dtype: str = "float32"
    tie_embeddings: bool = True
    use_bias: bool = True
    qkv_bias: bool = False  # biases on q, k, v alone, whatever use_bias (Qwen2's attention)
    ln_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 "llama3" rotary scaling (0: none): long wavelengths / factor, short kept
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    init_std: float = 0.02
    scan_layers: bool = False  # the blocks as one scan over layer-stacked parameters
    # what each block keeps for the backward pass: none | full | dots | minimal
    remat: str = resumable("none")
    # attention kernel (jaxtp.model.kernels): auto | xla | blockwise | cudnn; auto
    # picks cudnn on NVIDIA GPUs in bf16/fp16, else blockwise for long sequences
    attention: str = resumable("auto")
    attention_block: int = resumable(512)  # blockwise: query and key block length
    # the LM head and cross-entropy over chunks of this many tokens (per dp
    # rank), each recomputed in the backward pass, so no device holds the
    # whole [tokens, vocab/tp] fp32 logits; 0: one chunk. 4096: below it
    # llama-1b's step (tp=1, 8 x 4096, H100 compile) needs no less memory,
    # above it more (8192: +5.7 GiB, 16384: +18.5 GiB). Batches of at most
    # this many tokens per rank are not chunked.
    loss_chunk: int = resumable(4096)
    # mixture of experts (jaxtp.model.moe): each block's MLP is n_experts expert
    # MLPs of moe_d_ff (0: d_ff) hidden units, a router sending each token to
    # its top moe_top_k; 0 experts: dense MLPs
    n_experts: int = 0
    moe_top_k: int = 2
    moe_d_ff: int = 0
    moe_norm_topk: bool = True  # renormalise the top-k weights to sum to 1 (Mixtral)
    # scores: "softmax" (Mixtral, Qwen) or each expert's "sigmoid" (DeepSeek-V3);
    # experts in moe_groups groups, a token's from its best moe_group_top_k (0:
    # all; DeepSeek-V3: 8, 4); weights times moe_route_scale; past capacity drop
    # the latest in router order ("position") or the least weighted ("probs",
    # Megatron-Core's moe_token_drop_policy); jaxtp.model.moe.Routing
    moe_score: str = "softmax"
    moe_groups: int = 1
    moe_group_top_k: int = 0
    moe_route_scale: float = 1.0
    moe_drop: str = "position"
    # a shared expert: a dense MLP of this many hidden units that every token
    # takes besides its routed experts, its output added to theirs (DeepSeekMoE,
    # Dai et al. 2024, Sec. 3.2; Megatron-Core's shared_expert); 0: none; gated
    # (moe_shared_gate): times sigmoid(x @ w [D, 1]) per token (Qwen2-MoE's)
    moe_shared_d_ff: int = 0
    moe_shared_gate: bool = False
    # MoE layers: i (from 0) where (i + 1) % moe_every == 0, the others dense MLPs of
    # d_ff (Qwen-MoE's decoder_sparse_step; 2: GShard's, Switch's every other layer)
    moe_every: int = 1
    # layers 0..k-1 dense MLPs of d_ff, the MoE pattern (`moe_every`) from layer
    # k on (DeepSeek-V3's first_k_dense_replace = 3; MaxText's first_num_dense_layers)
    moe_first_dense: int = 0
    capacity_factor: float = 0.0  # slots an expert: ceil(cf * tokens * k / E) a sequence; 0: none
    # how tokens reach their experts: "dense" one-hot dispatch into capacity-sized
    # slots (every impl, every backend), or "ragged": dropless, rows sorted by expert,
    # jax.lax.ragged_all_to_all over ep and jax.lax.ragged_dot (capacity_factor 0; at
    # ep > 1 GPUs and TPUs only: XLA:CPU compiles no ragged-all-to-all, jax-ml/jax#34755)
    moe_dispatch: str = "dense"
    # at ep > 1 under remat minimal or dots: "keep" the slots ep's all-to-alls delivered
    # for the backward, or "resend" them (memory for 2 all-to-alls a layer, docs/scale.md)
    moe_slots: str = "keep"
    # balance: the loss (x moe_balance_coef) over a microbatch ("aux"), per sequence ("seq_aux")
    # or with f over the step's microbatches so far ("global_aux"); "bias": DeepSeek-V3's
    # loss-free bias on the scores, moved moe_bias_rate a step; "bias+seq_aux": both
    moe_balance: str = "aux"
    moe_balance_coef: float = 0.01
    moe_bias_rate: float = 0.001
    moe_z_coef: float = 0.001  # ST-MoE's router z-loss, added to the loss

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) is a mixture of experts (`moe_every`,
        after the `moe_first_dense`)."""
        k = self.moe_first_dense
        return self.n_experts > 0 and i >= k and (i - k + 1) % self.moe_every == 0

    @property
    def layer_group(self) -> int:
        """The layers of the stack's repeated unit: `moe_every` in a mixture
        of experts (its dense layers, then a MoE layer), else 1."""
        return self.moe_every if self.n_experts > 0 else 1

    @property
    def n_moe_layers(self) -> int:
        # (i - k + 1) % moe_every == 0 for k <= i < n_layers (a sum over the
        # layers would take minutes for a size the planner must refuse at once)
        return self.stacked_layers // self.moe_every if self.n_experts > 0 else 0

    @property
    def stacked_layers(self) -> int:
        """The layers a scanned or pipelined stack holds: all but the leading
        dense run (`moe_first_dense`, a mixture of experts'), which runs before
        it, unstacked."""
        return self.n_layers - (self.moe_first_dense if self.n_experts > 0 else 0)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = resumable(300)
    batch_size: int = 16  # global batch in sequences, split over dp
    # gradient accumulation: the batch in this many slices (jaxtp.parallel.Schedule)
    microbatches: int = resumable(1)
    # with microbatches: sum the gradients over dp once per step where the
    # layout allows it (replicated over dp, no cp, no ep: "over_dp"), else
    # (false) once per microbatch, as FSDP, cp and ep always do
    reduce_once: bool = resumable(True)
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    b1: float = 0.9
    b2: float = 0.95
    seed: int = 0
    log_every: int = resumable(10)
    eval_every: int = resumable(100)
    eval_batches: int = resumable(4)
    # every this many steps (at a logged row), print a short greedy sample
    # from a prompt of the validation text (0: off)
    sample_every: int = resumable(0)
    # faults: a step with a non-finite loss or gradient norm (or, with
    # spike_factor > 0, a loss above spike_factor x the mean of the last 20
    # applied steps) is skipped; the run stops after this many in a row
    max_skipped_steps: int = resumable(5)
    spike_factor: float = 0.0
    # checkpoints (in <out>/checkpoints), keeping the last `keep_checkpoints`: every
    # `checkpoint_every` steps and, checked at logged rows, once `checkpoint_minutes`
    # passed since the last save (0 turns either off); always at the end, at --until
    # and on SIGTERM/SIGINT (every 100 steps: 0.9% of tiny's tp=8 CPU step time)
    checkpoint_every: int = resumable(100)
    checkpoint_minutes: float = resumable(30.0)
    keep_checkpoints: int = resumable(3)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    # pipeline parallelism: the blocks split by layer over a pp axis, the
    # outermost (stages cross the slowest links); the batch runs through them
    # in train.microbatches microbatches by `pp_schedule`
    # (jaxtp.parallel.pipeline), with `pp_repeats` layer chunks per stage
    pp: int = degree()
    pp_schedule: str = resumable("gpipe")
    pp_repeats: int = resumable(1)  # (checkpoints hold the layers in model order)
    # under 1f1b and interleaved: what a stage keeps for its backward
    # (`jaxtp.checks.PP_STASHES`: the VJP's residuals, or its input alone)
    pp_stash: str = resumable("residuals")
    dp: int = degree()
    # expert parallelism: a MoE layer's experts split over an ep axis, whose
    # ranks split the batch as dp's do everywhere else (jaxtp.model.moe)
    ep: int = degree()
    tp: int = degree()
    # context parallelism: the sequence split over a cp axis for the whole
    # model (mesh (dp, cp, tp)); the attention core reaches the other ranks'
    # keys and values by `cp_attention` ("allgather": K/V all-gathered;
    # "ring": K/V chunks passed cp-1 hops); `cp_balance`: rank r holds the
    # sequence's chunks r and 2cp-1-r of 2cp, so that under the causal mask
    # every rank does the same work (jaxtp.parallel.context)
    cp: int = degree()
    cp_attention: str = resumable("allgather")
    cp_balance: bool = resumable(True)
    # "gspmd": XLA inserts collectives; "shard_map": written out; "explicit":
    # typed shardings on an Explicit mesh (reductions named by out_sharding)
    impl: str = resumable("gspmd")
    # sequence parallelism: the residual stream split over tp along T (tp > 1)
    sp: bool = resumable(False)
    # FSDP-style: also split parameters and optimizer state over dp (their
    # "embed" dim), gathered for use and reduce-scattered as gradients
    fsdp: bool = resumable(False)
    # with sp: "collective_matmul" overlaps each region's entry all-gather and
    # exit reduce-scatter with its matmuls (shard_map: ppermute rings; gspmd
    # and explicit: dots in the form XLA's windowed einsum loops, which it
    # does on a GPU client, on CPU only past 100000 MiB of operand bytes, and
    # never in a deviceless GPU compile: jaxtp.parallel.xla_overlap);
    # "collective_matmul_bidi": shard_map's rings with half of each step sent
    # each way round the ring
    overlap: str = resumable("none")

    def without_sp(self) -> "ParallelConfig":
        """This layout without sequence parallelism (and so without its overlap)."""
        return dataclasses.replace(self, sp=False, overlap="none")

    @property
    def degrees(self) -> dict[str, int]:
        """Each parallel degree by its mesh axis name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("degree")}

    @property
    def devices(self) -> int:
        """The mesh's device count: the product of the degrees."""
        return math.prod(self.degrees.values())

    @property
    def sequence_parallel(self) -> bool:
        """SP as it runs: on when asked for and there is a tp axis to split over
        (a preset asks for it at any tp)."""
        return self.sp and self.tp > 1


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def resumable_keys(cls) -> frozenset[str]:
        """The "section.key"s a resumed run may change (their fields say so:
        `resumable`, `degree`)."""
        return frozenset(f"{section.name}.{f.name}" for section in dataclasses.fields(cls)
                         for f in dataclasses.fields(section.default)
                         if f.metadata.get("resumable"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(d).__name__}")
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(sections))
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {unknown}; valid sections: {sorted(sections)}"
            )
        parts = {}
        for f in dataclasses.fields(cls):
            sub_cls = type(getattr(Config(), f.name))
            parts[f.name] = section_from_dict(sub_cls, d.get(f.name, {}), f.name)
        return cls(**parts)


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name_or_path: str = "tiny") -> Config:
    """Load a preset by name (`configs/<name>.json`) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ConfigError(
            f"config {name_or_path!r} not found (looked for {path}); "
            f"presets: {preset_names()} or a path to a .json file"
        )
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:  # a ValueError that names no file
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}): a config is a JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    try:
        return Config.from_dict(d)
    except ConfigError as e:  # what is wrong, and in which file
        raise ConfigError(f"{path}: {e}") from None


def validate(cfg: Config) -> Config:
    """Check sizes and layout; raises ConfigError naming the value and the fix
    (the rules: `jaxtp.checks`)."""
    check(cfg)
    return cfg


__all__ = ["ATTENTIONS", "CONFIG_DIR", "COORDINATOR_TIMEOUT_S", "Config", "ConfigError",
           "CP_STRATEGIES", "DTYPES", "IMPLS", "INFERENCE_IMPLS", "ModelConfig", "OVERLAPS",
           "PP_SCHEDULES", "ParallelConfig", "REMATS", "STYLES", "TrainConfig", "apply_overrides",
           "load_config", "preset_names", "validate"]
