"""The layouts of four and five axes on 16 fake CPU devices, run by
tests/test_sixteen.py in a process of its own (the suite's has 8): for each,
one compiled train step, its loss and every gradient against one device in
float64 (rtol 1e-10), and its collectives against the whole ledger.

The MoE model is dropless with the Switch balance loss off: that loss is a
mean over each microbatch's tokens, so a pipeline's grouping of the rows into
microbatches changes it (2.5e-5 at step 1 with it on); the z-loss, a mean of
per-token terms, stays on."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from cached import (as_pipeline_slices, assert_same, loss_and_grads, stacked_grads,
                    step_loss_and_grads)
from jaxtp import hlo
from jaxtp.analysis.budget import expected_collectives
from jaxtp.analysis.rows import check
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.parallel import Layout
from jaxtp.train.state import abstract_train_state
from jaxtp.train.step import compile_train_step

jax.config.update("jax_enable_x64", True)

DENSE = ModelConfig(style="llama", n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                    seq_len=32, use_bias=False, tie_embeddings=False, dtype="float64",
                    param_dtype="float64", scan_layers=True)
MOE = dataclasses.replace(DENSE, n_experts=4, moe_top_k=2, moe_d_ff=32, capacity_factor=0.0,
                          moe_balance_coef=0.0)
B = 8
TOKENS = np.random.default_rng(2).integers(0, 256, (B, DENSE.seq_len + 1)).astype(np.int32)


# (zb over 2 chunks: its split backward on the interleaved table; 1F1B and
# zb under one impl each, both impls at 8 devices: tests/parallel)
PIPELINES = {"gpipe": {}, "circular": dict(pp_schedule="circular", pp_repeats=2),
             "1f1b": dict(pp_schedule="1f1b"), "zb": dict(pp_schedule="zb", pp_repeats=2)}
IMPLS = {"1f1b": ("gspmd",), "zb": ("shard_map",)}
CASES = {  # name: (model, degrees and kinds, M)
    **{f"moe-pp2xep2xcp2xtp2-{kind}-{impl}": (
        MOE, dict(pp=2, ep=2, cp=2, tp=2, cp_attention="ring", impl=impl, **kw),
        2 if kind == "circular" else 4)
       for kind, kw in PIPELINES.items() for impl in IMPLS.get(kind, ("gspmd", "shard_map"))},
    **{f"moe-dp2xpp2xep2xtp2-fsdp-{impl}": (MOE, dict(dp=2, pp=2, ep=2, tp=2, fsdp=True,
                                                      impl=impl), 2)
       for impl in ("gspmd", "shard_map")},
    **{f"dense-pp2xdp2xcp2xtp2-{impl}": (DENSE, dict(pp=2, dp=2, cp=2, tp=2, impl=impl,
                                                     cp_attention="ring"), 2)
       for impl in ("gspmd", "shard_map")},
}
# the MoE rows under FSDP and a pipeline are not written (train.py refuses
# --compare-hlo there): the gradients' ledger per parameter will hold them
NO_LEDGER = {"moe-dp2xpp2xep2xtp2-fsdp-gspmd", "moe-dp2xpp2xep2xtp2-fsdp-shard_map"}


def config(model, par: dict, M: int) -> Config:
    return validate(Config(model, TrainConfig(batch_size=B, microbatches=M),
                           ParallelConfig(**par)))


@pytest.mark.parametrize("name", list(CASES))
def test_the_layout_equals_one_device_and_holds_its_ledger(name):
    model, par, M = CASES[name]
    cfg = config(model, par, M)
    layout = Layout.of(cfg)
    assert layout.devices == 16
    step = compile_train_step(abstract_train_state(cfg, layout.mesh()), B, model.seq_len)
    p = cfg.parallel
    ref = loss_and_grads(config(model, {}, M), as_pipeline_slices(TOKENS, M, p.pp, p.dp, p.ep))
    assert_same(step_loss_and_grads(cfg, step, TOKENS), (ref[0], stacked_grads(ref[1])),
                rtol=1e-10, atol=1e-13)
    if name not in NO_LEDGER:
        sizes, colls = layout.sizes, hlo.collectives(step.as_text())
        assert check(colls, expected_collectives(cfg, p.impl, "cpu"), sizes) is None
        # every axis of the layout carries a collective of its own
        assert {a for c in colls for a in c.axes(sizes)} == {a for a, n in sizes.items()
                                                             if n > 1}


# the command of docs/scale.md: moe-tiny, dropless, the balance loss off,
# pp 2 x ep 2 x cp 2 x tp 2 on 16 devices (here 2 layers of 8 x 64 tokens)
COMMAND = ["--config", "moe-tiny", "model.capacity_factor=0", "model.moe_balance_coef=0",
           "--float64", "model.n_layers=2", "model.seq_len=64", "train.batch_size=8"]
FIVE = COMMAND + ["--pp", "2", "--ep", "2", "--cp", "2", "--tp", "2", "--cp-attention", "ring"]


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None and "step" in r}


def test_the_five_axis_command_logs_one_devices_losses_and_matches_its_ledger(tmp_path):
    """train.py at pp 2 x ep 2 x cp 2 x tp 2 logs the losses of the same
    command at --tp 1 (one device) to 1e-10 relative (40 steps by hand:
    2.9e-11, docs/scale.md); its --compare-hlo matches the ledger under
    gspmd and shard_map with collectives on all four axes."""
    import train
    run = ["--steps", "3", "train.log_every=1", "train.eval_batches=1"]
    assert train.main(FIVE + run + ["--out", str(tmp_path / "five")]) == 0
    assert train.main(COMMAND + ["--tp", "1"] + run + ["--out", str(tmp_path / "one")]) == 0
    five, ref = _losses(tmp_path / "five"), _losses(tmp_path / "one")
    assert sorted(five) == sorted(ref) == [1, 2, 3]
    for k in ref:
        assert abs(five[k] - ref[k]) <= 1e-10 * abs(ref[k]), (k, five[k], ref[k])
    assert train.main(FIVE + ["--compare-hlo", "--out", str(tmp_path / "hlo")]) == 0
    report = json.loads((tmp_path / "hlo" / "comm_report.json").read_text())
    assert report["ok"]
    for impl in ("gspmd", "shard_map"):
        r = report["impls"][impl]
        assert r["matches_budget"]
        assert {a for k in r["by_axis"] for a in k.split("+")} == {"pp", "ep", "cp", "tp"}
