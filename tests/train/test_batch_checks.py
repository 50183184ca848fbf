"""The step's batch checks and ``batch_spec`` shardings run once per batch structure
(its tree, leaf types, shapes and dtypes), not on every step."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
import shardax.train.batch_placement as program


def _loss(model, batch):
    return sx.masked_mean(jnp.mean((model(batch["x"]) - batch["y"]) ** 2, -1), batch["mask"])


def _batch(rows=8, mask=None):
    rng = np.random.default_rng(rows)
    return {"x": rng.normal(size=(rows, 4)).astype(np.float32),
            "y": rng.normal(size=(rows, 2)).astype(np.float32),
            "mask": np.ones(rows, bool) if mask is None else mask}  # fmt: skip


def counting(monkeypatch, name):
    calls = []
    real = getattr(program, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(program, name, counted)
    return calls


@pytest.mark.parametrize("batch_spec", [None, P("data")])
def test_batch_checked_and_its_shardings_computed_once_per_structure(monkeypatch, batch_spec):
    import optax
    from flax import nnx

    checks = counting(monkeypatch, "check_batch")
    shardings = counting(monkeypatch, "batch_shardings")
    step = sx.make_train_step(_loss, mesh=sx.make_mesh({"data": -1}), batch_spec=batch_spec)
    state = step.shard(sx.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
    for _ in range(3):
        state, metrics = step(state, _batch())
    state, _ = step(state, _batch(16))  # a new structure: checked once more
    state, _ = step(state, _batch(16))
    assert np.isfinite(float(metrics["loss"]))
    if batch_spec is None:
        assert (len(checks), len(shardings)) == (2, 0)
    else:  # computed for the check and reused to place the batch
        assert (len(checks), len(shardings)) == (0, 2)


def test_a_step_walks_the_batch_once_for_all_its_checks(monkeypatch):
    """The leaf, batch size, mask and examples checks share one walk of the batch
    (``shardax.data.leaves.batch_leaves``), not one walk each."""
    import sys

    import optax
    from flax import nnx

    import shardax.data.leaves as leaves

    walks, real = [], leaves.batch_leaves

    def counted(tree):
        walks.append(tree)
        return real(tree)

    for name, module in list(sys.modules.items()):
        if name.startswith("shardax") and getattr(module, "batch_leaves", None) is real:
            monkeypatch.setattr(module, "batch_leaves", counted)
    # accumulate splits rows as examples: the examples check runs too
    step = sx.make_train_step(_loss, mesh=sx.make_mesh({"data": -1}), accumulate=2)
    state = step.shard(sx.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
    walks.clear()
    state, metrics = step(state, _batch(16))
    assert np.isfinite(float(metrics["loss"]))
    assert len(walks) == 1


def test_an_all_false_host_mask_is_refused_on_every_batch():
    import optax
    from flax import nnx

    step = sx.make_train_step(_loss, mesh=sx.make_mesh({"data": -1}))
    state = step.shard(sx.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"batch\['mask'\] is all False, shape \(8,\)"):
        step(state, _batch(mask=np.zeros(8, bool)))
    state, _ = step(state, _batch())  # the refused structure was not remembered
    with pytest.raises(ValueError, match=r"is all False, shape \(24,\)"):
        step(state, _batch(24, mask=np.zeros(24, bool)))
    # a structure already checked: its mask's values are still read (one pass, no wait)
    with pytest.raises(ValueError, match=r"is all False, shape \(8,\)"):
        step(state, _batch(mask=np.zeros(8, bool)))


@pytest.mark.parametrize("batch_spec", [None, P("data")])
def test_a_host_masks_values_are_read_once_a_step(monkeypatch, batch_spec):
    """On a new structure (checked by ``check_batch``) and on a known one alike."""
    import optax
    from flax import nnx

    import shardax.train.batch as batch_module

    reads = []
    real = batch_module.check_mask_has_examples

    def counted(batch):
        reads.append(1)
        return real(batch)

    monkeypatch.setattr(batch_module, "check_mask_has_examples", counted)
    monkeypatch.setattr(program, "check_mask_has_examples", counted)
    step = sx.make_train_step(_loss, mesh=sx.make_mesh({"data": -1}), batch_spec=batch_spec)
    state = step.shard(sx.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
    for expected in (1, 2):
        state, _ = step(state, _batch())
        assert len(reads) == expected


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_a_device_mask_with_no_real_example_reads_nan_and_the_guard_stops(mode):
    """A device mask is not read back (that would wait for the device): a global batch
    with no real example reports a NaN loss, not an empty mean's 0.0, so the NaN guard
    names the step; its gradients are 0."""
    import jax
    import optax
    from flax import nnx

    step = sx.make_train_step(_loss, mesh=sx.make_mesh({"data": -1}), mode=mode)
    state = step.shard(sx.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
    before = np.asarray(state.params["kernel"])
    state, metrics = step(state, jax.device_put(_batch(mask=np.zeros(8, bool))))
    assert np.isnan(float(metrics["loss"]))
    np.testing.assert_array_equal(np.asarray(state.params["kernel"]), before)
    with pytest.raises(sx.train.NonFiniteLossError, match=r"step 1.*'mask' is all False"):
        sx.train.check_finite(metrics["loss"], step=1)
    # one real example on one device: a finite loss
    mask = np.zeros(8, bool)
    mask[5] = True
    _, metrics = step(state, jax.device_put(_batch(mask=mask)))
    assert np.isfinite(float(metrics["loss"]))
