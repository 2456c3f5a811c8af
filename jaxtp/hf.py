"""Hugging Face Llama checkpoints <-> jaxtp (no torch needed).

`load_hf(path, tp)` reads a directory written by `transformers`'
`save_pretrained` for a Llama-architecture model (`config.json` and
`*.safetensors`, read with the `safetensors` package into numpy) and returns a
jaxtp `Transformer` sharded at that tp. `save_hf` writes one back.

Tensor mapping (HF name -> jaxtp parameter; HF linear weights are [out, in]):

    model.embed_tokens.weight [V, D]          -> wte.embedding [V_pad, D] (rows >= V zero)
    model.layers.i.input_layernorm.weight     -> blocks.i.ln1.scale
    model.layers.i.self_attn.q_proj.weight    -> blocks.i.attn.q.kernel [D, N, H] = W^T
    model.layers.i.self_attn.k_proj.weight  \\
    model.layers.i.self_attn.v_proj.weight  -> blocks.i.attn.kv.kernel [D, 2, K, H]
    model.layers.i.self_attn.o_proj.weight    -> blocks.i.attn.out.kernel [N, H, D] = W^T
    model.layers.i.post_attention_layernorm   -> blocks.i.ln2.scale
    model.layers.i.mlp.gate_proj.weight     \\
    model.layers.i.mlp.up_proj.weight       -> blocks.i.mlp.up.kernel [D, 2, F] (gate, up)
    model.layers.i.mlp.down_proj.weight       -> blocks.i.mlp.down.kernel [F, D] = W^T
    model.norm.weight                         -> ln_f.scale
    lm_head.weight [V, D]                     -> lm_head.embedding [V_pad, D] (untied only)
    (*.bias, with attention_bias / mlp_bias: the same maps without the transpose)

Rotary layout: Meta's original checkpoints rotate interleaved pairs
(2i, 2i+1); `transformers`' conversion script permutes the rows of q_proj and
k_proj so that HF checkpoints rotate the pair (i, i + H/2) ("rotate_half").
jaxtp's `rope` uses that same half layout, so q and k are copied without any
permutation. Llama 3.1's "llama3" frequency scaling is read from
`rope_scaling` (or transformers 5's `rope_parameters`); other rope types are
refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from .config import Config, ModelConfig, ParallelConfig, validate
from .model import stack_layers, unstack_layers
from .parallel import Layout
from .train.state import place_params


def _safetensors():
    try:
        from safetensors.numpy import load_file, save_file  # optional dependency ([hf])
    except ImportError:
        raise ImportError("reading Hugging Face checkpoints needs the safetensors package: "
                          "pip install -e '.[hf]' (or pip install safetensors)") from None
    return load_file, save_file


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A jaxtp ModelConfig from a Llama `config.json` dict."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type={hf.get('model_type')!r}: only Llama-architecture "
                         "checkpoints are supported")
    # transformers >= 5 writes `rope_parameters` (theta inside); older ones
    # `rope_theta` and `rope_scaling`
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (plain or llama3 RoPE only)")
    scaling = {} if kind == "default" else {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_len": int(rope["original_max_position_embeddings"])}
    bias = hf.get("attention_bias", False)
    if bias != hf.get("mlp_bias", False):
        raise ValueError("attention_bias and mlp_bias differ; jaxtp has one use_bias switch")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim", d // n) != d // n:
        raise ValueError(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    return ModelConfig(**{
        "style": "llama", "vocab_size": hf["vocab_size"], "n_layers": hf["num_hidden_layers"],
        "d_model": d, "n_heads": n, "n_kv_heads": hf.get("num_key_value_heads", n),
        "d_ff": hf["intermediate_size"], "seq_len": hf.get("max_position_embeddings", 2048),
        "tie_embeddings": hf.get("tie_word_embeddings", False), "use_bias": bias,
        "ln_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(hf.get("rope_theta", rope.get("rope_theta", 1e4))),
        **scaling, **overrides})


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    load_file, _ = _safetensors()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"{f} cannot be read as safetensors ({e}): a truncated or "
                             "damaged download? fetch it again") from None
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """HF tensors -> the nested parameter dict of a jaxtp Transformer (numpy)."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    dt = np.dtype(cfg.param_dtype)
    used = set()

    def get(name, shape):
        if name not in tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} from "
                             "config.json")
        used.add(name)
        return np.asarray(t, dtype=np.float32)

    def table(name):
        t = get(name, (cfg.vocab_size, D))
        return np.pad(t, ((0, cfg.padded_vocab - cfg.vocab_size), (0, 0)))

    blocks = {}
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        a, m = pre + "self_attn.", pre + "mlp."
        attn = {
            "q": {"kernel": get(a + "q_proj.weight", (N * H, D)).T.reshape(D, N, H)},
            "kv": {"kernel": np.stack([get(a + f"{c}_proj.weight", (K * H, D)).T.reshape(D, K, H)
                                       for c in "kv"], axis=1)},
            "out": {"kernel": get(a + "o_proj.weight", (D, N * H)).T.reshape(N, H, D)},
        }
        mlp = {"up": {"kernel": np.stack([get(m + f"{c}_proj.weight", (F, D)).T
                                          for c in ("gate", "up")], axis=1)},
               "down": {"kernel": get(m + "down_proj.weight", (D, F)).T}}
        if cfg.use_bias:
            attn["q"]["bias"] = get(a + "q_proj.bias", (N * H,)).reshape(N, H)
            attn["kv"]["bias"] = np.stack([get(a + f"{c}_proj.bias", (K * H,)).reshape(K, H)
                                           for c in "kv"])
            attn["out"]["bias"] = get(a + "o_proj.bias", (D,))
            mlp["up"]["bias"] = np.stack([get(m + f"{c}_proj.bias", (F,))
                                          for c in ("gate", "up")])
            mlp["down"]["bias"] = get(m + "down_proj.bias", (D,))
        blocks[i] = {"ln1": {"scale": get(pre + "input_layernorm.weight", (D,))},
                     "attn": attn,
                     "ln2": {"scale": get(pre + "post_attention_layernorm.weight", (D,))},
                     "mlp": mlp}
    params = {"wte": {"embedding": table("model.embed_tokens.weight")}, "blocks": blocks,
              "ln_f": {"scale": get("model.norm.weight", (D,))}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"embedding": table("lm_head.weight")}
    unused = sorted(set(tensors) - used - {"lm_head.weight"})
    unused = [n for n in unused if "rotary_emb.inv_freq" not in n]
    if unused:
        raise ValueError(f"checkpoint tensors not mapped to jaxtp: {unused[:5]}"
                         f"{' ...' if len(unused) > 5 else ''}")
    if cfg.scan_layers:

        params = stack_layers(params)
    return jax.tree.map(lambda x: x.astype(dt), params)


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of `hf_to_params` (tables unpadded)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    if cfg.scan_layers:

        params = unstack_layers(params)
    p = jax.tree.map(lambda x: np.ascontiguousarray(np.asarray(x, np.float32)), params)
    out = {"model.embed_tokens.weight": p["wte"]["embedding"][: cfg.vocab_size],
           "model.norm.weight": p["ln_f"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"]["embedding"][: cfg.vocab_size]
    for i in range(cfg.n_layers):
        b, pre = p["blocks"][i], f"model.layers.{i}."
        a, m = pre + "self_attn.", pre + "mlp."
        out[pre + "input_layernorm.weight"] = b["ln1"]["scale"]
        out[pre + "post_attention_layernorm.weight"] = b["ln2"]["scale"]
        out[a + "q_proj.weight"] = b["attn"]["q"]["kernel"].reshape(D, N * H).T
        for c, name in enumerate("kv"):
            out[a + f"{name}_proj.weight"] = b["attn"]["kv"]["kernel"][:, c].reshape(D, K * H).T
        out[a + "o_proj.weight"] = b["attn"]["out"]["kernel"].reshape(N * H, D).T
        for c, name in enumerate(("gate", "up")):
            out[m + f"{name}_proj.weight"] = b["mlp"]["up"]["kernel"][:, c].T
        out[m + "down_proj.weight"] = b["mlp"]["down"]["kernel"].T
        if cfg.use_bias:
            out[a + "q_proj.bias"] = b["attn"]["q"]["bias"].reshape(-1)
            for c, name in enumerate("kv"):
                out[a + f"{name}_proj.bias"] = b["attn"]["kv"]["bias"][c].reshape(-1)
            out[a + "o_proj.bias"] = b["attn"]["out"]["bias"]
            for c, name in enumerate(("gate", "up")):
                out[m + f"{name}_proj.bias"] = b["mlp"]["up"]["bias"][c]
            out[m + "down_proj.bias"] = b["mlp"]["down"]["bias"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.ln_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if not cfg.rope_scaling_factor else {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.use_bias,
        "mlp_bias": cfg.use_bias, "hidden_act": "silu", "torch_dtype": "float32",
    }


def hf_model_config(path: str | Path, **overrides) -> ModelConfig:
    """The jaxtp ModelConfig of a Hugging Face Llama directory."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a save_pretrained "
                                "directory)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(hf).__name__}")
    try:
        return model_config_from_hf(hf, **overrides)
    except KeyError as e:
        raise ValueError(f"{file} has no {e.args[0]!r}, which a Llama config needs") from None


def read_hf(path: str | Path, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, nested parameter dict) from a Hugging Face Llama directory.

    `overrides` may change fields that do not touch the tensors' shapes
    (seq_len, dtype, ...); shape-changing ones fail on the first tensor.
    """
    cfg = hf_model_config(path, **overrides)
    return cfg, hf_to_params(_read_tensors(Path(path)), cfg)


def load_hf(path: str | Path, tp: int = 1, impl: str = "gspmd", **overrides):
    """A jaxtp Transformer holding the checkpoint at `path`, sharded over a
    (1, tp) mesh (kept as `model.mesh`). `model(tokens [B, T] int32)` ->
    logits [B, T, vocab_size]. Under jit with impl="shard_map" or "explicit",
    call it inside `with jax.set_mesh(model.mesh):` (both need the mesh while
    tracing; explicit's has Explicit axes).
    """

    model_cfg, values = read_hf(path, **overrides)
    cfg = validate(Config(model=model_cfg, parallel=ParallelConfig(tp=tp, impl=impl)))
    mesh = Layout.of(cfg).mesh()
    graphdef, params, _ = place_params(cfg, mesh, values)
    model = nnx.merge(graphdef, params)
    model.mesh = mesh
    return model


def save_hf(model, path: str | Path) -> None:
    """Write a jaxtp Llama-style Transformer as config.json + model.safetensors."""
    cfg: ModelConfig = model.cfg
    if cfg.style != "llama":
        raise ValueError("save_hf writes Llama-architecture checkpoints; this model is "
                         f"style={cfg.style!r}")
    _, save_file = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = nnx.to_pure_dict(jax.device_get(nnx.state(model, nnx.Param)))
    save_file(params_to_hf(values, cfg), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
