"""Multi-process training on one machine: two CPU processes x 4 devices = 8 devices.

Two `tests/parallel/multihost_worker.py` processes join through `jaxtp.parallel.distributed`
(gloo collectives over localhost TCP) and train on meshes that span both:
dp=1 x tp=8 (tp all-reduces cross processes) and dp=2 x tp=4 (each process is
one dp replica and feeds only its half of each batch). This pytest process
runs the same steps on its own 8 devices. Two `train.py` processes train at
dp=2 x tp=4 and checkpoint; one process resumes.

Tolerance: rtol 1e-6 (about 8 float32 ulps). The two runs compile the same
partitioned program, but a cross-process all-reduce (gloo) adds the 8 partial
sums in a different order from the in-process CPU all-reduce, so values may
differ by round-off (measured on both meshes: losses, gradient norms and the
final parameter norm agree to 1 ulp, at most 9.2e-8 relative, after 3 steps). Step 1 runs at lr 0, so Adam's sign-like first update cannot
magnify that round-off (see jaxtp.train.optim.lr_schedule).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # processes of their own: tens of seconds each
from jax.sharding import NamedSharding, PartitionSpec as P

import multihost_worker
from procs import child_env
from jaxtp.parallel import distributed
from jaxtp.config import apply_overrides, load_config
from jaxtp.parallel import make_mesh
from jaxtp.train.loop import train
from jaxtp.train.options import RunOptions

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 240  # a dead peer would otherwise leave the other waiting for minutes
RTOL = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """This environment without distributed variables or proxies (gRPC would
    send the localhost coordinator traffic to a proxy)."""
    env = child_env(drop=(distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                          distributed.ENV_PROCESS_ID))
    return {k: v for k, v in env.items() if "proxy" not in k.lower()}


def _tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(line for line in text[-n:].splitlines() if not line.startswith("[Gloo]"))


def _run_workers(tmp_path: Path, meshes: str, n: int = 2
                 ) -> tuple[dict, list[subprocess.Popen], list[Path]]:
    out = tmp_path / "result.json"
    coordinator = f"localhost:{_free_port()}"
    logs = [tmp_path / f"worker{i}.log" for i in range(n)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--coordinator", coordinator,
                 "--num-processes", str(n), "--process-id", str(i), "--local-devices", "4",
                 "--meshes", meshes, "--out", str(out)],
                stdout=f, stderr=subprocess.STDOUT, env=_worker_env()))
    return out, procs, logs


def _wait(procs, logs, deadline: float) -> None:
    """Wait for every worker; on a timeout or a failure, kill the rest and fail."""
    def fail(why):
        killed = [p.poll() is None for p in procs]
        for p, k in zip(procs, killed):
            if k:
                p.kill()
            p.wait()
        pytest.fail(why + "".join(
            f"\n--- worker {i}: " + ("killed by the test" if k else f"exit code {p.returncode}")
            + f" ---\n{_tail(log)}" for i, (p, k, log) in enumerate(zip(procs, killed, logs))))

    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            fail("a worker failed")
        if None not in codes:
            return
        if time.monotonic() > deadline:
            fail(f"workers still running after the {TIMEOUT_S}s timeout")
        time.sleep(0.2)


def test_two_processes_train_like_one(tmp_path):
    deadline = time.monotonic() + TIMEOUT_S
    meshes = multihost_worker.MESHES
    out, procs, logs = _run_workers(tmp_path, ",".join(meshes))
    try:
        # the single-process references run while the workers start up
        refs = {m: multihost_worker.run(*map(int, m.split("x"))) for m in meshes}
    finally:
        _wait(procs, logs, deadline)
    results = json.loads(out.read_text())
    assert "process 1 of 2, 4 local cpu devices, 8 global" in logs[1].read_text()

    assert set(results) == set(refs)
    for mesh, got in results.items():
        ref = refs[mesh]
        assert got["process_count"] == 2 and got["device_count"] == 8
        assert ref["process_count"] == 1 and ref["device_count"] == 8
        for key in ("losses", "grad_norms", "param_norm"):
            np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=0,
                                       err_msg=f"{mesh} {key}")
        assert got["losses"][-1] < got["losses"][0]  # steps 2-3 really trained
    # the meshes do cross processes where the test says they do
    assert results["1x8"]["mesh_processes"] == [[0] * 4 + [1] * 4]
    assert results["2x4"]["mesh_processes"] == [[0] * 4, [1] * 4]


@pytest.mark.parametrize("dp,tp", [(1, 8), (2, 4), (8, 1)])
def test_global_batch_single_process(dp, tp):
    mesh = make_mesh(dp, tp)
    batch = np.arange(8 * 33, dtype=np.int32).reshape(8, 33)
    arr = distributed.global_batch(batch, mesh, P("dp", None))
    assert arr.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None)), batch.ndim)
    np.testing.assert_array_equal(np.asarray(arr), batch)
    # each device holds its dp slice of the rows (whole rows, replicated over tp)
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), batch[shard.index])
        assert shard.data.shape == (8 // dp, 33)
    same = distributed.global_batch(batch, None, NamedSharding(mesh, P("dp", None)))
    np.testing.assert_array_equal(np.asarray(same), batch)


def test_global_batch_errors():
    with pytest.raises(ValueError, match="needs the mesh"):
        distributed.global_batch(np.zeros((8, 4)), None, P("dp", None))
    with pytest.raises(TypeError, match="PartitionSpec or a Sharding"):
        distributed.global_batch(np.zeros((8, 4)), make_mesh(1, 8), ("dp", None))


@pytest.fixture
def no_cluster(monkeypatch):
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(distributed, "_launcher", lambda: None)


def test_initialize_single_process_is_a_noop(no_cluster):
    assert distributed.initialize() == "process 0 of 1, 8 local cpu devices, 8 global"
    assert distributed.initialize(num_processes=1).startswith("process 0 of 1")
    assert distributed.is_main()
    assert not jax.distributed.is_initialized()


def test_initialize_errors(no_cluster, monkeypatch):
    with pytest.raises(ValueError, match="needs num_processes and process_id too"):
        distributed.initialize("localhost:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match="needs process_id too.*JAX_PROCESS_ID"):
        distributed.initialize("localhost:1234")
    with pytest.raises(ValueError, match="process_id=2 must be in 0..1"):
        distributed.initialize("localhost:1234", process_id=2)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' must be an integer"):
        distributed.initialize()
    with pytest.raises(RuntimeError, match="must run before any other JAX call"):
        distributed.initialize("localhost:1234", 2, 0)  # pytest started the backend


def test_two_train_py_processes_checkpoint_and_resume_in_one(tmp_path):
    """The CLI end to end: two processes (dp=2 x tp=4 over both: each one dp
    replica, feeding its half of each batch) train 3 steps and checkpoint
    together; only process 0 logs and writes files; one process at tp=8
    resumes; every loss and gradient norm is a straight one-process run's."""
    small = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.seq_len=32",
             "train.batch_size=8", "train.log_every=1", "train.eval_every=4",
             "train.eval_batches=1"]
    train_py = str(Path(__file__).resolve().parents[2] / "train.py")
    run, straight = tmp_path / "run", tmp_path / "straight"
    coordinator = f"localhost:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, train_py, "--dp", "2", "--tp", "4", "--steps", "6",
                 "--until", "3", "--out", str(run), "--coordinator", coordinator,
                 "--num-processes", "2", "--process-id", str(i), *small],
                stdout=f, stderr=subprocess.STDOUT, env=_worker_env()))
    _wait(procs, logs, time.monotonic() + TIMEOUT_S)
    assert "step     3/6" in logs[0].read_text() and "step " not in _tail(logs[1])
    assert (run / "checkpoints" / "3").is_dir()
    # the run's own config (small, 6 steps) from its directory, on another mesh
    r = subprocess.run([sys.executable, train_py, "--resume", "--dp", "1", "--tp", "8",
                        "--out", str(run)], capture_output=True, text=True, env=_worker_env(),
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    # the straight run in this process (the same XLA flags as the children's)
    train(apply_overrides(load_config("tiny"), small + ["parallel.tp=8", "train.steps=6"]),
          straight, RunOptions(log=lambda _: None))
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    got, want = rows(run), rows(straight)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert (run / "checkpoints" / "6").is_dir()
    for g, w in zip(got, want):
        for k in ("loss", "grad_norm"):
            np.testing.assert_allclose(g[k], w[k], rtol=RTOL, err_msg=f"{k} at {g['step']}")
