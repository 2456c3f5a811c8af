"""The bench's peers compute the same model: the two independently written
plain steps give the same loss and gradients on the same weights, and the
tuned step's hand-written backward passes match autodiff."""

import jax
import numpy as np
import pytest

from jaxtp.bench import cpu_profile, peer, peer_alt, torch_peer
from jaxtp.config import apply_overrides, load_config, validate

CFG = validate(apply_overrides(load_config("tiny"), [
    "parallel.tp=1", "model.n_layers=2", "model.seq_len=64", "train.batch_size=2",
    "model.vocab_size=250"]))  # padded to 256: the padding logits are masked


def _tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, CFG.model.vocab_size, (2, CFG.model.seq_len + 1)).astype(np.int32)


def _as_peer(alt: dict) -> dict:
    """peer_alt's weights in peer.py's layout."""
    m = CFG.model
    N, H, D = m.n_heads, m.head_dim, m.d_model
    ln = lambda g, b: {"scale": g, "bias": b}
    layers = [{"ln1": ln(b["ln1_g"], b["ln1_b"]), "ln2": ln(b["ln2_g"], b["ln2_b"]),
               "qkv": {"w": b["w_qkv"].reshape(D, 3, N, H), "b": b["b_qkv"].reshape(3, 1, N, 1, H)},
               "out": {"w": b["w_o"].reshape(N, H, D), "b": b["b_o"]},
               "up": {"w": b["w_up"], "b": b["b_up"]}, "down": {"w": b["w_down"], "b": b["b_down"]}}
              for b in alt["blocks"]]
    return {"wte": alt["wte"], "wpe": alt["wpe"], "layers": layers,
            "ln_f": ln(alt["lnf_g"], alt["lnf_b"])}


@pytest.mark.slow
def test_the_two_plain_peers_and_the_tuned_one_agree():
    tokens = _tokens()
    alt = jax.tree.map(lambda a: a + 0.01 * np.cos(np.arange(a.size)).reshape(a.shape),
                       peer_alt.init(CFG))  # nonzero biases, scales away from 1
    f = lambda params, tuned: jax.value_and_grad(peer_alt.loss)(params, tokens, CFG, tuned)
    (plain_v, plain_g), (tuned_v, tuned_g) = f(alt, False), f(alt, True)
    peer_v, peer_g = jax.value_and_grad(peer.loss)(_as_peer(alt), tokens, CFG)
    assert np.log(CFG.model.vocab_size) * 0.9 < plain_v < np.log(CFG.model.vocab_size) * 1.2
    np.testing.assert_allclose(peer_v, plain_v, rtol=1e-6)
    np.testing.assert_allclose(tuned_v, plain_v, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(tuned_g), jax.tree.leaves(plain_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    for a, b in zip(jax.tree.leaves(peer_g), jax.tree.leaves(_as_peer(plain_g))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_cpu_profile_categories_from_compiled_hlo():
    def step(x, w):
        with jax.named_scope("mlp"):
            h = jax.nn.gelu(x @ w)
        return (h.sum() + (x * x).sum()), None

    x, w = np.ones((64, 32), np.float32), np.ones((32, 48), np.float32)
    grad = jax.jit(lambda x, w: jax.grad(lambda a, b: step(a, b)[0], argnums=(0, 1))(x, w))
    text = grad.lower(x, w).compile().as_text()
    cats = cpu_profile.categories(text)
    found = set(cats.values())
    assert "matmuls" in found and "MLP: bias, GELU" in found, cats
    assert set(cats.values()) <= set(cpu_profile.CATEGORIES)
    dots = [n for n in cats if n.startswith("dot")]
    assert all(cats[n] == "matmuls" for n in dots)


@pytest.mark.skipif(torch_peer.available() is not None, reason="torch not installed")
def test_torch_peer_trains():
    step = torch_peer.make_step(CFG)
    first = step()
    assert abs(first - np.log(CFG.model.vocab_size)) < 0.3
    for _ in range(5):
        last = step()
    assert last < first
