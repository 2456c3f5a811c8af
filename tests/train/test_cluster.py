"""A run's life on a cluster: killed, requeued and restarted by scripts.

Each test reproduces one way a run used to be stranded or to fail unclearly
(issue 13): a kill before the first checkpoint, a resume whose flags differ
from the run's, the same data under another path, a log cut mid-line, a full
file system, processes that never arrive, and the messages of bad input.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

import train
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.train.loop import train as train_loop
from jaxtp.train.options import RunOptions
from procs import ROOT, SMALL, child_env, rows, train_py


def started(args, wait_for: str) -> tuple[subprocess.Popen, list[str]]:
    """train.py ARGS running, once it has printed a line starting with `wait_for`."""
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "train.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=child_env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(wait_for):
            return proc, seen
    proc.wait()
    pytest.fail(f"train.py exited {proc.returncode} before {wait_for!r}: "
                f"{''.join(seen)[-1500:]} {proc.stderr.read()[-1500:]}")


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_requeued_by_one_command(tmp_path):
    out = str(tmp_path / "run")
    # Ctrl-C while it starts up: one line, 128 + SIGINT, and the run is recorded
    proc, _ = started(["--tp", "2", "--steps", "5", "--out", out, *SMALL], "model:")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        f"stopped by SIGINT outside the training steps; continue with: python train.py "
        f"--resume --out {out}"]
    # the requeued job, killed -9 after compiling: no checkpoint, no clean-up
    proc, _ = started(["--resume", "--out", out], "compiled the train step")
    proc.kill()
    proc.wait()
    assert os.listdir(f"{out}/checkpoints") == []
    # the next requeue, with the same one command, trains the run as configured
    r = train_py("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "holds no complete checkpoint yet" in r.stdout
    assert "mesh dp=1 x tp=2" in r.stdout and "step     5/5" in r.stdout
    assert [x["step"] for x in rows(tmp_path / "run")] == [1, 2, 3, 4, 5]
    assert r.stderr == ""


@pytest.mark.slow
def test_resume_keeps_the_runs_config_and_records_what_it_changes(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(["--tp", "2", "--steps", "4", "--until", "2", "--out", str(out),
                       *SMALL]) == 0
    printed, err = capsys.readouterr()  # where the stopped run stands: on stderr
    assert err.startswith("stopped after step 2 (--until)") and "stopped" not in printed
    original = (out / "config.json").read_bytes()
    # a kill while writing row 3 (after the save at step 2) left half a line
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.')
    capsys.readouterr()
    # the hint as printed: --resume --out DIR, nothing else; tp changed and
    # context parallelism added (the sequence split over cp=2), --until 3
    assert train.main(["--resume", "--out", str(out), "--tp", "4", "--cp", "2",
                       "--until", "3"]) == 0
    printed = capsys.readouterr().out
    assert "metrics.jsonl: dropped its last line, cut short mid-write" in printed
    assert "--resume with changes: parallel.tp 2 -> 4, parallel.cp 1 -> 2" in printed
    assert "mesh dp=1 x cp=2 (allgather, balanced) x tp=4" in printed
    assert "step     3/4" in printed
    # anything that would make it another run is refused, naming the key
    assert train.main(["--resume", "--out", str(out), "model.d_model=32", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model=32 (the run has 64)" in err and "train.seed=7 (the run has 0)" in err
    # the schedule may grow (with a warning); tp stays 4 as the last resume set it
    assert train.main(["--resume", "--out", str(out), "--steps", "5"]) == 0
    printed, err = capsys.readouterr()
    assert err.startswith("warning: the lr schedule now spans 5 steps")
    assert "warning:" not in printed
    assert "mesh dp=1 x cp=2 (allgather, balanced) x tp=4" in printed
    assert "step     5/5" in printed
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5]
    assert (out / "config.json").read_bytes() == original  # the run's record
    history = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert [h["changes"] for h in history] == [{"parallel.tp": [2, 4], "parallel.cp": [1, 2]},
                                               {"train.steps": [4, 5]}]
    assert [h["step"] for h in history] == [2, 3]
    # a finished run: one line, nothing compiled
    assert train.main(["--resume", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "already at step 5 of 5: finished" in printed and "compiled" not in printed


def small_config(**train) -> Config:
    return Config(ModelConfig(n_layers=1, d_model=32, n_heads=4, d_ff=64, seq_len=16),
                  TrainConfig(**{"steps": 4, "batch_size": 8, "log_every": 1,
                                 "eval_every": 100, "eval_batches": 1, **train}),
                  ParallelConfig(tp=2))


@pytest.mark.slow
def test_data_is_recognised_by_content_not_by_path(tmp_path, monkeypatch):
    corpus = (ROOT / "README.md").read_bytes()[:20000]
    (tmp_path / "corpus.txt").write_bytes(corpus)
    monkeypatch.chdir(tmp_path)
    out, lines = tmp_path / "run", []
    # checkpoint_minutes ~0: a save at every row, by the clock
    cfg = small_config(checkpoint_minutes=1e-9)
    train_loop(cfg, out, RunOptions(data_path="./corpus.txt", log=lines.append, until=2))
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [1, 2]
    # the same content by its absolute path, and by a copy elsewhere: the same run
    train_loop(cfg, out, RunOptions(data_path=str(tmp_path / "corpus.txt"), log=lines.append,
                                    resume=True, until=3))
    shutil.copy(tmp_path / "corpus.txt", tmp_path / "copy.txt")
    train_loop(cfg, out, RunOptions(data_path="copy.txt", log=lines.append, resume=True))
    assert any("is now read from" in line and "copy.txt" in line for line in lines)
    # different content of the same length at the same path: another run
    changed = bytearray(corpus)
    changed[len(changed) // 2] ^= 1
    (tmp_path / "corpus.txt").write_bytes(bytes(changed))
    with pytest.raises(ValueError, match="the data differs from the checkpoint's"):
        train_loop(small_config(steps=6), out,
                   RunOptions(data_path="./corpus.txt", log=lines.append, resume=True))
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_save_the_file_system_refuses_stops_the_run_with_one_line(tmp_path, capsys,
                                                                     monkeypatch):
    out = tmp_path / "run"
    assert train.main(["--tp", "2", "--steps", "12", "--until", "2", "--out", str(out),
                       *SMALL]) == 0
    # no room (a file-size limit: Python ignores SIGXFSZ, so a write past it
    # fails with EFBIG, as a full disk fails with ENOSPC); no compile cache there.
    # 16 KiB is below one 64 x 128 kernel (32 KiB), so step 4's save fails
    # however orbax splits it into files (at 256 KiB a busy machine's step 4
    # fitted now and then, and step 6 failed)
    r = subprocess.run(["bash", "-c", 'ulimit -f 16 && exec "$@"', "-", sys.executable,
                        str(ROOT / "train.py"), "--resume", "--out", str(out),
                        "--checkpoint-every", "2"], capture_output=True, text=True,
                       timeout=300, env=child_env(drop=("JAX_COMPILATION_CACHE_DIR",)))
    # the first line says it all; orbax's, asyncio's and TensorStore's threads
    # racing the exit may add lines after it, never a traceback
    assert r.returncode == 3, r.stderr[-3000:]
    first = r.stderr.splitlines()[0]
    assert first.startswith("error: saving checkpoint step 4 in "), r.stderr[-3000:]
    assert "File too large (errno 27)" in first
    assert "the latest complete checkpoint is step 2" in first
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    # before a save: too little free space is refused with the numbers, nothing written
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=100 * 2**10))
    capsys.readouterr()
    assert train.main(["--resume", "--out", str(out), "--checkpoint-every", "2"]) == 3
    err = capsys.readouterr().err
    assert "cannot start the run in" in err and "a checkpoint takes 1.0 MiB" in err, err
    assert "the file system has 0.1 MiB free" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


@pytest.mark.slow
def test_a_coordinator_whose_peers_never_arrive_gives_up_with_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        where = f"localhost:{s.getsockname()[1]}"
    r = train_py("--tp", "2", "--coordinator", where, "--num-processes", "2",
                 "--process-id", "0", "--coordinator-timeout", "2", "--out",
                 str(tmp_path / "run"), timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stdout.startswith(f"waiting for 2 processes at {where} (this is process 0")
    assert r.stderr.startswith(f"error: process 0 (the coordinator) waited 2s at {where}")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine has an NVIDIA GPU")
def test_a_platform_this_machine_lacks_is_one_line(tmp_path):
    r = train_py("--steps", "1", "--out", str(tmp_path / "run"),
                 env=child_env() | {"JAX_PLATFORMS": "cuda"}, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "cuda" in line and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()
