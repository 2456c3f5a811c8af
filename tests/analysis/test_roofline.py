"""The ledger against jax.experimental.roofline, an independent reader of
the shard_map step's jaxpr: per mesh axis, every byte either agrees or is
one of the named differences (jaxtp.analysis.roofline)."""

import dataclasses
import json

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


@pytest.mark.parametrize("model, dp, cp, tp, par", [
    # 1 hop each way between 2 ranks: the roofline's permute counts both pairs
    # on the one link, 2x what a rank sends
    (MODEL, 1, 2, 4, {"cp_attention": "ring"}),
    (MODEL, 1, 4, 2, {"cp_attention": "ring"}),  # a ring of 4: a link per pair, 1x
    (MODEL, 1, 2, 4, {"fsdp": True}),  # FSDP over a dp of 1 splits nothing
    # a row over dp x cp, priced in plain floats; GSPMD's sum over cp of the
    # gradients outside the regions is not in the jaxpr
    (MODEL, 2, 2, 2, {"fsdp": True}),
    (LLAMA, 4, 1, 2, {"sp": True, "overlap": "collective_matmul"}),  # tp's rings of 2 ranks
], ids=["cp2-tp4-ring", "cp4-tp2-ring", "cp2-tp4-fsdp", "dp2-cp2-tp2-fsdp",
        "llama-dp4-tp2-sp-rings"])
def test_roofline_and_ledger_agree_over_cp_and_rings(model, dp, cp, tp, par):
    check = crosscheck(cfg_of(model, dp, tp, cp=cp, **par), make_mesh(dp, tp, cp=cp))
    assert check["agree"], check
    axes = check["axes"]
    assert all(type(v["agree"]) is bool for a, v in axes.items() if "+" not in a)
    assert json.loads(json.dumps(check)) == check  # comm_report.json takes it as it is
    assert axes["tp"]["roofline"] > 0 and (cp == 1 or axes["cp"]["roofline"] > 0)


test_roofline_and_ledger_agree_over_cp_and_rings.fast_cases = {"cp2-tp4-ring"}


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
