"""The training loop as a user drives it: `train.py` in fresh processes.

Resume equivalence (bit for bit on CPU), SIGTERM, fault handling and the
metrics rows. (Resuming at another dp x tp, from two processes:
tests/parallel/test_distributed.py; restoring into other layouts:
tests/train/test_checkpoint.py.)"""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxtp.config import (Config, ModelConfig, ParallelConfig, TrainConfig, apply_overrides,
                          load_config)
from jaxtp.train.loop import TrainingStopped, train
from jaxtp.train.options import RunOptions
from procs import ROOT, SMALL, child_env, final_params, logged, rows, train_py


def cli(*args, timeout=300):
    return train_py(*args, *SMALL, timeout=timeout)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_a_new_process_resumes_bit_identically(tmp_path):
    """SIGTERM during a run: it saves a checkpoint and exits resumable
    (128 + SIGTERM); a new process resumes it and logs, and ends with, exactly
    what a run that never stopped logs and ends with (CPU: bit for bit)."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    # a schedule far longer than the run, so the signal lands mid-run
    long = ["--tp", "4", "--steps", "100000"]
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "train.py"), *long,
                             "--out", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=child_env())
    try:
        for line in proc.stdout:
            if line.startswith("step     2/"):
                proc.send_signal(signal.SIGTERM)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]  # resumable, not done
    # where the run stands on stderr, apart from the log rows on stdout
    assert "SIGTERM received: saved a checkpoint at step" in stderr
    assert "SIGTERM received" not in stdout
    step = int(stderr.split("saved a checkpoint at step ")[1].split()[0])
    assert (out / "checkpoints" / str(step)).is_dir()
    end = (step // 4 + 1) * 4  # the next eval (every 4 steps), whenever the signal landed
    r = cli(*long, "--until", str(end), "--resume", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and f"step {step}" in r.stdout
    assert [x["step"] for x in rows(out)] == list(range(1, end + 1))
    # the straight run in this process (the same XLA flags as the children's)
    cfg = apply_overrides(load_config("tiny"), SMALL + ["parallel.tp=4", "train.steps=100000"])
    train(cfg, straight, RunOptions(log=lambda _: None, until=end))
    assert logged(out) == logged(straight)  # every loss, grad norm and eval loss, exactly
    pa, pb = final_params(straight, end), final_params(out, end)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k


@pytest.mark.slow
def test_nan_steps_are_skipped_logged_and_too_many_stop_the_run(tmp_path):
    cfg = Config(ModelConfig(n_layers=1, d_model=32, n_heads=4, d_ff=64, seq_len=16),
                 TrainConfig(steps=8, batch_size=8, warmup_steps=0, log_every=1,
                             eval_every=100, eval_batches=1, max_skipped_steps=2),
                 ParallelConfig(tp=2))
    lines = []
    summary = train(cfg, tmp_path / "a", RunOptions(log=lines.append, inject_nan_at={3}))
    assert summary["finished"]
    skipped = [r["step"] for r in rows(tmp_path / "a") if r["skipped"]]
    assert skipped == [3]
    assert any(line.startswith("step 3: skipped") for line in lines)
    row2, row3, row4 = rows(tmp_path / "a")[1:4]
    assert row3["loss"] is None and row3["grad_norm"] is None  # NaN is not JSON: null
    # the skipped step did not advance optax's count: step 4 runs at step 3's lr
    assert row4["lr"] == row3["lr"] != row2["lr"]
    with pytest.raises(TrainingStopped, match="2 steps in a row had a non-finite"):
        train(cfg, tmp_path / "b", RunOptions(log=lines.append, inject_nan_at={4, 5}))
    assert (tmp_path / "b" / "checkpoints" / "5").is_dir()


def test_metrics_rows_have_speed_and_mfu_fields(tmp_path):
    cfg = Config(ModelConfig(n_layers=1, d_model=32, n_heads=4, d_ff=64, seq_len=16),
                 TrainConfig(steps=3, batch_size=8, log_every=1, eval_every=100,
                             eval_batches=1), ParallelConfig(tp=2))
    train(cfg, tmp_path, RunOptions(log=lambda s: None, peak_tflops=1.0))
    r = rows(tmp_path)
    assert r[0]["tokens_per_sec"] is None and r[0]["mfu"] is None  # includes warm-up
    # 6N + 12*L*h*s (Chowdhery et al. 2022, App. B), N by hand: the tied table
    # (it is the LM head) and one block, not the learned positions
    D, F, V = 32, 64, 256
    block = 2 * D + (D * D + D) + (D * 2 * D + 2 * D) + (D * D + D) + 2 * D \
        + (D * F + F) + (F * D + D)
    flops_per_token = 6 * (V * D + block + 2 * D) + 12 * 1 * D * 16
    for row in r[1:]:
        assert row["model_tflops_per_device"] == pytest.approx(
            row["tokens_per_sec"] * flops_per_token / 2 / 1e12)
        assert row["step_time_s"] > 0
        assert row["tokens_per_sec"] == pytest.approx(8 * 16 / row["step_time_s"])
        # MFU = model flops/s per device / peak (1 TFLOP/s given)
        assert row["mfu"] == pytest.approx(row["model_tflops_per_device"] / 1.0)


@pytest.mark.slow
def test_sample_every_prints_the_greedy_continuation_of_the_trained_model(tmp_path):
    from jaxtp.generate import Generator
    from jaxtp.data.tokenizer import ByteTokenizer
    from jaxtp.generate.load import from_run
    from jaxtp.train.data import Dataset, load_tokens

    cfg = Config(ModelConfig(n_layers=1, d_model=32, n_heads=4, d_ff=64, seq_len=48),
                 TrainConfig(steps=4, batch_size=8, log_every=2, eval_every=100,
                             eval_batches=1, sample_every=4),
                 # explicit: the sampler and from_run generate its parameters under gspmd
                 ParallelConfig(tp=2, sp=True, impl="explicit"))
    lines = []
    train(cfg, tmp_path, RunOptions(log=lines.append))
    (said,) = [line for line in lines if line.startswith("sample at step 4: ")]
    # the same text from the saved step-4 parameters, through generate's own path
    prompt = Dataset(load_tokens(None), 48, 256).eval_batches(8, 1)[0][0][:16]
    model, mesh, _ = from_run(tmp_path, tp=1, log=lambda _: None)
    ids = Generator(model, mesh).generate([list(map(int, prompt))], 32)[0]
    assert said == f"sample at step 4: {ByteTokenizer().decoder()(ids)!r}"


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_impl(tmp_path):
    """The checkpoint is the same arrays whatever placed the collectives and
    however the stack runs: a tp=4 run saved at step 2 under gspmd resumes
    under explicit, which saves at step 4 and resumes under shard_map as a
    zero-bubble pipeline (pp=2, 2 chunks a stage, its stack in the circular
    storage order); it logs the losses, grad norms and eval losses of the
    run that never stopped (impls and schedules agree to fp32 round-off, so
    steps after a switch match to 1e-6, not bit for bit)."""
    def cfg(impl):
        zb = ["parallel.pp=2", "parallel.pp_schedule=zb", "parallel.pp_repeats=2",
              "train.microbatches=2"] if impl == "shard_map" else []
        return apply_overrides(load_config("tiny"), SMALL + zb + [
            "model.n_layers=4", "parallel.tp=4", f"parallel.impl={impl}", "train.steps=6"])

    quiet = lambda _: None
    straight, out = tmp_path / "straight", tmp_path / "switched"
    train(cfg("gspmd"), straight, RunOptions(log=quiet))
    want = logged(straight)
    train(cfg("gspmd"), out, RunOptions(log=quiet, until=2))
    for first, then, at, until in (("gspmd", "explicit", 2, 4), ("explicit", "shard_map", 4, None)):
        said = []
        train(cfg(then), out, RunOptions(log=said.append, resume=True, until=until))
        assert any("resumed from" in s and f"step {at}" in s for s in said), said
        # the resumed steps ran under the new impl: the history and run.json say so
        entry = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()][-1]
        assert entry["changes"]["parallel.impl"] == [first, then] and entry["step"] == at
        record = json.loads((out / "run.json").read_text())
        assert record["impl"] == then and record["known_bugs"] == []  # none met on CPU
    got = logged(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert got[:2] == want[:2]  # the same program up to the first save
    for g, w in zip(got, want):
        for k in ("loss", "grad_norm", "eval_loss"):
            if k in w:
                np.testing.assert_allclose(g[k], w[k], rtol=1e-6, err_msg=f"{k} {g['step']}")
