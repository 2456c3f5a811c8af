"""The ledger against jax.experimental.roofline, an independent reader of
the shard_map step's jaxpr: per mesh axis, every byte either agrees or is
one of the named differences (jaxtp.analysis.roofline)."""

import dataclasses

import pytest

from jaxtp.analysis.roofline import crosscheck, unsupported
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.parallel import make_mesh

MODEL = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16)
LLAMA = ModelConfig(style="llama", vocab_size=61, n_layers=2, d_model=64, n_heads=8,
                    n_kv_heads=2, d_ff=64, seq_len=16, tie_embeddings=False, use_bias=False)


def cfg_of(model, dp, tp, **par):
    return Config(model, TrainConfig(batch_size=8), ParallelConfig(dp=dp, tp=tp, **par))


@pytest.mark.parametrize("model, dp, tp, par", [
    (MODEL, 2, 4, {}),  # GSPMD's dp sums of norms, biases, positions; the loss's pmax
    (MODEL, 2, 4, {"fsdp": True}),  # the tied table gathered in two regions
    (LLAMA, 2, 4, {"sp": True}),  # the replicated kv weight summed over dp and tp at once
    (MODEL, 4, 2, {"sp": True, "fsdp": True}),
], ids=["gpt2", "gpt2-fsdp", "llama-gqa-sp", "gpt2-dp4-tp2-sp-fsdp"])
def test_roofline_and_ledger_agree_per_axis(model, dp, tp, par):
    check = crosscheck(cfg_of(model, dp, tp, **par), make_mesh(dp, tp))
    assert check["agree"], check
    axes = check["axes"]
    assert {"dp", "tp"} <= set(axes) and all(axes[a]["roofline"] > 0 for a in ("dp", "tp"))


test_roofline_and_ledger_agree_per_axis.fast_cases = {"gpt2"}


def test_the_cross_check_refuses_what_the_roofline_reads_once():
    """A loop's body is read once: microbatches, a scanned stack and remat's
    recompute are refused with the reason."""
    for kw in ({"microbatches": 2}, ):
        cfg = dataclasses.replace(cfg_of(MODEL, 2, 4), train=TrainConfig(batch_size=8, **kw))
        assert "trip count" in unsupported(cfg)
    for m in (dataclasses.replace(MODEL, scan_layers=True),
              dataclasses.replace(MODEL, remat="full")):
        assert "trip count" in unsupported(cfg_of(m, 2, 4))
    assert unsupported(cfg_of(MODEL, 2, 4)) is None
