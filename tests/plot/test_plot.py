"""The pictures: collectives.svg drawn from --compare-hlo's report (every
collective row in it, deviations in the warning colour, no matplotlib
needed), and `python -m jaxtp.plot runs` on runs trained here (`plot bench`:
tests/bench/test_suite.py, on the quick suite's report)."""

import json
import shutil
import sys
import xml.etree.ElementTree as ET

import pytest

import train
from jaxtp.analysis import picture
from jaxtp.analysis.rows import role_text
from jaxtp.config import apply_overrides, load_config
from jaxtp.plot.runs import labels
from jaxtp.train.loop import train as train_run
from jaxtp.train.options import RunOptions
from procs import SMALL

SVG = "{http://www.w3.org/2000/svg}"


def drawn(svg_text: str) -> list[dict]:
    """The collective entries of a collectives.svg, read back: (data, text, colour)."""
    root = ET.fromstring(svg_text)
    return [{**{k[5:]: v for k, v in e.attrib.items() if k.startswith("data-")},
             "text": e.text, "fill": e.attrib["fill"]}
            for e in root.iter(f"{SVG}text") if e.attrib.get("class") == "collective"]


@pytest.fixture(scope="module")
def sp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    assert train.main(["--tp", "4", "--sp", "--compare-hlo", "--out", str(out),
                       "model.n_layers=1", "model.d_model=64", "model.d_ff=128",
                       "model.seq_len=32", "train.batch_size=4"]) == 0
    return out, json.loads((out / "comm_report.json").read_text())


@pytest.mark.slow
def test_the_svg_holds_every_collective_row_and_marks_deviations(sp_report):
    out, report = sp_report
    entries = drawn((out / "collectives.svg").read_text())
    want = [(impl, r["pass"], r["kind"], role_text(r), str(r["counts"][impl]))
            for r in report["table"] for impl in report["impls"]
            if r["counts"][impl] or r["budget"][impl]]
    got = [(e["impl"], e["pass"], e["kind"], e["role"], e["count"]) for e in entries]
    assert sorted(got) == sorted(want) and len(want) > 20
    for e in entries:  # the visible text says the same
        assert e["text"].startswith(f"{e['count']}x {e['kind']}: ")
        assert e["fill"] == (picture.OK if e["count"] == e["budget"] else picture.WARN)
    assert {e["fill"] for e in entries} == {picture.OK}  # all three match here
    assert {e.get("axes") for e in entries} == {"tp"}  # each entry names its mesh axes
    assert set(report["impls"]) == {"gspmd", "shard_map", "explicit"}
    # one count off the budget: that entry, and only it, in the warning colour
    row = next(r for r in report["table"] if r["kind"] == "all-gather" and r["scope"] == "mlp")
    row["counts"]["gspmd"] += 1
    (e,) = [e for e in drawn(picture.to_svg(report)) if e["fill"] == picture.WARN]
    assert (e["impl"], e["kind"], e["role"], e["pass"]) == (
        "gspmd", "all-gather", role_text(row), row["pass"])
    assert e["count"] == str(row["counts"]["gspmd"]) and e["count"] != e["budget"]


def test_each_collective_sits_beside_its_module():
    row = lambda scope, *roles: {"scope": scope, "roles": list(roles)}
    assert picture.slot(row("attention", "g")) == "attn_out"
    assert picture.slot(row("attention", "f")) == "attn_in"
    assert picture.slot(row("mlp", "SP exit, backward")) == "mlp_down"
    assert picture.slot(row("mlp", "f_sp ring, backward")) == "mlp_up"
    assert picture.slot(row("attention", "kv gradient")) == "attn_core"
    assert picture.slot(row("cross_entropy", "cross-entropy")) == "loss"
    assert picture.slot(row("cross_entropy", "SP LM head entry")) == "head"
    assert picture.slot(row("", "norm weights used on sequence shards")) == "norm"
    assert picture.slot(row("", "gradient norm")) == "grads"
    assert picture.slot(row("embed", "g")) == "embedding"


def test_without_matplotlib_plot_exits_2_and_the_svg_is_still_drawn(tmp_path, monkeypatch,
                                                                    capsys):
    # a report of one collective, as compare_hlo writes it
    report = {"tp": 2, "dp": 1, "layers": 1, "batch": 4, "seq": 8, "d_model": 16,
              "device_kind": "cpu", "platform": "cpu",
              "impls": {"gspmd": {"verdict": "matches budget"}},
              "table": [{"kind": "all-reduce", "pass": "forward", "scope": "mlp",
                         "elements": 512, "dtype": "f32", "devices": 2, "bytes": 2048,
                         "shape": [4, 8, 16], "counts": {"gspmd": 1}, "budget": {"gspmd": 1},
                         "roles": ["g"]}]}
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    from jaxtp.plot.__main__ import main

    assert main(["runs", str(tmp_path)]) == 2
    assert 'pip install -e ".[plot]"' in capsys.readouterr().err
    assert picture.write(report, tmp_path, log=lambda _: None) == [tmp_path / "collectives.svg"]
    (e,) = drawn((tmp_path / "collectives.svg").read_text())
    assert (e["impl"], e["kind"], e["role"], e["count"]) == ("gspmd", "all-reduce", "g", "1")


def test_legends_name_what_differs_between_runs():
    a = {"parallel.tp": 1, "parallel.impl": "gspmd", "train.lr": 1e-3}
    b = {**a, "parallel.tp": 8}
    c = {**b, "parallel.impl": "shard_map"}
    assert labels([a, b], ["x", "y"]) == ["tp=1", "tp=8"]
    assert labels([a, b, c], ["x", "y", "z"]) == [
        "impl=gspmd, tp=1", "impl=gspmd, tp=8", "impl=shard_map, tp=8"]
    assert labels([a, a], ["x", "y"]) == ["x", "y"]


@pytest.mark.slow
def test_plot_runs_overlays_runs_trained_here(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from jaxtp.plot.__main__ import main

    cfg = apply_overrides(load_config("tiny"), SMALL + ["parallel.tp=2", "train.steps=3",
                                                        "train.eval_every=2"])
    train_run(cfg, tmp_path / "tp2", RunOptions(log=lambda _: None, inject_nan_at=(2,)))
    shutil.copytree(tmp_path / "tp2", tmp_path / "tp1")  # the same rows, another config
    conf = json.loads((tmp_path / "tp1" / "config.json").read_text())
    conf["parallel"]["tp"] = 1
    (tmp_path / "tp1" / "config.json").write_text(json.dumps(conf))
    # several runs: drawn where the user is (not into the runs' common parent)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "tp1"), str(tmp_path / "tp2")]) == 0
    assert capsys.readouterr().out.split() == [
        "wrote", str(tmp_path / "here" / "runs.png"), "wrote", str(tmp_path / "here" / "runs.svg")]
    for ext in ("png", "svg"):
        assert (tmp_path / "here" / f"runs.{ext}").stat().st_size > 1000
        assert not (tmp_path / f"runs.{ext}").exists()
    svg = (tmp_path / "here" / "runs.svg").read_text()
    assert "tp=1" in svg and "tp=8" not in svg and "skipped" in svg
    assert main(["runs", str(tmp_path / "nothing")]) == 2
    assert "not a training run" in capsys.readouterr().err
    # a damaged row: one line naming the file and the line
    with open(tmp_path / "tp1" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss"\n')
    assert main(["runs", str(tmp_path / "tp1")]) == 2
    err = capsys.readouterr().err
    n = len((tmp_path / "tp1" / "metrics.jsonl").read_text().splitlines())
    assert err.startswith(f"error: {tmp_path / 'tp1' / 'metrics.jsonl'}, line {n}: not a "
                          "metrics row") and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_a_moe_run_logs_each_layers_load_at_every_row_and_plots_it(tmp_path, capsys):
    """Every logged row of a MoE run holds each MoE layer's experts' shares
    (summing to 1), dropped share, max violation and dead experts, and the
    largest violation; `plot runs` on it draws experts.png too, and `plot
    experts` on a dense run says why it cannot."""
    pytest.importorskip("matplotlib")
    from jaxtp.plot.__main__ import main
    from jaxtp.train.metrics import scalars

    cfg = apply_overrides(load_config("moe-tiny"), [
        "model.n_layers=3", "model.moe_first_dense=1", "model.seq_len=32", "train.steps=3",
        "train.log_every=1", "train.eval_every=3", "train.eval_batches=1",
        "model.moe_balance=bias", "parallel.ep=2"])
    train_run(cfg, tmp_path / "moe", RunOptions(log=lambda _: None))
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        load = r["moe_layer_load"]
        assert len(load) == 2 and all(abs(sum(x) - 1) < 1e-5 and len(x) == 8 for x in load)
        assert r["moe_max_violation"] == max(r["moe_layer_violation"])
        assert len(r["moe_layer_dropped"]) == len(r["moe_layer_dead"]) == 2
        # TensorBoard takes each number under its own tag
        tags = dict(scalars(r))
        assert tags["moe_layer_load/1/7"] == load[1][7] and "moe_layer_load" not in tags
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "moe")]) == 0
    assert [p.rsplit("/", 1)[1] for p in capsys.readouterr().out.split()[1::2]] == [
        "runs.png", "runs.svg", "experts.png", "experts.svg"]
    assert "max violation per layer" in (tmp_path / "moe" / "experts.svg").read_text()
    dense = apply_overrides(load_config("tiny"), SMALL + ["train.steps=1"])
    train_run(dense, tmp_path / "dense", RunOptions(log=lambda _: None))
    assert main(["experts", str(tmp_path / "dense")]) == 2
    assert "no per-layer expert loads" in capsys.readouterr().err
