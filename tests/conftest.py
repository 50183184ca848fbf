"""Every test sees 8 simulated CPU devices, set before any JAX backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
