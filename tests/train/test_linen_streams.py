"""A Linen module's extra RNG streams (``self.make_rng("lstm")``) are learned from the
``name`` argument of flax's ``make_rng`` call that raised, not from the wording of flax's
``InvalidRngError`` (shardax.train.model.asked_stream). If flax moves ``make_rng`` or
renames its argument, these tests fail, naming it."""

import zlib

import flax.core
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.errors import InvalidRngError

import shardax as sx
from shardax.train.model import asked_stream


class Noisy(nn.Module):
    stream: str = "lstm"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x) + jax.random.normal(self.make_rng(self.stream), (3,))


class NoisyCell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
        carry = nn.Dense(4)(carry) + jax.random.normal(self.make_rng("lstm"), carry.shape)
        return carry, carry + x


class ScannedDecoder(nn.Module):
    """flax's seq2seq decoder's shape: a cell scanned over time, "lstm" split per step."""

    @nn.compact
    def __call__(self, xs):  # (batch, time, 4)
        scan = nn.scan(
            NoisyCell,
            variable_broadcast="params",
            split_rngs={"params": False, "lstm": True},
            in_axes=1,
            out_axes=1,
        )
        _, ys = scan()(jnp.zeros((xs.shape[0], 4)), xs)
        return ys


def asked_while_traced(fn):
    """The streams ``asked_stream`` reads from each ``InvalidRngError`` that ``fn`` raises
    while traced, as the step calls the model (JAX keeps flax's frames there; outside a
    trace, flax's ``apply`` drops them from the traceback), its message reworded."""
    found = []

    def traced():
        try:
            fn()
        except InvalidRngError as e:
            e.args = ("flax reworded this message",)
            found.append(asked_stream(e))
        return 0

    jax.eval_shape(traced)
    return found


def test_the_stream_is_the_make_rng_argument_not_the_message():
    x = jnp.ones((2, 4))
    variables = Noisy().init({"params": jax.random.key(0), "lstm": jax.random.key(1)}, x)
    assert asked_while_traced(lambda: Noisy().apply(variables, x)) == ["lstm"]
    bound = {"lstm": jax.random.key(2)}
    noise = Noisy(stream="noise")
    assert asked_while_traced(lambda: noise.apply(variables, x, rngs=bound)) == ["noise"]


def test_the_stream_is_found_through_lifted_transforms():
    """Asked for inside nn.scan (flax's seq2seq decoder), under jit as in the step."""
    xs = jnp.ones((2, 3, 4))
    rngs = {"params": jax.random.key(0), "lstm": jax.random.key(1)}
    variables = ScannedDecoder().init(rngs, xs)
    apply = jax.jit(lambda p: ScannedDecoder().apply({"params": p}, xs))
    assert asked_while_traced(lambda: apply(variables["params"])) == ["lstm"]


def test_an_rng_error_of_no_make_rng_call_names_no_stream():
    malformed = {1: jax.random.key(2)}  # flax: rngs should map strings to keys
    assert asked_while_traced(lambda: flax.core.bind({}, rngs=malformed)) == [None]


def test_a_scanned_stream_trains_as_the_documented_key_in_a_loop_of_ones_own(mesh):
    """The scanned decoder's "lstm" is bound to fold_in(step_rng, crc32("lstm")): the
    step's losses equal a plain loop's that passes that key."""
    model, tx, key = ScannedDecoder(), optax.sgd(0.1), jax.random.key(7)
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(8, 3, 4)).astype(np.float32)} for _ in range(2)]
    variables = model.init({"params": jax.random.key(0), "lstm": jax.random.key(1)}, data[0]["x"])

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)

    params, opt_state, want = variables["params"], tx.init(variables["params"]), []
    for i, batch in enumerate(data):
        lstm = jax.random.fold_in(jax.random.fold_in(key, i), zlib.crc32(b"lstm"))

        def loss(p, batch=batch, lstm=lstm):
            out = model.apply({"params": p}, batch["x"], rngs={"lstm": lstm})
            return jnp.mean((out - batch["x"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        want.append(float(value))

    step = sx.make_train_step(loss_fn, mesh=mesh)
    state = step.shard(sx.TrainState.from_linen(model, variables, tx, rng=key))
    got = []
    for batch in data:
        state, metrics = step(state, batch)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, want, rtol=2e-5)
