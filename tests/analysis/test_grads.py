"""The gradient ledger's one rule (a parameter's gradient summed over the axes
that split its tokens minus its own), the one place rows are multiplied out,
and the version stamp of the compiler rules."""

import dataclasses

import pytest

from jaxtp.analysis import backends
from jaxtp.analysis.grads import reduced_over
from jaxtp.analysis.rows import Expected, per_step
from jaxtp.config import apply_overrides, load_config
from jaxtp.parallel import Schedule


def cfg_of(*overrides, preset="tiny"):
    return apply_overrides(load_config(preset), ["model.n_layers=1", *overrides])


def test_each_gradient_is_summed_over_the_axes_that_split_its_tokens_minus_its_own():
    dp_cp = reduced_over(cfg_of("parallel.dp=2", "parallel.cp=2", "parallel.tp=2"), "gspmd")
    assert set(dp_cp.values()) == {("dp", "cp")}  # every parameter: its tokens' part
    sp = reduced_over(cfg_of("parallel.dp=2", "parallel.tp=4", "parallel.sp=true"), "shard_map")
    # used on the sequence shard: partial over tp too; a region's weight is not
    assert sp["blocks/0/ln1/scale"] == sp["wpe/embedding"] == ("dp", "tp")
    assert sp["blocks/0/mlp/down/bias"] == ("dp", "tp")
    assert sp["blocks/0/mlp/up/kernel"] == sp["wte/embedding"] == ("dp",)
    # GSPMD sums the attention's bias from the output gradient it gathered: whole over tp
    assert reduced_over(cfg_of("parallel.dp=2", "parallel.tp=4", "parallel.sp=true"),
                        "gspmd")["blocks/0/attn/out/bias"] == ("dp",)
    fsdp = reduced_over(cfg_of("parallel.dp=2", "parallel.cp=2", "parallel.tp=2",
                               "parallel.fsdp=true"), "gspmd")
    assert fsdp["blocks/0/mlp/up/kernel"] == ("cp",)  # FSDP owns dp: reduce-scattered there
    assert fsdp["blocks/0/mlp/up/bias"] == ("dp", "cp")  # no model dim: not split over dp
    # shard_map's replicated kv weight under SP (K < tp) is fed the gathered x
    gqa = reduced_over(cfg_of("parallel.dp=2", "parallel.tp=4", "parallel.sp=true",
                              "model.n_kv_heads=2", preset="llama-tiny"), "shard_map")
    assert gqa["blocks/0/attn/kv/kernel"] == ("dp", "tp")


def test_rows_are_multiplied_out_once_by_what_they_are_counted_per():
    row = Expected("r", "all-reduce", "forward", "mlp", 8, "f32", 2, 3)
    s = Schedule(microbatches=4, mode="sequential", layers=6)
    got = per_step([dataclasses.replace(row, per=per) for per in ("layer", "microbatch",
                                                                   "step")], s)
    assert [r.count for r in got] == [3 * 6 * 4, 3 * 4, 3]
    assert {r.per for r in got} == {"step"}
    with pytest.raises(ValueError, match="counted per 'block'"):
        per_step([dataclasses.replace(row, per="block")], s)


def test_the_compiler_rules_say_which_version_they_were_measured_on(monkeypatch):
    monkeypatch.setattr(backends, "installed", lambda package: backends.MEASURED_ON[package])
    assert backends.version_note("cpu") is None
    monkeypatch.setattr(backends, "installed", lambda package: "0.11.0")
    note = backends.version_note("gpu")
    assert note.startswith(f"note: the budget's compiler rules were measured on jaxlib "
                           f"{backends.MEASURED_ON['jaxlib']}; this is jaxlib 0.11.0")
    assert "re-measure:" in note and "\n" not in note
    assert "libtpu 0.11.0" in backends.version_note("tpu")


@pytest.mark.slow
@pytest.mark.parametrize("preset,impl,overrides", [
    # the learned positions' rows gathered over cp once per microbatch (the
    # pairwise ledger before this rule booked them once per step)
    ("tiny", "explicit", ["parallel.cp=2", "parallel.tp=4", "train.microbatches=2"]),
    # shard_map's replicated kv weight under SP and FSDP: summed over cp x tp
    # once, not over cp a second time in FSDP's cp total
    ("llama-tiny", "shard_map", ["parallel.dp=2", "parallel.cp=2", "parallel.tp=2",
                                 "parallel.fsdp=true", "parallel.sp=true",
                                 "model.n_kv_heads=1", "train.batch_size=32"]),
], ids=["explicit-positions-cp-microbatches", "shard_map-fsdp-sp-cp-kv"])
def test_the_rule_matches_the_compiled_step_where_the_pairwise_ledger_did_not(
        preset, impl, overrides):
    from jaxtp import hlo
    from jaxtp.analysis.budget import expected_collectives
    from jaxtp.analysis.rows import check
    from jaxtp.config import validate
    from jaxtp.model.build import resolve_attention
    from jaxtp.parallel import Layout
    from jaxtp.train.step import compiled_step

    cfg = validate(apply_overrides(load_config(preset), [f"parallel.impl={impl}", *overrides]))
    mesh = Layout.of(cfg).mesh()
    cfg = resolve_attention(cfg, mesh.devices.flat[0])
    colls = hlo.collectives(compiled_step(cfg, mesh)[1].as_text())
    assert check(colls, expected_collectives(cfg, impl, "cpu"), dict(mesh.shape)) is None
