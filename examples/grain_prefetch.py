"""A grain pipeline fed straight into ``sx.prefetch_to_device``, data-parallel on all devices.

    uv run python examples/grain_prefetch.py   # 8 simulated CPU devices without an accelerator

grain is an optional extra: ``pip install 'shardax[grain]'``. The dataset's last batch is
short (1000 = 7 * 128 + 104); ``policy="pad"`` pads it to 128 rows and adds a boolean
``"mask"`` leaf, so the step compiles once and the loss ignores the padding.
"""

import jax
import jax.numpy as jnp
import numpy as np

import shardax as sx

try:
    import grain
except ImportError as e:  # grain is an optional extra
    raise SystemExit(
        "this example needs grain, the 'grain' extra of shardax: pip install 'shardax[grain]'"
    ) from e

jax.config.update("jax_num_cpu_devices", 8)  # only used where there is no accelerator

rng = np.random.default_rng(0)
true_w = rng.normal(size=(16, 1)).astype(np.float32)
features = rng.normal(size=(1000, 16)).astype(np.float32)
records = [{"x": x, "y": x @ true_w} for x in features]

mesh = sx.make_mesh({"data": -1})
params = sx.shard({"w": np.zeros((16, 1), np.float32)}, sx.replicate(mesh))


@jax.jit
def step(params, batch):
    def loss_fn(params):
        err = jnp.sum((batch["x"] @ params["w"] - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])  # padding ignored

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


for epoch in range(3):
    dataset = (
        grain.MapDataset.source(records)
        .shuffle(seed=epoch)
        .map(lambda r: {"x": r["x"], "y": r["y"]})
        .batch(128)  # 7 full batches and one of 104
    )
    with sx.prefetch_to_device(dataset, mesh, policy="pad") as batches:
        for batch in batches:
            params, loss = step(params, batch)
        position = batches.get_state()  # grain's state after the last consumed batch
    print(f"epoch {epoch}: loss {float(loss):.5f}, x sharded as {batch['x'].sharding.spec}")

print("compilations of the step:", step._cache_size())  # 1: the short batch was padded
print("distance to the true weights:", float(np.abs(np.asarray(params["w"]) - true_w).max()))
print("a checkpoint would store the data position:", sorted(position))
