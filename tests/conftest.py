"""8 fake CPU devices for every test, set before any JAX backend starts."""

import os

# compile-only GPU devices (jaxtp.targets) where the CUDA plugin is installed:
# the plugin must not insist on a GPU when JAX starts
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8  # start the backend now, so no test can change it
