"""generate.py as a user runs it: from a run directory at another tp (trained
at cp=2 x tp=2), streaming."""

import json

import pytest

import generate
from jaxtp.config import apply_overrides, load_config
from jaxtp.train.loop import train
from jaxtp.train.options import RunOptions
from procs import SMALL


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    # trained with context parallelism (cp=2 x tp=2); generation decodes at cp=1
    cfg = apply_overrides(load_config("tiny"), SMALL + ["parallel.tp=2", "parallel.cp=2",
                                                        "train.steps=6"])
    train(cfg, out, RunOptions(log=lambda _: None))
    return out


@pytest.mark.slow
def test_a_run_trained_at_cp2_tp2_generates_the_same_greedy_text_at_tp1_and_tp8(run_dir,
                                                                                capsys):
    record = json.loads((run_dir / "run.json").read_text())  # the run records its cp
    assert (record["cp"], record["cp_attention"], record["cp_balance"]) == (2, "allgather", True)
    texts = {}
    for tp, impl in ((1, "gspmd"), (8, "shard_map"), (2, "gspmd")):
        assert generate.main(["--run", str(run_dir), "--prompt", "def f(x):", "--tp", str(tp),
                              "--impl", impl, "--temperature", "0",
                              "--max-new-tokens", "12"]) == 0
        got = capsys.readouterr()
        assert f"at tp={tp} ({impl})" in got.err  # status on stderr, the text alone on stdout
        texts[tp] = got.out.rstrip("\n")
    assert texts[1] == texts[8] == texts[2] and texts[1].startswith("def f(x):")
    assert len(texts[1]) > len("def f(x):")


@pytest.mark.slow  # its run_dir fixture trains a run first
def test_bad_requests_are_one_line(run_dir, tmp_path, capsys):
    cases = [(["--run", str(run_dir)], "give --prompt TEXT"),
             (["--run", str(tmp_path), "--prompt", "x"], "no training run there"),
             (["--run", str(run_dir), "--prompt", "x", "--top-p", "0"], "top_p=0.0"),
             (["--run", str(run_dir), "--prompt", "x" * 40], "longer than model.seq_len=32")]
    for argv, said in cases:
        assert generate.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()  # status lines, then the error
        assert said in err[-1] and [x for x in err if x.startswith("error")] == err[-1:], err


@pytest.mark.parametrize("prompts", [["p"], ["p", "q"]])
def test_the_last_tokens_split_character_is_printed(prompts, capsys):
    """The stream's last token ends inside a UTF-8 character: its byte prints
    as U+FFFD (as transformers' decode of the whole output does), for one
    streamed prompt and for a batch."""
    import argparse

    from jaxtp.data.tokenizer import ByteTokenizer

    class Gen:
        def stream(self, ids, n, seed, eos):
            for t in (ord("c"), "é".encode()[0]):
                yield [t] * len(ids)

    args = argparse.Namespace(max_new_tokens=2, seed=0)
    assert not generate.stream(Gen(), [[0]] * len(prompts), prompts, ByteTokenizer(), args)
    out = capsys.readouterr().out
    want = (b"c" + "é".encode()[:1]).decode("utf-8", "replace")
    assert all(f"{p}{want}\n" in out for p in prompts), out
