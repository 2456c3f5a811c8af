"""Multi-process (multi-host) runs: start the distributed runtime, feed batches.

One JAX process runs per host (or per GPU); together they see one global set
of devices, and a mesh may span all of them. Every process runs the same
program on the same global arrays; each holds only its addressable shards.

Call `initialize` first, before anything else touches JAX (even
`jax.devices()`), in every process. Where the arguments come from, in order:

1. explicit arguments;
2. `JAX_COORDINATOR_ADDRESS` (read by JAX itself), `JAX_NUM_PROCESSES` and
   `JAX_PROCESS_ID` (read here: jax 0.10 reads only the first);
3. a launcher JAX recognises (Slurm `srun` with more than one task, Open MPI
   `mpirun` with more than one rank, a Cloud TPU VM): JAX fills in whatever is
   still missing.

With none of these the run is single-process and `initialize` starts nothing.

CPU: on a machine without accelerators each process gets `local_devices` fake
CPU devices (`jax_num_cpu_devices`) and its collectives go over TCP with gloo
(`jax_cpu_collectives_implementation="gloo"`, the default since jax 0.5.1).
Both settings only affect JAX's CPU client, so they are harmless on GPU/TPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from ..config import COORDINATOR_TIMEOUT_S

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def _launcher() -> str | None:
    """The multi-process launcher JAX can read its arguments from, if any."""
    env = os.environ
    if (all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID",
                               "SLURM_LOCALID")) and (_env_int("SLURM_NTASKS") or 1) > 1):
        return "Slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "Open MPI"
    platforms = jax.config.jax_platforms  # e.g. "cpu" in a CPU-only run on a TPU VM
    if importlib.util.find_spec("libtpu") is not None and (not platforms or "tpu" in platforms):
        # JAX asks the TPU VM's metadata; a single host gets 1 process (and, as only
        # one process can open a host's TPU chips, its coordinator port is free)
        return "Cloud TPU"
    return None


def requested(coordinator: str | None = None, num_processes: int | None = None,
              process_id: int | None = None) -> tuple[bool, int | None]:
    """(whether these arguments, JAX's environment variables or a launcher ask
    for a multi-process run, the number of processes where known)."""
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    multi = bool(coordinator or os.environ.get(ENV_COORDINATOR) or (n or 1) > 1
                 or process_id is not None or _launcher() not in (None, "Cloud TPU"))
    return multi, n


def describe() -> str:
    """One line: this process, its devices and the global device count (starts the backend)."""
    local = jax.local_devices()
    return (f"process {jax.process_index()} of {jax.process_count()}, {len(local)} local "
            f"{local[0].platform} devices, {jax.device_count()} global")


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # no public API tells this without starting one
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return False


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_devices: int | None = None,
               timeout_s: float = COORDINATOR_TIMEOUT_S, log=print) -> str:
    """Join (or, as process 0, start) the distributed runtime; returns `describe()`.

    coordinator: "host:port" of process 0, the same in every process (any free
      port; "localhost:PORT" only when all processes share one machine).
    num_processes, process_id: how many processes, and which one this is (0..n-1).
    local_devices: fake CPU devices per process when there is no accelerator
      (None: keep JAX's default or `JAX_NUM_CPU_DEVICES`). Ignored on GPU/TPU.
    timeout_s: how long to wait for all processes to arrive; then this
      process prints one line and exits with status 1 (JAX would abort with a
      C++ stack trace, and cannot say which processes are missing).

    Must run before any other JAX call; a single process with nothing to join
    only applies `local_devices`. Calling it again after a successful
    multi-process start returns the description.
    """
    if local_devices is not None and local_devices < 1:
        raise ValueError(f"local_devices={local_devices} must be >= 1")
    if jax.distributed.is_initialized():
        return describe()
    given = _given(coordinator, num_processes, process_id)
    coordinator, num_processes, process_id = given.values()
    nothing_given = all(v is None for v in given.values())
    launcher = None if None not in given.values() else _launcher()
    single = num_processes == 1 or (nothing_given and launcher is None)

    missing = [] if single else [k for k, v in given.items() if v is None]
    if missing and launcher is None:
        env = {"coordinator": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
               "process_id": ENV_PROCESS_ID}
        raise ValueError(
            f"a multi-process run needs {' and '.join(missing)} too (got {given}); pass "
            f"them, set {' and '.join(env[k] for k in missing)}, or launch with srun/mpirun")
    started = _backend_started()
    if started and not single:
        raise RuntimeError("jaxtp.parallel.distributed.initialize() must run before any other JAX call "
                           "(the JAX backend has already started: something called "
                           "jax.devices(), created an array or compiled a function first)")
    if local_devices is not None and not started:
        jax.config.update("jax_num_cpu_devices", local_devices)
    if single:
        return describe()

    if jax.config.jax_cpu_collectives_implementation is None:
        # without it a CPU computation spanning processes cannot run
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        _join(coordinator, num_processes, process_id, launcher, timeout_s, log)
    except ValueError:
        if not (nothing_given and launcher == "Cloud TPU"):
            raise
        # libtpu is installed, but JAX finds no TPU VM around it: a single process
    return describe()


def _given(coordinator, num_processes, process_id) -> dict:
    """The arguments, else JAX's environment variables, checked."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    host, _, port = (coordinator or "").rpartition(":")
    if coordinator is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"coordinator {coordinator!r}: expected HOST:PORT, process 0's "
                         "address and a free port, e.g. node0:1234")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if None not in (num_processes, process_id) and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in 0..{num_processes - 1} "
                         f"(num_processes={num_processes})")
    return {"coordinator": coordinator, "num_processes": num_processes,
            "process_id": process_id}


def _join(coordinator, num_processes, process_id, launcher, timeout_s: float, log) -> None:
    """jax.distributed.initialize, watched: say whom it waits for, and give up
    with one line after `timeout_s` (`_give_up_after`)."""
    where = coordinator or f"the coordinator {launcher} names"
    log(f"waiting for {num_processes or 'all'} processes at {where} (this is process "
        f"{'?' if process_id is None else process_id}; timeout {timeout_s:g}s)")
    arrived = threading.Event()
    threading.Thread(target=_give_up_after, daemon=True,
                     args=(arrived, timeout_s, where, num_processes, process_id)).start()
    try:
        # JAX's own timeout later than ours: its expiry aborts the process
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=int(timeout_s) + 60)
    finally:
        arrived.set()


def _give_up_after(arrived: threading.Event, timeout_s: float, where: str,
                   n: int | None, process_id: int | None) -> None:
    """The start-up watchdog: one line and exit status 1 if the processes have
    not all arrived in time (the coordination service does not tell which are
    missing, so the line says what to check)."""
    if arrived.wait(timeout_s):
        return
    who = ("process 0 (the coordinator) waited" if process_id == 0 else
           f"process {'?' if process_id is None else process_id} could not join")
    sys.stderr.write(
        f"error: {who} {timeout_s:g}s at {where}, and not all {n or ''} processes arrived: "
        f"start every process with the same --coordinator and --num-processes{f' {n}' if n else ''}"
        f" and its own --process-id, make {where} reachable from each, or raise "
        "--coordinator-timeout\n")
    sys.stderr.flush()
    os._exit(1)


def any_process(flag: bool) -> bool:
    """True if `flag` is set in any process (one host allgather when there are
    several): every process must stop after the same step, or the next step's
    collectives would wait forever."""
    if jax.process_count() == 1:
        return flag

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def is_main() -> bool:
    """True in the process that logs and writes files (process 0)."""
    return jax.process_index() == 0


def global_batch(batch: np.ndarray, mesh: Mesh | None,
                 spec_or_sharding: PartitionSpec | Sharding) -> jax.Array:
    """The global jax.Array of a host batch that every process holds whole.

    `batch` is the GLOBAL batch (e.g. [B, T+1] tokens), identical in every
    process, as `jaxtp.train.data.Dataset` generates it from the seed. Each process
    copies only the slices its own devices hold (no cross-process traffic);
    in a single process this is a plain `jax.device_put`.

    `spec_or_sharding`: a PartitionSpec over `mesh`'s axes, or a Sharding
    (then `mesh` may be None).
    """
    if isinstance(spec_or_sharding, Sharding):
        sharding = spec_or_sharding
    elif isinstance(spec_or_sharding, PartitionSpec):
        if mesh is None:
            raise ValueError("global_batch with a PartitionSpec needs the mesh")
        sharding = NamedSharding(mesh, spec_or_sharding)
    else:
        raise TypeError(f"spec_or_sharding must be a PartitionSpec or a Sharding, got "
                        f"{type(spec_or_sharding).__name__}")
    batch = np.asarray(batch)
    # same data everywhere: global_shape == local shape tells JAX to slice it per device
    return jax.make_array_from_process_local_data(sharding, batch, batch.shape)


__all__ = ["initialize", "requested", "describe", "any_process", "is_main", "global_batch"]


def check_device_count(sizes: dict[str, int], available: int, platform: str) -> None:
    """Refuse a mesh of more devices than `available`, naming each axis."""
    needed = math.prod(sizes.values())
    if needed > available:
        flags = "/".join(f"--{a}" for a, n in sizes.items() if n > 1) or "--tp"
        hint = (f"lower {flags}" if platform == "cpu" else
                f"lower {flags}, or simulate on CPU with JAX_PLATFORMS=cpu")
        raise ValueError(
            f"{'*'.join(sizes)} = {'*'.join(map(str, sizes.values()))} = {needed} devices "
            f"requested but this machine has {available} {platform} device(s); {hint}")


def ensure_devices(n: int) -> str:
    """Give a CPU-only process `n` fake CPU devices; call before JAX starts.

    On a GPU/TPU machine this changes nothing (the CPU client is not the default
    backend); `make_mesh` then checks the real device count. Returns a one-line
    description of what was done.
    """
    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # backend already started (e.g. under pytest): keep what it has
    backend = jax.default_backend()
    count = jax.device_count()
    if backend == "cpu":
        return (f"no accelerator: using {count} CPU devices "
                f"(fake devices via jax_num_cpu_devices={count})")
    return f"using {count} {backend} device(s)"
