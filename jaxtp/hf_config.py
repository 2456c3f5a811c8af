"""Hugging Face `config.json` <-> jaxtp ModelConfig, for four architectures.

    "llama"      LlamaForCausalLM     dense SwiGLU MLPs
    "mixtral"    MixtralForCausalLM   every MLP a mixture of experts, top-k renormalised
    "qwen3_moe"  Qwen3MoeForCausalLM  the same (renormalised where norm_topk_prob), plus
                                      per-head q/k RMSNorm and an explicit head_dim
    "qwen2_moe"  Qwen2MoeForCausalLM  q/k/v biases, no q/k norms, a shared expert gated
                                      by a sigmoid of the token; norm_topk_prob as Qwen3

Keys as transformers' `LlamaConfig`, `MixtralConfig`, `Qwen3MoeConfig` and
`Qwen2MoeConfig` (transformers 4.51 to 5.x) read them. The MoE ones route as
Mixtral: a softmax over all experts, the top k, renormalised when asked (HF
`MixtralTopKRouter`, `Qwen3MoeTopKRouter`); they were trained dropless, so a
loaded mixture of experts is dropless too (capacity_factor 0). HF has no
router z-loss (moe_z_coef 0); `router_aux_loss_coef` becomes moe_balance_coef
as it is (HF's balance loss is k x jaxtp's per layer, over all layers'
tokens at once; jaxtp sums its per layer, 1 when uniform, over the layers).
Qwen's `mlp_only_layers` is jaxtp's moe_first_dense where it is a leading
run at decoder_sparse_step 1 (else refused).
"""

from __future__ import annotations

from .config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
NAMES = {"llama": "Llama", "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE",
         "qwen2_moe": "Qwen2-MoE"}


def family(cfg: ModelConfig) -> str:
    """The HF model_type that writes `cfg`: llama (dense), qwen3_moe (experts
    and q/k norms), mixtral (experts, renormalised top-k); else ValueError."""
    if cfg.style != "llama":
        raise ValueError(f"Hugging Face checkpoints are Llama-architecture; this model is "
                         f"style={cfg.style!r}")
    if not cfg.n_experts:
        if cfg.qk_norm:
            raise ValueError("a dense model with model.qk_norm is Qwen3's, which save_hf does "
                             "not write (Llama, Mixtral, Qwen3-MoE)")
        return "llama"
    if cfg.use_bias:
        raise ValueError("Mixtral and Qwen-MoE have no biases but Qwen2's q, k, v; this "
                         "mixture of experts has model.use_bias=true")
    qwen2 = (cfg.qkv_bias, bool(cfg.moe_shared_d_ff), cfg.moe_shared_gate, not cfg.qk_norm)
    if any(qwen2[:3]) and not all(qwen2):
        raise ValueError("only Qwen2-MoE has a shared expert (and q, k, v biases): gated, "
                         "with those biases and no q/k norms; this mixture of experts has "
                         f"model.moe_shared_d_ff={cfg.moe_shared_d_ff}, moe_shared_gate="
                         f"{cfg.moe_shared_gate}, qkv_bias={cfg.qkv_bias}, "
                         f"qk_norm={cfg.qk_norm}")
    routing = {"moe_score": "softmax", "moe_group_top_k": 0, "moe_route_scale": 1.0}
    odd = [f"model.{k}={getattr(cfg, k)!r}" for k, v in routing.items() if getattr(cfg, k) != v]
    if cfg.moe_balance.startswith("bias"):
        odd.append(f"model.moe_balance={cfg.moe_balance!r} (a bias on the choice)")
    if odd:
        raise ValueError("Mixtral and Qwen-MoE route by a softmax over every expert, "
                         f"unscaled and unbiased; this mixture of experts has {', '.join(odd)}")
    if cfg.moe_first_dense and (cfg.moe_every > 1 or not (all(qwen2) or cfg.qk_norm)):
        raise ValueError(f"model.moe_first_dense={cfg.moe_first_dense} is Qwen-MoE's "
                         "mlp_only_layers, which keeps decoder_sparse_step's count from layer "
                         f"0: not with model.moe_every={cfg.moe_every}, nor in Mixtral")
    if all(qwen2):
        return "qwen2_moe"
    if cfg.qk_norm:
        return "qwen3_moe"
    if cfg.moe_every > 1:
        raise ValueError(f"a mixture of experts without model.qk_norm is Mixtral's, whose "
                         f"every layer is MoE: this one has model.moe_every={cfg.moe_every}")
    if not cfg.moe_norm_topk:
        raise ValueError("a mixture of experts without model.qk_norm is Mixtral's, which "
                         "renormalises its top-k: this one has model.moe_norm_topk=false")
    return "mixtral"


def _rope(hf: dict) -> dict:
    """rope_theta and Llama 3.1 scaling; transformers >= 5 writes
    `rope_parameters` (theta inside), older ones `rope_theta` and `rope_scaling`."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (plain or llama3 RoPE only)")
    scaling = {} if kind == "default" else {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_len": int(rope["original_max_position_embeddings"])}
    return {"rope_theta": float(hf.get("rope_theta", rope.get("rope_theta", 1e4))), **scaling}


def _attention(hf: dict) -> dict:
    """The fields every family shares: sizes, norms, RoPE, a head dim apart
    from hidden_size / num_attention_heads where `head_dim` says so."""
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: jaxtp's SwiGLU uses silu")
    return {"style": "llama", "vocab_size": hf["vocab_size"],
            "n_layers": hf["num_hidden_layers"], "d_model": d, "n_heads": n,
            "n_kv_heads": hf.get("num_key_value_heads", n),
            "d_head": 0 if d % n == 0 and head_dim == d // n else head_dim,
            "seq_len": hf.get("max_position_embeddings", 2048),
            "tie_embeddings": hf.get("tie_word_embeddings", False),
            "ln_eps": hf.get("rms_norm_eps", 1e-6), **_rope(hf)}


def _llama(hf: dict) -> dict:
    bias = hf.get("attention_bias", False)
    if bias != hf.get("mlp_bias", False):
        raise ValueError("attention_bias and mlp_bias differ; jaxtp has one use_bias switch")
    return {"d_ff": hf["intermediate_size"], "use_bias": bias}


def _experts(hf: dict, key: str) -> int:
    """The config's experts per layer (`key`), refused unless a positive int."""
    experts = hf[key]  # (a missing key: hf_model_config names it)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{key}={experts!r}: a {NAMES[hf['model_type']]} config names its "
                         "experts per layer, a positive integer (a dense checkpoint is "
                         "model_type llama)")
    return experts


def _moe(hf: dict, experts: int, d_ff: int, expert_d_ff: int, norm_topk: bool,
         key: str = "num_local_experts") -> dict:
    k = hf["num_experts_per_tok"]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"num_experts_per_tok={k!r} must be an integer between 1 and "
                         f"{key}={experts}")
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias=true: jaxtp's mixture-of-experts checkpoints have no "
                         "attention biases (none of Mixtral's or Qwen3-MoE's has)")
    return {"d_ff": d_ff, "use_bias": False, "n_experts": experts,
            "moe_top_k": hf["num_experts_per_tok"], "moe_d_ff": expert_d_ff,
            "moe_norm_topk": norm_topk, "capacity_factor": 0.0,
            "moe_balance_coef": float(hf.get("router_aux_loss_coef", 0.001)),
            "moe_z_coef": 0.0}


def _mixtral(hf: dict) -> dict:
    # intermediate_size is each expert's hidden size (HF MixtralExperts)
    return _moe(hf, _experts(hf, "num_local_experts"), hf["intermediate_size"],
                hf["intermediate_size"], True)


def _qwen_moe(hf: dict) -> dict:
    # Hub configs say num_experts; transformers 5 writes num_local_experts
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    experts = _experts(hf, key)
    layers = hf["num_hidden_layers"]
    # HF Qwen2/3MoeDecoderLayer: layer i is MoE iff i is not in mlp_only_layers
    # and (i + 1) % decoder_sparse_step == 0: jaxtp's moe_every, or with a
    # leading run of mlp_only_layers at step 1 its moe_first_dense
    step, only = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} must be a positive integer")
    lead = len(only) if only == list(range(len(only))) and step == 1 else 0
    dense = [i for i in range(layers) if i in only][:0 if lead else None]
    if dense:
        raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={only}, num_experts="
                         f"{experts}: layers {dense[:6]}{' ...' if len(dense) > 6 else ''} "
                         "are dense MLPs outside jaxtp's pattern (a leading run at step 1, "
                         "model.moe_first_dense; then every model.moe_every-th layer)")
    if step > layers or lead >= layers:
        raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={only}, "
                         f"num_hidden_layers={layers}: no layer is a mixture of experts")
    qwen2 = hf["model_type"] == "qwen2_moe"
    shared = hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0
    return {"qk_norm": not qwen2, "qkv_bias": qwen2, "moe_every": step,
            "moe_first_dense": lead, "moe_shared_d_ff": shared, "moe_shared_gate": bool(shared),
            **_moe(hf, experts, hf.get("intermediate_size", 0) or hf["moe_intermediate_size"],
                   hf["moe_intermediate_size"], hf.get("norm_topk_prob", False), key)}


_FAMILIES = {"llama": _llama, "mixtral": _mixtral, "qwen3_moe": _qwen_moe, "qwen2_moe": _qwen_moe}


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A jaxtp ModelConfig from a Llama, Mixtral or Qwen3-MoE `config.json` dict."""
    kind = hf.get("model_type")
    if kind not in _FAMILIES:
        raise ValueError(f"model_type={kind!r}: only Llama-architecture checkpoints are "
                         f"supported ({', '.join(_FAMILIES)})")
    cfg = ModelConfig(**{**_attention(hf), **_FAMILIES[kind](hf), **overrides})
    # Mixtral always slides when a window is set; Qwen3 where use_sliding_window
    window = hf.get("sliding_window") if kind == "mixtral" or hf.get("use_sliding_window") \
        else None
    if window and window < cfg.seq_len:
        raise ValueError(f"sliding_window={window} is shorter than seq_len={cfg.seq_len}: "
                         f"jaxtp attends over the whole context; load with seq_len={window} "
                         "or less")
    return cfg


def hf_config(cfg: ModelConfig) -> dict:
    """The `config.json` of `cfg` that transformers' config class of its
    family (`family`) reads."""
    kind = family(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.expert_d_ff if kind == "mixtral" else cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.ln_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if not cfg.rope_scaling_factor else {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.use_bias,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    if kind == "llama":
        return {**out, "mlp_bias": cfg.use_bias}
    moe = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_balance_coef,
           "sliding_window": None}
    if kind == "mixtral":  # (MixtralConfig has no attention_bias: always without)
        del out["attention_bias"]
        return {**out, **moe, "num_local_experts": cfg.n_experts}
    qwen2 = {"shared_expert_intermediate_size": cfg.moe_shared_d_ff} if kind == "qwen2_moe" \
        else {}
    return {**out, **moe, **qwen2, "num_experts": cfg.n_experts,
            "moe_intermediate_size": cfg.expert_d_ff, "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": list(range(cfg.moe_first_dense)), "use_sliding_window": False}
