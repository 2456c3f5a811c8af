"""The decode step's collectives, read from its compiled HLO, against the budget."""

import dataclasses
from pathlib import Path

import pytest

from jaxtp import hlo
from jaxtp.analysis.rows import check
from jaxtp.analysis.decode import compare_decode, decode_budget, decode_hlo
from jaxtp.config import ConfigError, apply_overrides, load_config
from jaxtp.generate.load import generation_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])  # MHA; GQA with K=2 < tp=8
def test_the_decode_step_matches_its_budget_at_tp8(preset, impl):
    cfg = generation_config(load_config(preset), 8, impl, None)
    colls = hlo.collectives(decode_hlo(cfg, 4, 64))
    assert check(colls, decode_budget(cfg, 4, impl)) is None
    # no collective moves anything like the [B, V] logits
    assert max(c.elements for c in colls) == 4 * cfg.model.d_model
    # and the check can fail: one layer more is a deviation
    deeper = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=5))
    assert "expected 5 x all-reduce" in check(colls, decode_budget(deeper, 4, impl))


test_the_decode_step_matches_its_budget_at_tp8.fast_cases = {"tiny-shard_map"}


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("dispatch, shared", [("dense", 0), ("ragged", 0), ("dense", 64)],
                         ids=["dense", "ragged", "dense-shared"])
def test_a_moe_decode_step_matches_its_budget(dispatch, shared, impl):
    """moe-tiny (E 8, 4 layers) at tp 2, ep 1, dropless: the dense
    dispatch's g sums 8 slots per row (E x B x 1 x D = 8 x 4 x 128 per
    layer), the ragged one's sums the combined rows (B x D); a shared
    expert adds a dense MLP's g (B x D); no all-to-all."""
    cfg = apply_overrides(load_config("moe-tiny"), [f"model.moe_dispatch={dispatch}",
                                                   "model.capacity_factor=0",
                                                   f"model.moe_shared_d_ff={shared}"])
    cfg = generation_config(cfg, 2, impl, None)
    colls = hlo.collectives(decode_hlo(cfg, 4, 64))
    assert check(colls, decode_budget(cfg, 4, impl)) is None
    moe = [c.elements for c in colls if c.scope == "moe"]
    assert moe == [(8 if dispatch == "dense" else 1) * 4 * 128] * 4
    assert [c.elements for c in colls if c.scope == "mlp"] == [4 * 128] * (4 if shared else 0)
    assert not [c for c in colls if c.kind == "all-to-all"]


test_a_moe_decode_step_matches_its_budget.fast_cases = {"dense-shard_map"}


def test_generate_compare_hlo_of_a_float64_config_books_its_ledger_in_f64(tmp_path, capsys):
    """generate.py --compare-hlo --config of a float64 model turns on
    jax_enable_x64 (it was refused: a float64 model without x64) and holds
    the decode step to the ledger in f64 (`backends.widened`), with the sampled
    ids still int32 (jnp.argmax's would be int64 under x64)."""
    import json

    import jax

    import generate

    c = json.loads((ROOT / "configs" / "tiny.json").read_text())
    c["model"].update(dtype="float64", param_dtype="float64")
    (tmp_path / "tiny64.json").write_text(json.dumps(c))
    try:
        assert generate.main(["--compare-hlo", "--config", str(tmp_path / "tiny64.json")]) == 0
    finally:
        jax.config.update("jax_enable_x64", False)
    printed = capsys.readouterr().out
    assert "gspmd: matches budget" in printed and "shard_map: matches budget" in printed
    table = [line.split() for line in printed.splitlines() if line.startswith("all-")]
    assert {row[3][:4] for row in table} == {"f64[", "s32["}, table


@pytest.mark.slow
def test_generate_compare_hlo_prints_the_table(capsys):
    import generate

    assert generate.main(["--compare-hlo", "--config", "llama-tiny", "--tp", "4",
                          "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "gspmd: matches budget" in out and "shard_map: matches budget" in out
    assert "all-reduce  other  attention" in out
    cfg = apply_overrides(load_config("llama-tiny"), ["parallel.tp=4"])
    assert compare_decode(generation_config(cfg, 4, None, None), 2, 32, log=lambda _: None)


def test_a_run_trained_under_explicit_generates_under_gspmd():
    """Generation's KV-cache regions exist for gspmd and shard_map; the
    parameters of an explicit run are the same arrays, generated under gspmd."""
    cfg = load_config("tiny")
    trained = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, tp=8, impl="explicit", sp=True))
    got = generation_config(trained, None, None, None).parallel
    assert (got.impl, got.tp, got.sp) == ("gspmd", 8, False)
    assert generation_config(trained, 4, "shard_map", None).parallel.impl == "shard_map"
    with pytest.raises(ConfigError, match="generation runs under impl gspmd or shard_map"):
        generation_config(trained, None, "explicit", None)
