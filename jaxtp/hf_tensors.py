"""Hugging Face tensor names <-> jaxtp's parameters (numpy; no torch).

HF linear weights are [out, in]; jaxtp's kernels [in, out]: each is the
transpose. H is the head dim (`head_dim`, which Qwen3-MoE sets apart from
D/N), L0 = model.layers.i, B = blocks.i:

    model.embed_tokens.weight [V, D]      -> wte.embedding [V_pad, D] (rows >= V zero)
    L0.input_layernorm.weight             -> B.ln1.scale
    L0.self_attn.q_proj.weight [N*H, D]   -> B.attn.q.kernel [D, N, H]
    L0.self_attn.k_proj, v_proj [K*H, D]  -> B.attn.kv.kernel [D, 2, K, H]
    L0.self_attn.o_proj.weight [D, N*H]   -> B.attn.out.kernel [N, H, D]
    L0.self_attn.q_norm, k_norm [H]       -> B.attn.q_norm, k_norm.scale (Qwen3-MoE)
    L0.post_attention_layernorm.weight    -> B.ln2.scale
    model.norm.weight                     -> ln_f.scale
    lm_head.weight [V, D]                 -> lm_head.embedding [V_pad, D] (untied only)

The MLP of a layer, by family (`jaxtp.hf_config.family`):

    llama      L0.mlp.{gate,up}_proj [F, D]  -> B.mlp.up.kernel [D, 2, F] (gate, up)
               L0.mlp.down_proj [D, F]       -> B.mlp.down.kernel [F, D]
               (*.bias, with attention_bias / mlp_bias: the same without the transpose)
    mixtral    L0.block_sparse_moe.gate [E, D]           -> B.mlp.router [D, E]
               ...experts.j.w1, w3 [F, D] (gate, up)     -> B.mlp.experts.up [E, D, 2, F]
               ...experts.j.w2 [D, F]                    -> B.mlp.experts.down [E, F, D]
    qwen3_moe  L0.mlp.gate [E, D]                        -> B.mlp.router
               L0.mlp.experts.j.{gate,up,down}_proj      -> B.mlp.experts.up, down
    qwen2_moe  as qwen3_moe, and L0.mlp.shared_expert.*  -> B.mlp.shared (a llama MLP)
               L0.mlp.shared_expert_gate [1, D]          -> B.mlp.shared_gate [D, 1]
               L0.self_attn.{q,k,v}_proj.bias            -> B.attn.q.bias, kv.bias

(every name with `.weight`). That per-expert form is the Hub's, and what
`params_to_hf` writes. transformers 5 keeps experts fused in memory and
writes them so with `save_pretrained(save_original_format=False)`
(its conversion_mapping.py: MergeModulelist then Concatenate): for both
families L0.mlp.gate.weight, L0.mlp.experts.gate_up_proj [E, 2F, D] (gate
rows first) and L0.mlp.experts.down_proj [E, D, F]; read too.

Rotary layout: Meta's original checkpoints rotate interleaved pairs
(2i, 2i+1); `transformers`' conversion scripts permute the rows of q_proj
and k_proj so that HF checkpoints rotate the pair (i, i + H/2)
("rotate_half"). jaxtp's `rope` uses that same half layout, so q and k are
copied without any permutation.
"""

from __future__ import annotations

import jax
import numpy as np

from .config import ModelConfig
from .hf_config import family
from .model import stack_layers, unstack_layers

# a layer's per-expert (gate, up, down) names after its `experts.j.`
_EXPERT = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
           "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def _moe_prefix(kind: str, pre: str, fused: bool) -> str:
    """Where a layer's router and experts live (transformers 5's fused
    Mixtral is renamed from block_sparse_moe to mlp)."""
    return pre + ("block_sparse_moe." if kind == "mixtral" and not fused else "mlp.")


def hf_to_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """HF tensors -> the nested parameter dict of a jaxtp Transformer (numpy)."""
    D, F, kind = cfg.d_model, cfg.d_ff, family(cfg)
    used = set()

    def get(name, shape):
        if name not in tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} from "
                             "config.json")
        used.add(name)
        return _checked(name, t)

    def table(name):
        t = get(name, (cfg.vocab_size, D))
        return np.pad(t, ((0, cfg.padded_vocab - cfg.vocab_size), (0, 0)))

    def dense_mlp(m, F=F):
        mlp = {"up": {"kernel": np.stack([get(m + f"{c}_proj.weight", (F, D)).T
                                          for c in ("gate", "up")], axis=1)},
               "down": {"kernel": get(m + "down_proj.weight", (D, F)).T}}
        if cfg.use_bias:
            mlp["up"]["bias"] = np.stack([get(m + f"{c}_proj.bias", (F,))
                                          for c in ("gate", "up")])
            mlp["down"]["bias"] = get(m + "down_proj.bias", (D,))
        return mlp

    blocks = {}
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        fused = pre + "mlp.experts.gate_up_proj" in tensors
        blocks[i] = {"ln1": {"scale": get(pre + "input_layernorm.weight", (D,))},
                     "attn": _attention(get, cfg, pre + "self_attn."),
                     "ln2": {"scale": get(pre + "post_attention_layernorm.weight", (D,))},
                     "mlp": _experts_mlp(get, cfg, _moe_prefix(kind, pre, fused), fused)
                     if cfg.is_moe_layer(i) else dense_mlp(pre + "mlp.")}
        if cfg.is_moe_layer(i) and cfg.moe_shared_d_ff:  # (Qwen2-MoE's, gated)
            blocks[i]["mlp"]["shared"] = dense_mlp(pre + "mlp.shared_expert.",
                                                   cfg.moe_shared_d_ff)
            blocks[i]["mlp"]["shared_gate"] = get(pre + "mlp.shared_expert_gate.weight",
                                                  (1, D)).T
    lead = cfg.n_layers - cfg.stacked_layers  # (moe_first_dense: a list before the stack)
    params = {"wte": {"embedding": table("model.embed_tokens.weight")},
              "blocks": {i - lead: b for i, b in blocks.items() if i >= lead},
              "ln_f": {"scale": get("model.norm.weight", (D,))}}
    if lead:
        params["dense"] = {i: blocks[i] for i in range(lead)}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"embedding": table("lm_head.weight")}
    unused = sorted(set(tensors) - used - {"lm_head.weight"})
    unused = [n for n in unused if "rotary_emb.inv_freq" not in n]
    if unused:
        raise ValueError(f"checkpoint tensors not mapped to jaxtp: {unused[:5]}"
                         f"{' ...' if len(unused) > 5 else ''}")
    if cfg.scan_layers:
        params = stack_layers(params, cfg.layer_group)
    return jax.tree.map(lambda x: x.astype(np.dtype(cfg.param_dtype)), params)


def _attention(get, cfg: ModelConfig, a: str) -> dict:
    """A layer's attention weights from the tensors under prefix `a`
    (`get(name, shape)` reads one, checked)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    attn = {
        "q": {"kernel": get(a + "q_proj.weight", (N * H, D)).T.reshape(D, N, H)},
        "kv": {"kernel": np.stack([get(a + f"{c}_proj.weight", (K * H, D)).T.reshape(D, K, H)
                                   for c in "kv"], axis=1)},
        "out": {"kernel": get(a + "o_proj.weight", (D, N * H)).T.reshape(N, H, D)},
    }
    if cfg.use_bias or cfg.qkv_bias:
        attn["q"]["bias"] = get(a + "q_proj.bias", (N * H,)).reshape(N, H)
        attn["kv"]["bias"] = np.stack([get(a + f"{c}_proj.bias", (K * H,)).reshape(K, H)
                                       for c in "kv"])
    if cfg.use_bias:
        attn["out"]["bias"] = get(a + "o_proj.bias", (D,))
    if cfg.qk_norm:
        for c in "qk":
            attn[f"{c}_norm"] = {"scale": get(a + f"{c}_norm.weight", (H,))}
    return attn


def _experts_mlp(get, cfg: ModelConfig, m: str, fused: bool) -> dict:
    """A MoE layer's router and experts from the tensors under prefix `m`:
    fused [E, 2F, D] (transformers 5) or one tensor per expert."""
    E, Fe, D = cfg.n_experts, cfg.expert_d_ff, cfg.d_model
    if fused:
        up_E2FD = get(m + "experts.gate_up_proj", (E, 2 * Fe, D))
        up = up_E2FD.reshape(E, 2, Fe, D).transpose(0, 3, 1, 2)
        down = get(m + "experts.down_proj", (E, D, Fe)).transpose(0, 2, 1)
    else:
        g, u, d = _EXPERT[family(cfg)]
        e = lambda j, c, shape: get(m + f"experts.{j}.{c}.weight", shape).T
        up = np.stack([np.stack([e(j, g, (Fe, D)), e(j, u, (Fe, D))], 1) for j in range(E)])
        down = np.stack([e(j, d, (D, Fe)) for j in range(E)])
    return {"router": get(m + "gate.weight", (E, D)).T, "experts": {"up": up, "down": down}}


# the dtypes a checkpoint's weights may have (bfloat16 read through ml_dtypes;
# fp8 weights come with scale tensors jaxtp does not map)
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _checked(name: str, t) -> np.ndarray:
    """A checkpoint tensor as float32, refused (ValueError, naming it) when it
    is not a float (an integer tensor where a weight belongs is a damaged or
    quantised file, not weights) or holds a NaN or an infinity (one NaN in a
    router sends every token's output to NaN)."""
    dtype = np.dtype(t.dtype)
    if dtype.name not in _FLOATS:
        raise ValueError(f"checkpoint tensor {name} is {dtype.name}, not a floating-point "
                         f"weight of {', '.join(_FLOATS)}: a quantised or damaged checkpoint?")
    out = np.asarray(t, dtype=np.float32)
    bad = ~np.isfinite(out)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"checkpoint tensor {name} holds {int(bad.sum()):,} non-finite "
                         f"value(s) (the first, {out[where]}, at index {list(where)}): a "
                         "damaged checkpoint; fetch it again")
    return out


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of `hf_to_params` (tables unpadded; experts in the Hub's
    per-expert form)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    kind = family(cfg)
    if cfg.scan_layers:
        params = unstack_layers(params)
    p = jax.tree.map(lambda x: np.ascontiguousarray(np.asarray(x, np.float32)), params)
    lead = len(p.get("dense") or {})  # (the leading dense run, then the stack's layers)
    p["blocks"] = {**(p.get("dense") or {}), **{i + lead: b for i, b in p["blocks"].items()}}
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
        if cfg.qk_norm:
            for c in "qk":
                out[a + f"{c}_norm.weight"] = b["attn"][f"{c}_norm"]["scale"]
        if cfg.use_bias or cfg.qkv_bias:
            out[a + "q_proj.bias"] = b["attn"]["q"]["bias"].reshape(-1)
            for c, name in enumerate("kv"):
                out[a + f"{name}_proj.bias"] = b["attn"]["kv"]["bias"][c].reshape(-1)
        if cfg.use_bias:
            out[a + "o_proj.bias"] = b["attn"]["out"]["bias"]
        out.update(_experts_to_hf(b["mlp"], kind, pre) if cfg.is_moe_layer(i) else
                   _dense_to_hf(b["mlp"], m, cfg.use_bias))
        if cfg.is_moe_layer(i) and cfg.moe_shared_d_ff:
            out.update(_dense_to_hf(b["mlp"]["shared"], m + "shared_expert.", False))
            out[m + "shared_expert_gate.weight"] = b["mlp"]["shared_gate"].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _dense_to_hf(mlp: dict, m: str, bias: bool) -> dict[str, np.ndarray]:
    """One layer's SwiGLU MLP under Llama's names (after `m` = L0.mlp.)."""
    out = {m + "down_proj.weight": mlp["down"]["kernel"].T}
    for c, name in enumerate(("gate", "up")):
        out[m + f"{name}_proj.weight"] = mlp["up"]["kernel"][:, c].T
        if bias:
            out[m + f"{name}_proj.bias"] = mlp["up"]["bias"][c]
    if bias:
        out[m + "down_proj.bias"] = mlp["down"]["bias"]
    return out


def _experts_to_hf(mlp: dict, kind: str, pre: str) -> dict[str, np.ndarray]:
    """One layer's router and experts under the Hub's per-expert names."""
    m, (g, u, d) = _moe_prefix(kind, pre, False), _EXPERT[kind]
    up_EDXF, down_EFD = mlp["experts"]["up"], mlp["experts"]["down"]
    out = {m + "gate.weight": mlp["router"].T}
    for j in range(up_EDXF.shape[0]):
        e = m + f"experts.{j}."
        out[e + f"{g}.weight"] = up_EDXF[j, :, 0].T
        out[e + f"{u}.weight"] = up_EDXF[j, :, 1].T
        out[e + f"{d}.weight"] = down_EFD[j].T
    return out
