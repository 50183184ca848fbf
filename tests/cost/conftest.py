"""Fixtures shared by the cost tests."""

import functools

import pytest


def gpt_loss(model, batch):
    """The GPT job's loss: next-token cross-entropy over fp32 logits."""
    import jax.numpy as jnp
    import optax

    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.fixture(scope="session")
def abstract_gpt_step():
    """``build(target, config, data)``: a GPT of ``config`` (``gpt.GPTConfig``) and its fsdp
    train step (:func:`gpt_loss`, Adam) on ``data`` compile-only devices of
    ``sx.target(target)``, all abstract (``nnx.eval_shape``): ``(mesh, model, state, step)``.
    Built once per worker for each target and config, however many tests read it; the
    model FLOPs (test_model_flops) and HLO FLOPs (test_estimate) tests build theirs here."""

    @functools.cache
    def build(target: str, config, data: int):
        import optax
        from flax import nnx

        import shardax as sx
        from shardax.models import gpt

        mesh = sx.make_mesh({"data": data}, devices=sx.target(target))
        model = nnx.eval_shape(lambda: gpt.make_gpt(config, 0))
        state = nnx.eval_shape(
            lambda: sx.TrainState.create(gpt.make_gpt(config, 0), optax.adam(1e-4))
        )
        step = sx.make_train_step(gpt_loss, mesh=mesh, plan=gpt.plan(mesh, model, "fsdp"))
        return mesh, model, state, step

    return build
