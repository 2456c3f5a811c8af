"""8 fake CPU devices for every test, set before any JAX backend starts."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8  # start the backend now, so no test can change it
