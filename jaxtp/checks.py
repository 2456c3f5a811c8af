"""The rules a config must keep: the choices each key may take, and checks
whose every failure is a ConfigError that names the value and the fix
(`jaxtp.config.validate` applies them before anything is compiled). It
imports nothing of `jaxtp.config`, which re-exports the choices."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .axes import BATCH, CP_AXIS, EP_AXIS, PP_AXIS
from .axis_checks import CHECKS
from .cli import FLAG_KEYS
from .moe_checks import (MOE_BALANCES, MOE_DISPATCHES, MOE_DROPS, MOE_KEYS, MOE_SCORES,
                         MOE_SLOTS, layers_error, layout_error, routing_error)

if TYPE_CHECKING:  # annotations only: jaxtp.config imports this module
    from .config import Config, ModelConfig

# float64: a verification mode (model.dtype and param_dtype both, under
# jax_enable_x64; train.py --float64), where rounding no longer hides whether
# two layouts compute one function
DTYPES = ("float32", "bfloat16", "float16", "float64")
# how the tp collectives are placed (jaxtp.parallel.locals): by GSPMD from
# sharding constraints, written out in shard_map, or by JAX's sharding-in-types
# on a mesh of Explicit axes
IMPLS = ("gspmd", "shard_map", "explicit")
# generation's KV-cache regions exist for these two; a run trained under
# explicit generates under gspmd (the same parameters)
INFERENCE_IMPLS = ("gspmd", "shard_map")
# how SP's all-gathers and reduce-scatters meet the matmuls they feed
# (jaxtp.parallel.overlap): one collective each, or collective-matmul rings
OVERLAPS = ("none", "collective_matmul", "collective_matmul_bidi")
STYLES = ("gpt2", "llama")
REMATS = ("none", "full", "dots", "minimal")  # jaxtp.model.block.REMAT_POLICIES
ATTENTIONS = ("auto", "xla", "blockwise", "cudnn")  # jaxtp.model.kernels (auto: per device)
# how the attention core reaches the other cp ranks' keys and values
# (jaxtp.parallel.context); the parallel package holds the same names
CP_STRATEGIES = ("allgather", "ring")
# how the pipeline stages run their microbatches (jaxtp.parallel.pipeline)
PP_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb")
# those that run a stage's forward and backward apart, with the head, in one
# table (`jaxtp.parallel.pipeline_1f1b`), and what they keep for a backward:
# its VJP's residuals (GPipe's FLOPs), or the stage's input (the forward again)
ONE_F_ONE_B, PP_STASHES = ("1f1b", "interleaved", "zb"), ("residuals", "inputs")
# those whose backward runs as the input's gradient, then the weights' (zero-bubble)
SPLIT = ("zb",)
# how long a multi-process start waits for every process (jaxtp.parallel.distributed)
COORDINATOR_TIMEOUT_S = 300


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or inconsistent."""


def _axis(name: str, cfg: Config) -> None:
    """Raise axis `name`'s own check's error (`jaxtp.axis_checks`), if any."""
    error = CHECKS[name](cfg)
    if error:
        raise ConfigError(error)


def check(cfg: Config) -> None:
    """Check sizes and layout; raises ConfigError naming the value and the fix."""
    _check_ranges(cfg)
    _check_choices(cfg)
    _check_shapes(cfg.model)
    _check_moe(cfg)  # (first: the layout's batch checks count ep's ranks)
    _check_layout(cfg)


def _check_moe(cfg: Config) -> None:
    """What the mixture of experts (`jaxtp.model.moe`) needs, and what it is
    not built with yet."""
    m, p = cfg.model, cfg.parallel
    if not m.n_experts:
        if p.ep > 1:
            raise ConfigError(f"--ep {p.ep} splits a mixture of experts, and model.n_experts=0 "
                              "has none: set model.n_experts (e.g. --config moe-tiny), or "
                              "use --dp for data parallelism")
        return
    if m.n_experts % p.ep:
        ok = [e for e in range(1, m.n_experts + 1) if m.n_experts % e == 0]
        raise ConfigError(f"model.n_experts={m.n_experts} is not divisible by ep={p.ep}: each "
                          f"ep rank holds n_experts/ep experts; valid --ep: {ok}")
    split = math.prod(p.degrees[a] for a in BATCH)  # (pp, dp, ep: the axis table)
    if cfg.train.batch_size % split:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by "
                          f"dp*ep={p.dp}*{p.ep}: ep's ranks split the batch as dp's do; set "
                          f"train.batch_size to a multiple of {split}")
    for error in (routing_error(m), layout_error(m, p), layers_error(m, p.pp)):
        if error:
            raise ConfigError(error)
    _divisible("model.moe_d_ff (0: model.d_ff)", m.expert_d_ff, cfg)
    _divisible("model.moe_shared_d_ff", m.moe_shared_d_ff, cfg)
    _axis(EP_AXIS, cfg)


# the command-line flag of a key, where train.py has one
_FLAGS = {key: "--" + dest.replace("_", "-") for dest, key in FLAG_KEYS.items()}


def check_asked(cfg: Config, asked) -> Config:
    """`cfg` if what a command line set itself (`asked`: its "section.key"s,
    from flags and overrides) has an effect in it, else a ConfigError: a key
    asked for a value other than its default where what it acts on is absent
    (a pipeline schedule without --pp, a capacity factor without experts).
    Not part of `check`: a stored config cannot tell a value asked for from
    one kept (a run trained at cp=4 with ring and resumed at --cp 1 keeps
    ring, which then does nothing, as allgather, the default, would not)."""
    p, m = cfg.parallel, cfg.model
    idle = [("parallel.cp_attention", p.cp == 1, "passes K/V chunks between the cp ranks, and "
             "parallel.cp=1 has none", "add --cp N (N > 1) to split the sequence over N "
             "devices, or drop --cp-attention"),
            ("parallel.cp_balance", p.cp == 1, "orders the sequence's chunks over the cp "
             "ranks, and parallel.cp=1 has none", "add --cp N (N > 1), or drop it"),
            ("parallel.pp_schedule", p.pp == 1, "orders a pipeline's microbatches, and "
             "parallel.pp=1 has no stages", "add --pp N (N > 1), or drop --pp-schedule")]
    idle += [(f"model.{k}", not m.n_experts, "acts on a mixture of experts, and "
              "model.n_experts=0 has none", "use a MoE config (--config moe-tiny) or set "
              "model.n_experts, or drop it") for k in MOE_KEYS]
    for key, absent, why, fix in idle:
        section, name = key.split(".")
        part = getattr(cfg, section)
        value = getattr(part, name)
        default = next(f.default for f in dataclasses.fields(part) if f.name == name)
        if key in asked and absent and value != default:
            flag = f" ({_FLAGS[key]} {value})" if key in _FLAGS else ""
            raise ConfigError(f"{key}={value!r}{flag} {why}: {fix}")
    return cfg


_offering = False  # while _valid_tps tries degrees: their refusals offer none (no recursion)


def _valid_tps(cfg: Config, most: int = 64) -> list[int]:
    """The tp degrees up to `most` at which `cfg` passes every check: what a
    refusal offers, never a degree that the next check refuses."""
    global _offering
    if _offering:
        return []
    _offering, ok = True, []
    try:
        for tp in range(1, most + 1):
            try:
                check(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp)))
                ok.append(tp)
            except ConfigError:
                pass
    finally:
        _offering = False
    return ok


def _divisible(name: str, value: int, cfg: Config) -> None:
    tp = cfg.parallel.tp
    if value % tp:
        raise ConfigError(
            f"{name}={value} is not divisible by tp={tp}; choose --tp from {_valid_tps(cfg)} "
            f"or set {name} to a multiple of {tp}"
        )


# the largest size a config may give: the step, batch and layer counters of
# the compiled programs are int32 (a larger value overflows there, or makes a
# program no accelerator holds: `jaxtp.sizes` refuses those by memory)
MAX_SIZE = 2**31 - 1
# sizes (ints >= 1), counts that may be 0 (ints >= 0), positive reals, and
# coefficients and factors (finite reals >= 0), by "section.key"
_SIZES = {"model": ("vocab_size", "vocab_multiple", "n_layers", "d_model", "n_heads", "d_ff",
                    "seq_len", "attention_block", "rope_original_max_len", "moe_every",
                    "moe_groups"),
          "train": ("steps", "batch_size", "microbatches", "log_every", "eval_every",
                    "eval_batches", "max_skipped_steps", "keep_checkpoints"),
          "parallel": ("pp", "pp_repeats", "dp", "ep", "tp", "cp")}
# (moe_top_k: 1 to n_experts with experts, `_check_moe`; any count without)
_COUNTS = {"model": ("n_kv_heads", "d_head", "loss_chunk", "n_experts", "moe_top_k",
                     "moe_d_ff", "moe_shared_d_ff", "moe_first_dense", "moe_group_top_k"),
           "train": ("warmup_steps", "checkpoint_every", "sample_every")}
_POSITIVE = {"model": ("ln_eps", "rope_theta", "init_std", "moe_route_scale"),
             "train": ("lr",)}
_FINITE = {"model": ("capacity_factor", "moe_balance_coef", "moe_bias_rate", "moe_z_coef",
                     "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"),
           "train": ("weight_decay", "grad_clip", "spike_factor", "checkpoint_minutes")}
_WHAT_ZERO = {"model.n_kv_heads": "0: n_heads", "model.d_head": "0: d_model // n_heads",
              "model.loss_chunk": "0: no chunking", "model.n_experts": "0: dense MLPs",
              "model.moe_d_ff": "0: model.d_ff", "model.moe_shared_d_ff": "0: no shared expert",
              "model.capacity_factor": "0: dropless", "model.rope_scaling_factor": "0: off",
              "model.moe_group_top_k": "0: every group",
              "train.checkpoint_every": "0: never", "train.sample_every": "0: off",
              "train.checkpoint_minutes": "0: never", "train.grad_clip": "0: off",
              "train.spike_factor": "0: off"}


def _keys(table: dict, cfg: Config):
    for section, names in table.items():
        for name in names:
            yield f"{section}.{name}", getattr(getattr(cfg, section), name)


def _check_ranges(cfg: Config) -> None:
    """Every number in its range before anything is built: sizes positive and
    at most MAX_SIZE, counts >= 0, coefficients and factors finite and >= 0."""
    m, t = cfg.model, cfg.train
    zero = lambda k: f" ({_WHAT_ZERO[k]})" if k in _WHAT_ZERO else ""
    for k, v in _keys(_SIZES, cfg):
        if not v > 0:
            raise ConfigError(f"{k}={v} must be positive")
    for k, v in _keys(_COUNTS, cfg):
        if not v >= 0:
            raise ConfigError(f"{k}={v} must be >= 0{zero(k)}")
    for k, v in [*_keys(_SIZES, cfg), *_keys(_COUNTS, cfg)]:
        if v > MAX_SIZE:
            raise ConfigError(f"{k}={v} is past the largest size jaxtp takes, 2**31 - 1 "
                              "(token ids, positions and step counters are int32)")
    for k, v in _keys(_POSITIVE, cfg):
        if not 0 < v < math.inf:
            raise ConfigError(f"{k}={v} must be positive and finite")
    for k, v in _keys(_FINITE, cfg):
        if not 0 <= v < math.inf:
            raise ConfigError(f"{k}={v} must be finite and >= 0{zero(k)}")
    for k in ("b1", "b2"):
        if not 0 <= getattr(t, k) < 1:
            raise ConfigError(f"train.{k}={getattr(t, k)} must be in [0, 1)")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if not 0 <= t.seed < 2**63:  # (numpy's generators take no negative seed, JAX's keys int64)
        raise ConfigError(f"train.seed={t.seed} must be in [0, 2**63)")


def _check_choices(cfg: Config) -> None:
    m = cfg.model
    for name, value, choices in (("model.dtype", m.dtype, DTYPES),
                                 ("model.param_dtype", m.param_dtype, DTYPES),
                                 ("model.remat", m.remat, REMATS),
                                 ("model.attention", m.attention, ATTENTIONS),
                                 ("model.style", m.style, STYLES),
                                 ("model.moe_dispatch", m.moe_dispatch, MOE_DISPATCHES),
                                 ("model.moe_score", m.moe_score, MOE_SCORES),
                                 ("model.moe_drop", m.moe_drop, MOE_DROPS),
                                 ("model.moe_balance", m.moe_balance, MOE_BALANCES),
                                 ("model.moe_slots", m.moe_slots, MOE_SLOTS),
                                 ("parallel.impl", cfg.parallel.impl, IMPLS),
                                 ("parallel.overlap", cfg.parallel.overlap, OVERLAPS),
                                 ("parallel.cp_attention", cfg.parallel.cp_attention,
                                  CP_STRATEGIES),
                                 ("parallel.pp_schedule", cfg.parallel.pp_schedule,
                                  PP_SCHEDULES),
                                 ("parallel.pp_stash", cfg.parallel.pp_stash, PP_STASHES)):
        if value not in choices:
            raise ConfigError(f"{name}={value!r}; choose one of {choices}")
    if "float64" in (m.dtype, m.param_dtype) and m.dtype != m.param_dtype:
        raise ConfigError(f"model.dtype={m.dtype!r} with model.param_dtype={m.param_dtype!r}: "
                          "float64 is a verification mode of both, not a mixed precision; "
                          "set both to float64 (--float64), or neither")


def _check_shapes(m: ModelConfig) -> None:
    if not m.d_head and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}: set "
            "model.d_head to the head dim, or d_model to a multiple of n_heads"
        )
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads="
                          f"{m.n_heads} (0 means n_kv_heads = n_heads)")
    if (m.rope_scaling_factor and not (
            0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_max_len > 0)):
        raise ConfigError("llama3 rope scaling needs rope_scaling_factor > 0, 0 < "
                          "rope_low_freq_factor < rope_high_freq_factor and "
                          "rope_original_max_len > 0 (rope_scaling_factor=0 turns it off)")
    if m.style == "llama" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dim, got {m.head_dim} "
                          "(model.d_head, 0: d_model/n_heads)")


def _check_layout(cfg: Config) -> None:
    """What the (dp, cp, tp) mesh must divide."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    _divisible("model.n_heads", m.n_heads, cfg)
    _divisible("model.d_ff", m.d_ff, cfg)
    k = m.kv_heads
    if k % p.tp and p.tp % k:
        ok = _valid_tps(cfg)
        raise ConfigError(
            f"model.n_kv_heads={k} and tp={p.tp}: tp must divide the kv heads (each rank "
            f"holds its own) or be a multiple of them (each kv head replicated on "
            f"tp/n_kv_heads ranks); valid --tp: {ok}")
    if m.padded_vocab % p.tp:
        raise ConfigError(
            f"the vocabulary is padded to {m.padded_vocab} (model.vocab_multiple="
            f"{m.vocab_multiple}), which tp={p.tp} does not divide; set "
            f"model.vocab_multiple to a multiple of {p.tp}")
    if p.overlap != "none" and not p.sp:
        raise ConfigError(
            f"parallel.overlap={p.overlap!r} overlaps sequence parallelism's all-gathers and "
            "reduce-scatters with their matmuls; it is built for SP only (a region's one "
            "all-reduce is not decomposed): add --sp, or --overlap none")
    if p.sp and m.seq_len % p.tp:
        raise ConfigError(f"sequence parallelism splits model.seq_len={m.seq_len} over "
                          f"tp={p.tp}; set model.seq_len to a multiple of {p.tp}")
    if p.overlap == "collective_matmul_bidi" and p.impl != "shard_map":
        raise ConfigError(f"parallel.overlap='collective_matmul_bidi' is shard_map's "
                          f"bidirectional rings; under impl={p.impl} XLA chooses the form of "
                          "its windowed loops: use --overlap collective_matmul")
    if p.overlap == "collective_matmul_bidi" and p.sp and m.seq_len % (2 * p.tp):
        raise ConfigError(f"the bidirectional rings send halves of each rank's "
                          f"model.seq_len/tp = {m.seq_len}/{p.tp} positions both ways; set "
                          f"model.seq_len to a multiple of {2 * p.tp}")
    _axis(PP_AXIS, cfg)
    # a pipeline: each stage's B/(pp*dp) rows outside it, M microbatches of the
    # dp rank's B/dp rows in it (`jaxtp.parallel.pipeline`); ep's ranks split
    # the batch as dp's
    d, name, val = (p.dp * p.ep, "dp*ep", f"{p.dp}*{p.ep}") if p.ep > 1 else \
        (p.dp, "dp", f"{p.dp}")
    need = math.lcm(p.pp * d, d * t.microbatches)
    if t.batch_size % need:
        what = (f"pp*{name}={p.pp}*{val} (each stage's rows) and by {name}*microbatches="
                f"{val}*{t.microbatches}" if p.pp > 1 else
                f"{name}*microbatches={val}*{t.microbatches}")
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by {what}; set "
                          f"train.batch_size to a multiple of {need}")
    _axis(CP_AXIS, cfg)
    if p.fsdp and m.d_model % p.dp:
        raise ConfigError(f"parallel.fsdp splits model.d_model={m.d_model} over dp={p.dp}; "
                          f"choose a dp that divides it")
