"""Hugging Face Llama, Mixtral and Qwen3-MoE checkpoints: load at any tp (and
ep), save back, fine-tune, generate.

The checkpoints here are written by the test itself, tensor by tensor under
HF's names, and the logits are checked against a float64 numpy forward in HF's
own layout ([out, in] weights, rotate_half, repeat_kv; for a mixture of
experts HF's softmax router over all experts, top-k, renormalised where the
family does, a SwiGLU per expert; Qwen3's q/k RMSNorm before RoPE), written
here from transformers' modeling files, independently of jaxtp.hf's mapping.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import train
from jaxtp.hf import load_hf, save_hf
from jaxtp.model.moe import MoE

safetensors_numpy = pytest.importorskip("safetensors.numpy")

HF = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
      "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "attention_bias": False, "mlp_bias": False}


def head_dim(hf):
    """HF's: `head_dim`, else hidden_size / num_attention_heads."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def moe_names(hf, i):
    """(router, [per expert (gate, up, down)]) of layer i, as the Hub names them."""
    if hf["model_type"] == "mixtral":
        m, (g, u, d), E = f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2"), \
            hf["num_local_experts"]
    else:
        m, (g, u, d), E = f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj"), \
            hf["num_experts"]
    return m + "gate.weight", [tuple(m + f"experts.{j}.{c}.weight" for c in (g, u, d))
                               for j in range(E)]


def dense_layer(hf, i):
    """Whether HF layer i is a dense MLP: every Llama layer; a Qwen-MoE layer
    in mlp_only_layers or unless (i + 1) % decoder_sparse_step == 0 (HF
    Qwen3MoeDecoderLayer, Qwen2MoeDecoderLayer)."""
    if hf["model_type"] == "llama":
        return True
    return hf["model_type"] != "mixtral" and (
        i in hf.get("mlp_only_layers", []) or (i + 1) % hf.get("decoder_sparse_step", 1) != 0)


def random_hf_tensors(hf, seed=0):
    rng = np.random.default_rng(seed)
    D, V = hf["hidden_size"], hf["vocab_size"]
    H, N, K = head_dim(hf), hf["num_attention_heads"], hf["num_key_value_heads"]
    w = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D),
         "lm_head.weight": w(V, D)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(D),
              p + "post_attention_layernorm.weight": 1 + w(D),
              p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
              p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H)}
        if hf["model_type"] == "qwen3_moe":
            t |= {p + "self_attn.q_norm.weight": 1 + w(H), p + "self_attn.k_norm.weight": 1 + w(H)}
        if hf["model_type"] == "qwen2_moe":  # (Qwen2MoeAttention: q, k, v with biases)
            t |= {p + "self_attn.q_proj.bias": w(N * H), p + "self_attn.k_proj.bias": w(K * H),
                  p + "self_attn.v_proj.bias": w(K * H)}
        if dense_layer(hf, i):
            F = hf["intermediate_size"]
            t |= {p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
                  p + "mlp.down_proj.weight": w(D, F)}
            continue
        F = hf.get("moe_intermediate_size", hf["intermediate_size"])
        router, experts = moe_names(hf, i)
        t[router] = w(len(experts), D)
        for g, u, d in experts:
            t |= {g: w(F, D), u: w(F, D), d: w(D, F)}
        S = hf.get("shared_expert_intermediate_size", 0)
        if S:
            sh = p + "mlp.shared_expert."
            t |= {sh + "gate_proj.weight": w(S, D), sh + "up_proj.weight": w(S, D),
                  sh + "down_proj.weight": w(D, S), p + "mlp.shared_expert_gate.weight": w(1, D)}
    return t


def write_hf(path, hf, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))


def llama3_inv_freq(inv, rope):
    """Llama 3.1 frequency scaling, per Meta's reference `apply_scaling`."""
    out = []
    for f in inv:
        wavelen = 2 * np.pi / f
        old, lo, hi = rope["original_max_position_embeddings"], rope["low_freq_factor"], \
            rope["high_freq_factor"]
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / rope["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / rope["factor"] + smooth * f)
    return np.array(out)


def swiglu(h, gate, up, down):
    """HF's MLP (LlamaMLP, each Mixtral / Qwen3-MoE expert): down(silu(gate h) * up h)."""
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def hf_moe(h, t, hf, i):
    """A sparse MoE block (HF MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock):
    softmax of the router over all E experts, the top k, renormalised for
    Mixtral and where Qwen3's norm_topk_prob, each token the weighted sum of
    its k experts. Computed densely: every expert on every token, weighted by
    zero outside its top k."""
    router, experts = moe_names(hf, i)
    k = hf["num_experts_per_tok"]
    logits = h @ t[router].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    ranked = -np.sort(-probs, axis=-1)
    # the test's data: no token's k-th and (k+1)-th experts tie within fp32
    # rounding, else jaxtp's fp32 router could pick either
    assert (ranked[..., k - 1] - ranked[..., k]).min() > 1e-6
    weights = np.take_along_axis(probs, top, -1)
    if hf["model_type"] == "mixtral" or hf.get("norm_topk_prob", False):
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e, names in enumerate(experts):
        out += (weights * (top == e)).sum(-1)[..., None] * swiglu(h, *(t[n] for n in names))
    sh = f"model.layers.{i}.mlp.shared_expert"
    if sh + "_gate.weight" in t:  # Qwen2MoeSparseMoeBlock: sigmoid(gate h) * shared(h)
        gate = 1 / (1 + np.exp(-(h @ t[sh + "_gate.weight"].T)))
        out += gate * swiglu(h, *(t[f"{sh}.{c}_proj.weight"] for c in ("gate", "up", "down")))
    return out


def hf_logits(t, hf, tokens):
    """Llama / Mixtral / Qwen3-MoE / Qwen2-MoE forward in HF layout, float64 numpy."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    N, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    H, T, eps = head_dim(hf), tokens.shape[1], hf["rms_norm_eps"]
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    rope = hf.get("rope_parameters", {})
    inv = 1.0 / rope.get("rope_theta", hf.get("rope_theta")) ** (np.arange(0, H, 2) / H)
    if rope.get("rope_type") == "llama3":
        inv = llama3_inv_freq(inv, rope)
    ang = np.concatenate([np.arange(T)[:, None] * inv] * 2, -1)
    rot = lambda x: x * np.cos(ang) + np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1) * np.sin(ang)
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        proj = lambda n, c: (h @ t[p + f"self_attn.{n}_proj.weight"].T
                             + t.get(p + f"self_attn.{n}_proj.bias", 0)).reshape(
            *h.shape[:2], c, H).transpose(0, 2, 1, 3)
        q, k, v = proj("q", N), proj("k", K), proj("v", K)
        if hf["model_type"] == "qwen3_moe":  # Qwen3MoeAttention: q_norm, k_norm, then RoPE
            q = rms(q, t[p + "self_attn.q_norm.weight"])
            k = rms(k, t[p + "self_attn.k_norm.weight"])
        q, k = rot(q), rot(k)
        k, v = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = (a / a.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], N * H) @ \
            t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (swiglu(h, *(t[p + f"mlp.{c}_proj.weight"] for c in ("gate", "up", "down")))
                 if dense_layer(hf, i) else hf_moe(h, t, hf, i))
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tensors = random_hf_tensors(HF)
    write_hf(path, HF, tensors)
    tokens = np.random.default_rng(2).integers(0, HF["vocab_size"], (2, 256)).astype(np.int32)
    return path, tensors, tokens, hf_logits(tensors, HF, tokens)


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("tp", [1, 8])
def test_load_hf_logits_match_an_hf_layout_reference(checkpoint, tp, impl):
    path, _, tokens, want = checkpoint
    model = load_hf(path, tp=tp, impl=impl)  # 2 kv heads: replicated at tp=8
    with jax.set_mesh(model.mesh):
        logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    assert logits.shape == (2, 256, HF["vocab_size"])
    # fp32 against float64 over 256 positions and 2 blocks (measured: 3.6e-6 at
    # most, on logits up to 3.8; transformers itself in fp32 is 3.1e-6 away)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


test_load_hf_logits_match_an_hf_layout_reference.fast_cases = {'8-shard_map'}


def test_save_then_load_is_identical_at_tp1_and_tp8(checkpoint, tmp_path):
    path, tensors, _, _ = checkpoint
    saved = tmp_path / "saved"
    save_hf(load_hf(path, tp=8), saved)
    assert json.loads((saved / "config.json").read_text())["num_key_value_heads"] == 2
    back = safetensors_numpy.load_file(str(saved / "model.safetensors"))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    a, b = (nnx.to_pure_dict(jax.device_get(nnx.state(load_hf(saved, tp=t), nnx.Param)))
            for t in (1, 8))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_scanned_layers_load_and_save(checkpoint, tmp_path):
    """The per-layer HF tensors stack onto the scanned layout and back."""
    path, tensors, tokens, want = checkpoint
    model = load_hf(path, tp=4, scan_layers=True)
    assert model.blocks.attn.q.kernel.shape[0] == HF["num_hidden_layers"]
    with jax.set_mesh(model.mesh):
        logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    save_hf(model, tmp_path / "saved")
    back = safetensors_numpy.load_file(str(tmp_path / "saved" / "model.safetensors"))
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_bad_checkpoints_fail_with_the_name(checkpoint, tmp_path):
    _, tensors, _, _ = checkpoint
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    write_hf(tmp_path / "a", HF, missing)
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(tmp_path / "a")
    wrong = dict(tensors, **{"model.norm.weight": np.ones(63, np.float32)})
    write_hf(tmp_path / "b", HF, wrong)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(63,\), expected \(64,\)"):
        load_hf(tmp_path / "b")
    write_hf(tmp_path / "c", dict(HF, rope_scaling={"rope_type": "yarn"}), tensors)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load_hf(tmp_path / "c")
    write_hf(tmp_path / "d", dict(HF, model_type="gpt2"), tensors)
    with pytest.raises(ValueError, match="only Llama"):
        load_hf(tmp_path / "d")
    with pytest.raises(ValueError, match="model.n_heads=8 is not divisible by tp=3"):
        load_hf(checkpoint[0], tp=3)


# transformers 5's config layout, with Llama 3.1 rope scaling whose three bands
# all occur at head dim 8: wavelengths 2*pi*500000^(i/4) = 6.3 (kept, < 200/4),
# 167 (interpolated) and 4443, 1.2e5 (divided by the factor, > 200/1)
HF_LLAMA31 = {k: v for k, v in HF.items() if k != "rope_theta"} | {"rope_parameters": {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 200}}


@pytest.mark.slow
def test_llama31_rope_scaling_and_transformers5_config(tmp_path, checkpoint):
    _, tensors, tokens, _ = checkpoint
    write_hf(tmp_path / "m", HF_LLAMA31, tensors)
    model = load_hf(tmp_path / "m", tp=8)
    assert (model.cfg.rope_theta, model.cfg.rope_scaling_factor) == (500000.0, 8.0)
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(tensors, HF_LLAMA31, tokens),
                               rtol=1e-5, atol=1e-5)
    save_hf(model, tmp_path / "back")
    assert load_hf(tmp_path / "back").cfg == model.cfg


@pytest.mark.slow
@pytest.mark.parametrize("hf", [HF, HF_LLAMA31], ids=["plain", "llama3-rope"])
def test_transformers_agrees(checkpoint, hf, tmp_path):
    """Only where torch and transformers are installed (never downloaded by CI)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, tensors, tokens, _ = checkpoint
    path = tmp_path / "m"
    write_hf(path, hf, tensors)
    ref = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(load_hf(path, tp=8)(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # measured 4.1e-6


@pytest.mark.slow
def test_transformers_generate_agrees_at_tp1_and_tp8(checkpoint, tmp_path):
    """Greedy tokens of transformers' generate (no download: the tiny random
    checkpoint of this file) against jaxtp's cache path at tp 1 and 8."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxtp.generate import Generator

    path, _, _, _ = checkpoint
    ref = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    prompt = [5, 17, 3, 99, 42]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    for tp in (1, 8):
        model = load_hf(path, tp=tp)
        assert Generator(model, model.mesh).generate([prompt], 12)[0] == want, tp


@pytest.mark.slow
def test_fine_tune_from_hf(checkpoint, tmp_path):
    """train.py --init-from-hf starts from the checkpoint: its step-1 loss is
    the loaded model's loss on the same first batch."""
    from jaxtp.train.data import Dataset
    from jaxtp.train.step import cross_entropy_of

    path, _, _, _ = checkpoint
    ids = np.random.default_rng(3).integers(0, HF["vocab_size"], 20_000).astype(np.uint16)
    data = tmp_path / "ids.bin"
    ids.tofile(data)
    out = tmp_path / "run"
    assert train.main(["--init-from-hf", str(path), "--tp", "4", "--steps", "3",
                       "--data", str(data), "--out", str(out), "model.seq_len=64",
                       "train.batch_size=4", "train.eval_batches=1", "train.log_every=1"]) == 0
    cfg = json.loads((out / "config.json").read_text())["model"]
    assert (cfg["style"], cfg["n_kv_heads"], cfg["vocab_size"], cfg["seq_len"]) == (
        "llama", 2, 100, 64)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    batch = np.asarray(next(Dataset(ids, 64, HF["vocab_size"]).train_batches(4, seed=0)))
    want = float(cross_entropy_of(load_hf(path, tp=1), batch))
    np.testing.assert_allclose(rows[0]["loss"], want, rtol=1e-5)


def test_cli_reports_a_bad_hf_directory(checkpoint, tmp_path, capsys):
    _, tensors, _, _ = checkpoint

    def refused(path, *said):
        assert train.main(["--init-from-hf", str(path), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and all(s in err for s in said), err
        assert not (tmp_path / "run").exists()

    refused(tmp_path / "nothing", "has no config.json")
    write_hf(tmp_path / "json", HF, tensors)
    (tmp_path / "json" / "config.json").write_text('{"model_type": "llama", ')
    refused(tmp_path / "json", f"{tmp_path / 'json' / 'config.json'} is not valid JSON")
    write_hf(tmp_path / "keys", {k: v for k, v in HF.items() if k != "hidden_size"}, tensors)
    refused(tmp_path / "keys", "config.json has no 'hidden_size', which a Llama config needs")
    write_hf(tmp_path / "cut", HF, tensors)
    (shard,) = (tmp_path / "cut").glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a broken download
    refused(tmp_path / "cut", f"{shard} cannot be read as safetensors", "fetch it again")


# Tiny mixtures of experts with HF's config keys. Mixtral: intermediate_size
# is each expert's; always renormalised. Qwen3-MoE: a head dim of 16 (not
# 64 / 8), q/k norms, and norm_topk_prob false (the class default; the
# published 30B-A3B sets it true, which Mixtral's case covers)
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 100,
           "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
           "sliding_window": None, "hidden_act": "silu"}
QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
             "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
             "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
             "sliding_window": None, "attention_bias": False, "router_aux_loss_coef": 0.001,
             "hidden_act": "silu"}
# Qwen2-MoE: q/k/v biases, no q/k norms, a shared expert of 48 gated by a
# sigmoid of the token, its first layer dense (mlp_only_layers [0]: jaxtp's
# moe_first_dense 1), top 3 of 8 unnormalised (as Qwen1.5-MoE-A2.7B's config)
QWEN2_MOE = {k: v for k, v in QWEN3_MOE.items() if k != "head_dim"} | {
    "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
    "num_hidden_layers": 3, "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]}
MOE = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_checkpoint(request, tmp_path_factory):
    hf = MOE[request.param]
    path = tmp_path_factory.mktemp("hf") / request.param
    tensors = random_hf_tensors(hf, seed=4)
    write_hf(path, hf, tensors)
    tokens = np.random.default_rng(5).integers(0, hf["vocab_size"], (2, 64)).astype(np.int32)
    return hf, path, tensors, tokens, hf_logits(tensors, hf, tokens)


# The keys that shape the model in the Hub's config.json of
# mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B
PUBLISHED_CONFIGS = {
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                     "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "router_aux_loss_coef": 0.02, "sliding_window": None,
                     "tie_word_embeddings": False, "hidden_act": "silu"},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                      "rope_theta": 1e6, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "router_aux_loss_coef": 0.001, "use_sliding_window": False,
                      "sliding_window": None, "attention_bias": False,
                      "tie_word_embeddings": False, "hidden_act": "silu"}}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_CONFIGS))
def test_the_moe_presets_are_their_published_configs(preset):
    """The preset's shape is what loading the published config.json gives
    (the training recipe aside: sequence length, dtypes, capacity, z-loss)."""
    from jaxtp.config import load_config
    from jaxtp.hf import model_config_from_hf

    want = model_config_from_hf(PUBLISHED_CONFIGS[preset])
    got = load_config(preset).model
    recipe = {"seq_len", "dtype", "param_dtype", "scan_layers", "remat", "capacity_factor",
              "moe_z_coef"}
    for f in dataclasses.fields(got):
        if f.name not in recipe:
            assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert (want.capacity_factor, want.moe_z_coef) == (0.0, 0.0)  # dropless, as trained


@pytest.mark.parametrize("tp, ep, impl", [(1, 1, "gspmd"), (2, 2, "gspmd"), (2, 2, "shard_map")])
def test_moe_logits_match_an_hf_layout_reference(moe_checkpoint, tp, ep, impl):
    """Loaded dropless (capacity_factor 0, as trained): fp32 against float64
    over 64 positions and 2 blocks (measured: at most 1.6e-6 (Mixtral) and
    1.7e-6 (Qwen3-MoE) off, on logits up to 3.2, in each layout)."""
    hf, path, _, tokens, want = moe_checkpoint
    model = load_hf(path, tp=tp, ep=ep, impl=impl)
    m = model.cfg
    assert (m.capacity_factor, m.n_experts, m.moe_top_k, m.qk_norm, m.head_dim) == (
        0.0, hf.get("num_local_experts", hf.get("num_experts")), hf["num_experts_per_tok"],
        hf["model_type"] == "qwen3_moe", head_dim(hf))
    with jax.set_mesh(model.mesh):
        logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


test_moe_logits_match_an_hf_layout_reference.fast_cases = {"mixtral-2-2-gspmd",
                                                           "qwen3_moe-2-2-shard_map"}


def test_moe_save_then_load_is_bit_exact(moe_checkpoint, tmp_path):
    """save_hf writes the Hub's names (one tensor per expert) and values, bit
    for bit, from a model split over tp 2 x ep 2, and a config.json that
    loads back to the same ModelConfig."""
    hf, path, tensors, _, _ = moe_checkpoint
    model = load_hf(path, tp=2, ep=2)
    saved_as(model, tmp_path / "saved", hf, tensors)
    assert load_hf(tmp_path / "saved").cfg == model.cfg


def saved_as(model, out, hf, tensors):
    """save_hf(model, out) writes exactly `tensors`, bit for bit, and a
    config.json holding `hf`'s keys and values."""
    save_hf(model, out)
    back = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in hf} == hf


def test_a_qwen3_moe_with_dense_layers_loads_and_saves(tmp_path):
    """decoder_sparse_step 2 (layer 0 a dense MLP of intermediate_size, layer 1
    MoE): loads as model.moe_every 2 to the float64 reference's logits at tp
    2 x ep 2 (shard_map), and saves back the same tensors and config."""
    hf = dict(QWEN3_MOE, decoder_sparse_step=2)
    tensors = random_hf_tensors(hf, seed=6)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    write_hf(tmp_path / "q", hf, tensors)
    tokens = np.random.default_rng(7).integers(0, hf["vocab_size"], (2, 64)).astype(np.int32)
    model = load_hf(tmp_path / "q", tp=2, ep=2, impl="shard_map")
    assert (model.cfg.moe_every, model.cfg.d_ff, model.cfg.moe_d_ff) == (2, 96, 32)
    with jax.set_mesh(model.mesh):
        logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(logits, hf_logits(tensors, hf, tokens), rtol=1e-5, atol=1e-5)
    saved_as(model, tmp_path / "saved", hf, tensors)


def fused(hf, tensors):
    """The tensors as transformers 5 keeps them in memory, and writes with
    save_pretrained(save_original_format=False) (its conversion_mapping.py:
    the per-expert [F, D] matrices stacked over E, gate's and up's
    concatenated on dim 1; Mixtral's block_sparse_moe renamed mlp)."""
    out = dict(tensors)
    for i in range(hf["num_hidden_layers"]):
        if dense_layer(hf, i):
            continue
        router, experts = moe_names(hf, i)
        m = f"model.layers.{i}.mlp."
        out[m + "gate.weight"] = out.pop(router)
        g, u, d = (np.stack([out.pop(e[c]) for e in experts]) for c in range(3))
        out[m + "experts.gate_up_proj"] = np.concatenate([g, u], axis=1)  # [E, 2F, D]
        out[m + "experts.down_proj"] = d  # [E, D, F]
    return out


def test_transformers5_fused_experts_load_as_the_hub_form(moe_checkpoint, tmp_path):
    hf, path, tensors, _, _ = moe_checkpoint
    write_hf(tmp_path / "fused", hf, fused(hf, tensors))
    a, b = (nnx.to_pure_dict(jax.device_get(nnx.state(load_hf(p), nnx.Param)))
            for p in (path, tmp_path / "fused"))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_generate_from_a_moe_checkpoint(moe_checkpoint, tmp_path, capsys):
    """The KV-cache path at tp 2 generates the float64 reference's greedy
    tokens (its whole prefix recomputed for each); generate.py --hf runs on
    the checkpoint."""
    import generate
    from faults import word_tokenizer
    from jaxtp.generate import Generator

    hf, path, tensors, _, _ = moe_checkpoint
    prompt, new = [5, 17, 3, 99, 42], 6
    want = list(prompt)
    for _ in range(new):
        logits = hf_logits(tensors, hf, np.array([want]))[0, -1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4  # no near tie for fp32 to flip
        want.append(int(logits.argmax()))
    model = load_hf(path, tp=2)
    assert Generator(model, model.mesh).generate([prompt], new)[0] == want[len(prompt):]
    # as a run trained at capacity factor 0.5 (E x ceil(0.5 x 5k / E) slots for
    # a 5-token prompt's 5k assignments: some dropped), it still decodes dropless
    short = load_hf(path, tp=2)
    short.cfg = dataclasses.replace(short.cfg, capacity_factor=0.5)
    short.set_attributes(MoE, factor=0.5)
    with jax.set_mesh(model.mesh):
        logits = [np.asarray(jax.jit(lambda m, t: m(t))(m, np.array([prompt])))
                  for m in (model, short)]
    assert np.abs(logits[0] - logits[1]).max() > 1e-3  # the training forward drops
    assert Generator(short, short.mesh).generate([prompt], new)[0] == want[len(prompt):]
    with pytest.raises(ValueError, match="generation runs at ep 1"):
        Generator(load_hf(path, tp=2, ep=2), None)
    assert generate.main(["--hf", str(path), "--tokenizer", str(word_tokenizer(
        tmp_path / "words.json")), "--prompt", "def x", "--max-new-tokens", "3",
        "--temperature", "0", "--tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("def x")


test_generate_from_a_moe_checkpoint.fast_cases = {"qwen3_moe"}


def test_moe_configs_jaxtp_cannot_run_are_refused(tmp_path):
    """One line each, naming the key: dense layers in a Qwen3-MoE, a sliding
    window shorter than the context, attention biases, a missing key; and
    save_hf refuses a mixture of experts no family matches (a top-k not
    renormalised without q/k norms; a shared expert)."""
    tensors = random_hf_tensors(QWEN3_MOE)
    for change, said in (({"mlp_only_layers": [1]}, r"layers \[1\] are dense MLPs"),
                         ({"mlp_only_layers": [0], "decoder_sparse_step": 2},
                          r"layers \[0\] are dense MLPs outside jaxtp's pattern \(a leading"),
                         ({"mlp_only_layers": [0, 1]}, r"mlp_only_layers=\[0, 1\], "
                          "num_hidden_layers=2: no layer is a mixture of experts"),
                         ({"decoder_sparse_step": 3}, "decoder_sparse_step=3, mlp_only_layers="
                          r"\[\], num_hidden_layers=2: no layer"),
                         ({"use_sliding_window": True, "sliding_window": 16},
                          "sliding_window=16 is shorter than seq_len=64"),
                         ({"attention_bias": True}, "attention_bias=true")):
        write_hf(tmp_path / "q", dict(QWEN3_MOE, **change), tensors)
        with pytest.raises(ValueError, match=said):
            load_hf(tmp_path / "q")
    write_hf(tmp_path / "w", dict(MIXTRAL, sliding_window=32), random_hf_tensors(MIXTRAL))
    with pytest.raises(ValueError, match="sliding_window=32 is shorter than seq_len=64"):
        load_hf(tmp_path / "w")
    assert load_hf(tmp_path / "w", seq_len=32).cfg.seq_len == 32  # within the window
    write_hf(tmp_path / "k", {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"},
             random_hf_tensors(MIXTRAL))
    with pytest.raises(ValueError, match="has no 'num_local_experts', which a Mixtral config"):
        load_hf(tmp_path / "k")
    model = load_hf(tmp_path / "w", seq_len=32)
    model.cfg = dataclasses.replace(model.cfg, moe_norm_topk=False)
    with pytest.raises(ValueError, match="moe_norm_topk=false"):
        save_hf(model, tmp_path / "out")
    model.cfg = dataclasses.replace(model.cfg, moe_norm_topk=True, moe_shared_d_ff=64)
    with pytest.raises(ValueError, match="only Qwen2-MoE has a shared expert .* gated, .* "
                       "model.moe_shared_d_ff=64, moe_shared_gate=False"):
        save_hf(model, tmp_path / "out")
    model.cfg = dataclasses.replace(model.cfg, moe_shared_d_ff=0, moe_first_dense=1)
    with pytest.raises(ValueError, match="moe_first_dense=1 is Qwen-MoE's mlp_only_layers"):
        save_hf(model, tmp_path / "out")
    model.cfg = dataclasses.replace(model.cfg, moe_first_dense=0, moe_score="sigmoid",
                                    moe_route_scale=2.5)
    with pytest.raises(ValueError, match="softmax over every expert, unscaled and unbiased; "
                       ".* model.moe_score='sigmoid', model.moe_route_scale=2.5"):
        save_hf(model, tmp_path / "out")
    model.cfg = dataclasses.replace(model.cfg, moe_score="softmax", moe_route_scale=1.0,
                                    moe_balance="bias")
    with pytest.raises(ValueError, match="model.moe_balance='bias' \\(a bias on the choice\\)"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MOE))
def test_transformers_agrees_on_moe(kind, tmp_path):
    """Only where torch and transformers are installed (never downloaded by
    CI): transformers' logits and greedy tokens on the tiny checkpoint equal
    jaxtp's, the logits at tp 2 x ep 2 (measured with transformers 5.25,
    torch 2.14: Mixtral 1.5e-6, Qwen3-MoE 2.2e-6 apart at most, on logits up
    to 3.2), the tokens at tp 2; transformers reads save_hf's directory to
    the same logits; jaxtp reads transformers' own save_pretrained, in the
    Hub's per-expert form and, where transformers 5 offers it, its fused
    one, to the same parameters bit for bit."""
    import inspect

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxtp.generate import Generator

    hf, path = MOE[kind], tmp_path / "m"
    write_hf(path, hf, random_hf_tensors(hf, seed=4))
    cls = {"mixtral": transformers.MixtralForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[kind]
    tokens = np.random.default_rng(5).integers(0, hf["vocab_size"], (2, 64)).astype(np.int32)
    ref = cls.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        greedy = ref.generate(torch.tensor([[5, 17, 3, 99, 42]]), max_new_tokens=6,
                              do_sample=False, pad_token_id=0)[0, 5:].tolist()
    model = load_hf(path, tp=2, ep=2)
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-5, atol=1e-5)
    small = load_hf(path, tp=2)
    assert Generator(small, small.mesh).generate([[5, 17, 3, 99, 42]], 6)[0] == greedy

    save_hf(model, tmp_path / "saved")
    with torch.no_grad():
        again = cls.from_pretrained(tmp_path / "saved", torch_dtype=torch.float32)(
            torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-5)

    params = lambda p: jax.tree.leaves(nnx.to_pure_dict(jax.device_get(nnx.state(
        load_hf(p), nnx.Param))))
    mine = params(path)
    forms = [True, False] if "save_original_format" in inspect.signature(
        ref.save_pretrained).parameters else [None]
    for original in forms:
        out = tmp_path / f"transformers-{original}"
        ref.save_pretrained(out, **({} if original is None else
                                    {"save_original_format": original}))
        names = set().union(*(safetensors_numpy.load_file(str(f))
                              for f in out.glob("*.safetensors")))
        # (the fused form on the MoE layers: Qwen2-MoE's layer 0 may be dense)
        fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
        assert fused == (original is False)
        for x, y in zip(mine, params(out)):
            np.testing.assert_array_equal(x, y)
