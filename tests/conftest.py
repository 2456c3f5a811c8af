"""8 fake CPU devices for every test, set before any JAX backend starts
(16 in the process tests/test_sixteen.py starts).

`JAXTP_GPU_TESTS=1 python -m pytest -n 0 tests/test_gpu.py` runs the GPU-only
tests on the machine's GPU instead, in this one process (everything else assumes 8
CPU devices)."""

import os
import sys

# tests in subfolders import the shared single-device reference as `reference`
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# compile-only GPU devices (jaxtp.parallel.targets) where the CUDA plugin is installed:
# the plugin must not insist on a GPU when JAX starts
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# The suite compiles a few hundred small programs for 8 CPU devices. These
# settings cut that time and change nothing a test checks (the HLO, and so
# every collective, is the same):
# - LLVM's optimisation of the generated CPU code is most of each compile;
#   these programs run for milliseconds, so -O0 code is fine;
# - one compilation cache for this session, shared with the train.py
#   processes the tests start (env), so a program compiled twice (a
#   reference, an init, a resumed run's step) is compiled once. It starts
#   empty every session: the suite's time is a cold start's;
# - where the environment turns Python's bytecode files off
#   (PYTHONDONTWRITEBYTECODE), each train.py process the tests start
#   would compile jaxtp's sources again (~0.3 s): one bytecode folder for this
#   session instead, outside the tree
# (Not for the GPU tests, which time real kernels.)
_cpu = not os.environ.get("JAXTP_GPU_TESTS")
if _cpu and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true"
                               # the older elemental emitters compile the
                               # suite's fusions in half the time of the new
                               # (MLIR) fusion emitters
                               " --xla_cpu_use_fusion_emitters=false"
                               # one thread per device program: the two test
                               # workers (pyproject) already fill the cores
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()
if _cpu and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxtp-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
if _cpu and os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    import atexit
    import shutil
    import tempfile

    _pyc = tempfile.mkdtemp(prefix="jaxtp-test-pyc-")
    atexit.register(shutil.rmtree, _pyc, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = _pyc

import jax  # noqa: E402

# (JAXTP_TEST_DEVICES: the 16-device layouts' process, tests/test_sixteen.py)
DEVICES = int(os.environ.get("JAXTP_TEST_DEVICES", "8"))
if _cpu:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES)
    assert jax.device_count() == DEVICES  # start the backend now, so no test can change it


def pytest_collection_modifyitems(items):
    """The fast tier (`-m "not slow"`): a parametrized test that names its
    `fast_cases` (callspec ids) keeps only those out of the slow tier. A name
    that matches none of its cases is an error, not a silently slower tier."""
    import pytest

    ids = {}
    for item in items:
        fast = getattr(getattr(item, "function", None), "fast_cases", None)
        if fast is not None and getattr(item, "callspec", None) is not None:
            ids.setdefault(item.function, set()).add(item.callspec.id)
            if item.callspec.id not in fast:
                item.add_marker(pytest.mark.slow)
    # the longest tests (processes, the bench suite) first, so that the two
    # workers do not end with one of them running a minute alone
    first = ("tests/test_sixteen.py", "tests/bench/", "tests/parallel/test_distributed.py",
             "tests/train/test_loop.py", "tests/train/test_cluster.py")
    items.sort(key=lambda item: not item.nodeid.startswith(first))  # stable
    for fn, seen in ids.items():
        if fn.fast_cases - seen and len(seen) == _cases(fn):
            raise pytest.UsageError(f"{fn.__name__}.fast_cases names no case: "
                                    f"{sorted(fn.fast_cases - seen)}; its cases: {sorted(seen)}")


def _cases(fn) -> int:
    """How many cases a parametrized test has (all of them collected, or -k chose)."""
    import math

    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    return math.prod(len(m.args[1]) for m in marks)
