"""Hugging Face Llama checkpoints: load at any tp, save back, fine-tune.

The checkpoint here is written by the test itself, tensor by tensor under
HF's names, and the logits are checked against a float64 numpy forward in HF's
own layout ([out, in] weights, rotate_half, repeat_kv), written here
independently of jaxtp.hf's mapping.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import train
from jaxtp.hf import load_hf, save_hf

safetensors_numpy = pytest.importorskip("safetensors.numpy")

HF = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
      "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "attention_bias": False, "mlp_bias": False}


def random_hf_tensors(hf, seed=0):
    rng = np.random.default_rng(seed)
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    H = D // hf["num_attention_heads"]
    N, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D),
         "lm_head.weight": w(V, D)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(D),
              p + "post_attention_layernorm.weight": 1 + w(D),
              p + "self_attn.q_proj.weight": w(N * H, D), p + "self_attn.k_proj.weight": w(K * H, D),
              p + "self_attn.v_proj.weight": w(K * H, D), p + "self_attn.o_proj.weight": w(D, N * H),
              p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
              p + "mlp.down_proj.weight": w(D, F)}
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


def hf_logits(t, hf, tokens):
    """Llama forward in HF layout, float64 numpy."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    D, N, K = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    H, T, eps = D // N, tokens.shape[1], hf["rms_norm_eps"]
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
        proj = lambda n, c: (h @ t[p + f"self_attn.{n}_proj.weight"].T).reshape(
            *h.shape[:2], c, H).transpose(0, 2, 1, 3)
        q, k, v = rot(proj("q", N)), rot(proj("k", K)), proj("v", K)
        k, v = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = (a / a.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], D) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        g = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ t[p + "mlp.up_proj.weight"].T)) @ \
            t[p + "mlp.down_proj.weight"].T
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
