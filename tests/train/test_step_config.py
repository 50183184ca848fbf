"""StepConfig: the step's settings, checked once, from which every variant is derived."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardax as sx
from shardax.train.verification import _Probe, one_device_mesh


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_make_train_step_keeps_its_settings_normalized_in_one_config(mesh):
    step = sx.make_train_step(loss_fn, mesh=mesh, accumulate=2, data_axis=("data",),
                              precision="fp16", stats=["grad_norm"])  # fmt: skip
    config = step.config
    assert isinstance(config, sx.train.StepConfig)
    assert (config.mesh, config.plan, config.mode, config.accumulate) == (mesh, None, "jit", 2)
    assert config.data_axis == "data" and config.stats == ("grad_norm",)
    assert isinstance(config.precision, sx.Precision) and config.precision.loss_scaling
    assert (step.accumulate, step.data_axis, step.stats) == (2, "data", ("grad_norm",))
    assert step.plan.name == "replicate" and config.resolved_plan.name == "replicate"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "pmap"


def test_eval_and_auto_steps_derive_their_configs(mesh):
    evaluate = sx.make_eval_step(loss_fn, mesh=mesh, precision="fp16", accumulate=2)
    config = evaluate.config
    assert (config.donate, config.stats, config.accumulate) == (False, (), 2)
    assert config.precision.loss_scaling is None and evaluate.donate is False
    train = sx.make_train_step(loss_fn, mesh=mesh, precision="fp16", accumulate=2)
    assert train.config.for_eval() == dataclasses.replace(config, stats_every=1)
    auto = sx.make_train_step(loss_fn, mesh=mesh, plan="auto", accumulate=2)
    assert isinstance(auto.config, sx.train.StepConfig) and auto.config.plan is None
    assert (auto.accumulate, auto.mode, auto.donate) == (2, "jit", True)


def test_replace_checks_again_with_the_doors_messages(mesh):
    config = sx.make_train_step(loss_fn, mesh=mesh).config
    for bad, match in [
        ({"mode": "vmap"}, r"mode must be one of \['jit', 'shard_map', 'pmap', 'single'\], "
                           r"got 'vmap'"),
        ({"accumulate": 0}, "accumulate"),
        ({"mode": "shard_map", "seq_axis": "data"}, "under mode='jit' only; got "
                                                    "mode='shard_map'"),
        ({"data_axis": "model"}, "data_axis 'model' is not in the mesh"),
        ({"donate": "no"}, "donate"),
    ]:  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=match):
            dataclasses.replace(config, **bad)
        with pytest.raises((ValueError, TypeError), match=match):
            sx.make_train_step(loss_fn, **{"mesh": mesh, **bad})
    with pytest.raises(TypeError, match="config or as keywords, not both"):
        sx.train.TrainStep(loss_fn, config, mode="jit")
    with pytest.raises(TypeError, match=r"config must be a sx\.train\.StepConfig, got dict"):
        sx.train.EvalStep(loss_fn, {"mesh": mesh})


def test_a_step_built_from_a_replaced_config_trains_as_one_device(mesh):
    config = sx.make_train_step(loss_fn, mesh=mesh, accumulate=2).config
    step = sx.train.TrainStep(loss_fn, dataclasses.replace(config, mode="single", donate=False))
    assert step.config.mode == "single" and step.config.accumulate == 2
    state = sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"], optax.sgd(0.1))
    x, y = np.arange(48.0).reshape(16, 3) / 48, np.ones(16)
    _, metrics = step(step.shard(state), {"x": x, "y": y})
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(y**2), rtol=1e-6)
    # verify's references are variants of the step's config too, not restated settings.
    mesh1 = one_device_mesh(mesh)
    ref = _Probe.like(step, mesh1).config
    assert (ref.mesh, ref.mode, ref.donate, ref.stats, ref.accumulate) == (
        mesh1,
        "jit",
        False,
        (),
        1,
    )
