"""8 fake CPU devices for every test, set before any JAX backend starts.

`JAXTP_GPU_TESTS=1 python -m pytest tests/test_gpu.py` runs the GPU-only
tests on the machine's GPU instead (everything else assumes 8 CPU devices)."""

import os

# compile-only GPU devices (jaxtp.targets) where the CUDA plugin is installed:
# the plugin must not insist on a GPU when JAX starts
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

if not os.environ.get("JAXTP_GPU_TESTS"):
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    assert jax.device_count() == 8  # start the backend now, so no test can change it


def pytest_collection_modifyitems(items):
    """The fast tier (`-m "not slow"`): a parametrized test that names its
    `fast_cases` (callspec ids) keeps only those out of the slow tier."""
    import pytest

    for item in items:
        fast = getattr(getattr(item, "function", None), "fast_cases", None)
        if fast is not None and getattr(item, "callspec", None) is not None \
                and item.callspec.id not in fast:
            item.add_marker(pytest.mark.slow)
