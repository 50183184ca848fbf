# ruff: noqa: E501  (tables of cases, one per line)
"""Every bad input gets a clear answer: one parametrised test per class of error.

Each case names the call and a piece of the message it must give (the argument, the
rule, the value received). The CLI cases run the real command in subprocesses, started
together, and assert exit code 2, one line on stderr and no traceback.
"""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.checks import as_count, public
from shardax.cli.main import main as cli_main
from shardax.cost.measurements import from_tables
from shardax.cost.memory import estimate
from shardax.runtime.distributed import resolve_coordinates
from shardax.runtime.rendezvous import roll_call


def _pytree_state():
    return sx.TrainState.from_params(
        {"w": jnp.zeros((4, 2))}, lambda p, x: x @ p["w"], optax.sgd(0.1)
    )


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _says(text, expected):
    """``expected`` is ``"sx.<door>: <part>"``: ``text`` starts with the door that the call
    went through and holds ``part`` (or, for a sentence that starts with the door's name
    rather than ``<door>:``, ``text`` starts with all of ``expected``)."""
    door, sep, part = expected.partition(": ")
    if " " in door or not sep:
        assert text.startswith(expected), text
    else:
        assert text.startswith(f"{door}: ") and part in text, text


@contextlib.contextmanager
def raises(error, expected):
    """``pytest.raises(error)`` whose message :func:`_says` ``expected``."""
    with pytest.raises(error) as caught:
        yield caught
    _says(str(caught.value), expected)


# --- integers: NumPy integers pass wherever Python ints do; booleans are not counts -------


def test_numpy_integers_are_counts(mesh):
    assert sx.make_mesh({"data": np.int64(8)}).shape["data"] == 8
    loader = sx.batches({"x": np.ones((16, 2))}, np.int64(4), num_epochs=np.int32(1))
    assert loader.batch_size == 4 and len(list(loader)) == 4
    step = sx.make_train_step(_loss, mesh=mesh, accumulate=np.int64(2))
    assert step.accumulate == 2
    assert sx.fsdp(mesh, min_size=np.int64(1)).specs({"w": np.ones((8, 2))})["w"] == P("data", None)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: sx.batches({"x": np.ones((8, 2))}, True), "sx.batches: batch_size must be an integer >= 1, got True (a bool)"),
        (lambda: sx.batches({"x": np.ones((8, 2))}, 4.0), "sx.batches: batch_size must be an integer >= 1, got 4.0"),
        (lambda: sx.batches({"x": np.ones((8, 2))}, 4, num_epochs=0), "sx.batches: num_epochs (or None for no end) must be"),
        (lambda: sx.make_mesh({"data": True}), "sx.make_mesh: 'data' size must be an integer >= 1 or -1, got True"),
        (lambda: sx.make_mesh({"data": 2.0}), "sx.make_mesh: 'data' size must be an integer >= 1 or -1, got 2.0"),
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh(), accumulate=True), "sx.make_train_step: accumulate must"),
        (lambda: sx.fsdp(sx.make_mesh(), min_size=False), "sx.fsdp: min_size must be an integer >= 0"),
        (lambda: sx.batch_sharding(sx.make_mesh(), batch_axis=-1), "sx.batch_sharding: batch_axis must be an integer >= 0"),
        (lambda: sx.CheckpointManager("/tmp/unused", max_to_keep=0), "sx.CheckpointManager: max_to_keep (or None to keep all) must be an integer >= 1, got 0"),
        (lambda: sx.prefetch_to_device([], buffer_size=True), "sx.prefetch_to_device: buffer_size must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_counts_name_the_argument(call, message):
    with raises(ValueError, message):
        call()


# --- empty inputs: a clear error, never an endless loop or an IndexError -----------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: sx.batches({"x": np.ones((0, 2))}, 4, policy="pad"), "sx.batches: arrays has 0 examples"),
        (lambda: sx.batches({"x": np.ones((3, 2))}, 4, policy="drop"), "sx.batches: leaves no batch"),
        (lambda: sx.batches({}, 4), "sx.batches: arrays has no leaves"),
        (lambda: sx.make_mesh(devices=[]), "sx.make_mesh: devices is empty"),
        (lambda: sx.make_mesh({}), "sx.make_mesh: at least one axis"),
        (lambda: sx.data.replicate_across_devices({"x": np.ones(2)}, devices=[]), "sx.data.replicate_across_devices: devices is empty"),
    ],
)  # fmt: skip
def test_empty_inputs(call, message):
    with raises(ValueError, message):
        call()


def test_batch_larger_than_the_data_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = sx.batches({"x": np.ones((10, 2))}, 64, policy="pad", num_epochs=2)
        assert len(list(loader)) == 2
    assert [str(w.message) for w in caught] == [
        "batches: batch_size 64 is larger than the 10 examples: every batch is 84.4% padding"
    ]


# --- types: the argument, what was expected and what came ---------------------------------


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: sx.make_mesh("data"), TypeError, "sx.make_mesh: mesh spec must be a dict {axis: size} or a list of (axis, size) pairs"),
        (lambda: sx.make_mesh(devices=["cpu"]), TypeError, "sx.make_mesh: devices must be jax.Device objects"),
        (lambda: sx.TrainState.create(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam), TypeError, "sx.TrainState.create: adam looks like an optax factory: call it, e.g. optax.adam(1e-3)"),
        (lambda: sx.shard({"w": np.ones(8)}, sx.batch_sharding(sx.make_mesh())), TypeError, "sx.shard: plan must be a shardax Plan"),
        (lambda: sx.plan.validate({"w": np.ones(8)}, P("data")), TypeError, "sx.plan.validate: plan must be a shardax Plan"),
        (lambda: sx.place_on_device(np.ones(2), "cpu:0"), TypeError, "sx.place_on_device: device must be a jax.Device, got 'cpu:0'"),
        (lambda: sx.distribute_batch({"x": np.ones(8)}, sx.make_mesh()), TypeError, "sx.distribute_batch: sharding must be a jax.sharding.Sharding"),
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh(), plan=sx.batch_sharding(sx.make_mesh())), TypeError, "sx.make_train_step: plan must be a shardax Plan"),
        # found in this branch's own sweep
        (lambda: sx.make_mesh(axis_types="explicit"), TypeError, "sx.make_mesh: axis_types must be a jax.sharding.AxisType"),
        (lambda: sx.fsdp("mesh"), TypeError, "sx.fsdp: mesh must be a jax.sharding.Mesh, got 'mesh'"),
        (lambda: sx.rules(None, []), TypeError, "sx.rules: mesh must be a jax.sharding.Mesh, got None"),
        # third sweep, re-run: the step doors said only the type, with no way out
        (lambda: sx.make_train_step(_loss, mesh="data"), TypeError, "sx.make_train_step: mesh must be a jax.sharding.Mesh, got 'data'. Build one with sx.make_mesh()"),
        (lambda: sx.make_eval_step(_loss, mesh="data"), TypeError, "sx.make_eval_step: mesh must be a jax.sharding.Mesh, got 'data'. Build one with sx.make_mesh()"),
        (lambda: sx.plan.follow_params("fsdp"), TypeError, "sx.plan.follow_params: plan must be a shardax Plan"),
        (lambda: sx.plan.init_sharded(lambda: {"w": jnp.ones(8)}, "fsdp"), TypeError, "sx.plan.init_sharded: plan must be a shardax Plan"),
        (lambda: sx.make_train_step(None, mesh=sx.make_mesh()), TypeError, "sx.make_train_step: loss_fn must be a function loss_fn(model, batch), got None"),
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh()).shard({"w": np.ones(8)}), TypeError, "sx.train.TrainStep.shard: the train step takes a sx.TrainState"),
        (lambda: sx.batches({"x": np.ones(4)}, 2, shuffle="yes"), TypeError, "sx.batches: shuffle must be True or False, got 'yes'"),
        (lambda: sx.save_checkpoint(None, {"w": np.ones(2)}, step=0), TypeError, "sx.save_checkpoint: directory must be a path (str or os.PathLike), got None"),
        (lambda: sx.cost.validate_batch_size(True), ValueError, "sx.cost.validate_batch_size: batch_size must be an integer, got True (a bool)"),
        # compiler_options (issue 40): the setting, a key, a value
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh(), compiler_options="fast"), ValueError, "sx.make_train_step: compiler_options must be 'auto' (shardax's options for the mesh's platform), 'xla' (XLA's defaults) or a dict of XLA options, got 'fast'"),
        (lambda: sx.make_eval_step(_loss, mesh=sx.make_mesh(), compiler_options={"gpu_x": 1}), ValueError, "sx.make_eval_step: compiler_options names XLA options, which start with 'xla_'"),
        (lambda: sx.train.compiler_options("gpu", {"xla_x": None}), TypeError, "sx.train.compiler_options: compiler_options['xla_x'] must be a bool, int, float or str (XLA takes scalars), got None"),
    ],
)  # fmt: skip
def test_wrong_types_name_what_came(call, error, message):
    with raises(error, message):
        call()


# --- batch leaves: mixed sizes refused by every placement function alike; bad leaves named -


MIXED = {"x": np.ones((16, 3), np.float32), "y": np.ones(24, np.float32)}


@pytest.mark.parametrize(
    "place,door",
    [
        (lambda b, mesh: sx.distribute_batch(b, sx.batch_sharding(mesh)), "sx.distribute_batch"),
        (lambda b, mesh: sx.global_batch(b, mesh), "sx.global_batch"),
        (lambda b, mesh: sx.data.shard_batch_dim(b, mesh), "sx.data.shard_batch_dim"),
        (lambda b, mesh: sx.DevicePlacement().distribute_batch(b, sx.batch_sharding(mesh)), "sx.DevicePlacement.distribute_batch"),
        (lambda b, mesh: next(iter(sx.prefetch_to_device([b], mesh))), "sx.data.Prefetcher"),
        (lambda b, mesh: (s := sx.make_train_step(_loss, mesh=mesh))(s.shard(_pytree_state()), b), "sx.train.TrainStep"),
    ],
    ids=["distribute_batch", "global_batch", "shard_batch_dim", "DevicePlacement", "prefetch", "step"],
)  # fmt: skip
def test_mixed_batch_sizes_are_refused_everywhere(place, door, mesh):
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(door)}: batch leaves disagree on the batch size.*'x': \(16, 3\), 'y': \(24,\)",
    ):
        place(MIXED, mesh)


@pytest.mark.parametrize(
    "place,door",
    [
        (lambda b, mesh: sx.distribute_batch(b, sx.batch_sharding(mesh)), "sx.distribute_batch"),
        (lambda b, mesh: sx.global_batch(b, mesh), "sx.global_batch"),
        (lambda b, mesh: sx.place_on_device(b), "sx.place_on_device"),
        (lambda b, mesh: (s := sx.make_train_step(_loss, mesh=mesh))(s.shard(_pytree_state()), b), "sx.train.TrainStep"),
    ],
    ids=["distribute_batch", "global_batch", "place_on_device", "step"],
)  # fmt: skip
def test_string_leaf_is_named_by_path(place, door, mesh):
    batch = {"x": np.ones((8, 4), np.float32), "meta": {"label": np.array(["a"] * 8)}}
    with pytest.raises(
        TypeError, match=rf"^{re.escape(door)}: leaf 'meta/label' has dtype <U1 .*cannot hold"
    ):
        place(batch, mesh)


def test_list_leaves_in_the_step_are_named(mesh):
    step = sx.make_train_step(_loss, mesh=mesh)
    batch = {"x": np.ones((8, 4), np.float32), "y": [0.0] * 8}
    with pytest.raises(
        TypeError, match=r"^sx\.train\.TrainStep: batch leaf 'y/0' is a float .*np.asarray"
    ):
        step(step.shard(_pytree_state()), batch)


# --- plans: a rule that gives no leaf its spec is reported, and warned about once ---------


def _nnx_model():
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(
    "make_plan,tree,needle",
    [
        (lambda m: sx.rules(m, [("wieght", P("data"))]), {"weight": np.ones((8, 2))}, "rules[0] ('wieght', P('data',)) gives no leaf its spec: its regex matches no leaf path"),
        (lambda m: sx.rules(m, [("w", P("data")), ("weight", P(None, "model"))]), {"weight": np.ones((8, 2))}, "rules[1]"),
        (lambda m: sx.from_nnx(m, _nnx_model(), {"embed": None, "mlp": "model"}), {"kernel": {"value": np.ones((16, 8))}}, "annotated variable 'kernel"),
    ],
)  # fmt: skip
def test_rules_that_match_nothing_are_reported(make_plan, tree, needle):
    mesh = sx.make_mesh({"data": 4, "model": 2})
    plan = make_plan(mesh)
    assert any(needle in note for note in sx.plan.validate(tree, plan)), sx.plan.validate(
        tree, plan
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sx.shard(tree, plan)
        sx.shard(tree, plan)  # once per plan
        sx.plan.follow_params(plan)({"params": tree})  # the step's wrapper shares the record
    assert len([w for w in caught if needle in str(w.message)]) == 1


def test_matching_rules_are_quiet():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    plan = sx.rules(mesh, [("^weight$", P("data"))])
    assert sx.plan.validate({"weight": np.ones((8, 2))}, plan) == []


# --- checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda d, s: sx.save_checkpoint(d, s, step=-1), ValueError, "sx.save_checkpoint: checkpoint step must be an integer >= 0, got -1"),
        (lambda d, s: sx.save_checkpoint(d, s, step=True), ValueError, "sx.save_checkpoint: got True (a bool)"),
        (lambda d, s: sx.save_checkpoint(d, s, step=1, data_state={"a": [np.arange(2)]}), TypeError, "sx.save_checkpoint: data_state['a'][0] is a numpy.ndarray, which JSON cannot store"),
        (lambda d, s: sx.save_checkpoint(d, s, step=1, data_state={1: "x"}), TypeError, "sx.save_checkpoint: JSON keys must be strings"),
        (lambda d, s: sx.save_checkpoint(d, {**s, "obj": object()}, step=1), TypeError, "sx.save_checkpoint: leaf['obj'] is a builtins.object"),
        (lambda d, s: sx.save_checkpoint(d, {}, step=1), ValueError, "sx.save_checkpoint: state has no array or number leaf to save, got {}"),
    ],
)  # fmt: skip
def test_bad_saves_write_nothing(tmp_path, call, error, message):
    state = {"w": jnp.ones(4)}
    with raises(error, message):
        call(tmp_path, state)
    assert os.listdir(tmp_path) == []  # no step, no orbax-checkpoint-tmp left behind
    sx.save_checkpoint(tmp_path, state, step=1)  # and the next save works
    assert sx.CheckpointManager(tmp_path).all_steps() == [1]


def test_failed_restore_creates_nothing(tmp_path):
    missing = tmp_path / "does" / "not" / "exist"
    with raises(FileNotFoundError, "sx.restore_checkpoint: no checkpoint directory"):
        sx.restore_checkpoint(missing, like={"w": jnp.ones(2)})
    assert not (tmp_path / "does").exists()


def test_non_array_leaves_are_saved(tmp_path):
    state = {"w": jnp.ones(3), "epoch": 5, "lr": 0.5, "done": True, "name": "run-1"}
    sx.save_checkpoint(tmp_path, state, step=0)
    like = {"w": jnp.zeros(3), "epoch": 0, "lr": 0.0, "done": False, "name": ""}
    restored = sx.restore_checkpoint(tmp_path, like).state
    assert {k: restored[k] for k in ("epoch", "lr", "done", "name")} == {
        "epoch": 5, "lr": 0.5, "done": True, "name": "run-1"
    }  # fmt: skip
    assert type(restored["epoch"]) is int


def test_stray_step_directories_are_skipped_with_a_warning(tmp_path):
    state = {"w": jnp.ones(3)}
    sx.save_checkpoint(tmp_path, state, step=1)
    (tmp_path / "5").mkdir()
    with pytest.warns(UserWarning, match=r"skipping .*5, which is named like a step"):
        restored = sx.restore_checkpoint(tmp_path, like=state)
    assert restored.step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sx.save_checkpoint(tmp_path, state, step=7, max_to_keep=1)
    assert sorted(os.listdir(tmp_path)) == ["5", "7"]  # the stray one is never deleted


# --- multi-process: coordinates checked before JAX; a missing peer is a Python error ------


@pytest.mark.parametrize(
    "args,message",
    [
        (("127.0.0.1:99999", 1, 0), "whose port 99999 is out of range"),
        (("not-an-address", 2, 0), "got 'not-an-address'"),
        (("127.0.0.1:abc", 2, 0), "got '127.0.0.1:abc'"),
        ((":1234", 2, 0), "got ':1234'"),
        (("::1:1234", 2, 0), "IPv6 hosts in brackets"),
        (("127.0.0.1:1234", 2, 2), "process_id must be in [0, num_processes=2), got 2"),
        (("127.0.0.1:1234", 0, 0), "num_processes must be an integer >= 1, got 0"),
        (("127.0.0.1:1234", np.int64(2), True), "process_id must be an integer >= 0, got True"),
    ],
)
def test_malformed_coordinates_are_value_errors(args, message):
    # A helper of sx.initialize's (which names the errors): no prefix of its own.
    with pytest.raises(ValueError, match=rf"^(?!sx\.).*{re.escape(message)}"):
        resolve_coordinates(*args, env={})


def test_launch_environment_is_checked_and_named():
    env = {"SHARDAX_COORDINATOR": "127.0.0.1:0", "SHARDAX_NUM_PROCESSES": "2"}
    with pytest.raises(
        ValueError, match=r"^(?!sx\.).*\(\$SHARDAX_COORDINATOR\) must be 'host:port'"
    ):
        resolve_coordinates(env={**env, "SHARDAX_PROCESS_ID": "0"})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_peer_that_never_joins_is_a_timeout_error(rank):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    with pytest.raises(TimeoutError) as e:
        roll_call(address, "127.0.0.1", port, rank, 2, timeout=1)
    assert address in str(e.value) and "1 s (initialization_timeout)" in str(e.value)
    assert ("never joined" if rank == 0 else "could not reach") in str(e.value)


def _roll_call_in_threads(counts):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    errors = {}

    def one(rank):
        try:
            roll_call(address, "127.0.0.1", port, rank, counts[rank], timeout=20)
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_roll_call_meets_and_names_a_mismatched_process_count():
    assert _roll_call_in_threads([3, 3, 3]) == {}
    errors = _roll_call_in_threads([2, 3])
    assert isinstance(errors[0], ValueError) and isinstance(errors[1], ValueError)
    assert "process 1 was started with num_processes=3, process 0 with 2" in str(errors[1])


# --- the step: params that changed shape after the optimizer was initialised --------------


def test_params_that_changed_shape_name_the_leaf_and_both_shapes(mesh):
    state = sx.TrainState.from_params(
        {"w": jnp.zeros((4, 2))}, lambda p, x: x @ p["w"], optax.adam(1e-3)
    )
    state = state.replace(params={"w": jnp.zeros((5, 2))})
    step = sx.make_train_step(_loss, mesh=mesh)
    batch = {"x": np.ones((8, 5), np.float32), "y": np.ones((8, 2), np.float32)}
    with pytest.raises(
        ValueError, match=r"^sx\.train\.TrainStep: params leaf 'w' has shape \(5, 2\).*\(4, 2\)"
    ):
        step(step.shard(state), batch)


# --- your own loop: the loss contract, donation, sx.prepare, TrainState and nnx.Optimizer -


def _nnx_pair(width=4):
    model = nnx.Linear(width, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _run_twice(mode, loss_fn, reuse):
    """Two steps of ``loss_fn``; with ``reuse`` the second gets the first's (donated) input."""
    mesh = sx.make_mesh({"data": 8})
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
    state = step.shard(_pytree_state())
    batch = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}
    new, _ = step(state, batch)
    step(state if reuse else new, batch)


@pytest.mark.parametrize(
    "call,error,message",
    [
        # a loss parameter the step cannot fill: refused when the step is built
        (lambda: sx.make_train_step(lambda model, batch, rngs: 0.0, mesh=sx.make_mesh()), TypeError, "sx.make_train_step: loss_fn takes 'rngs', which the step cannot fill: it passes (model, batch) and, when loss_fn asks for them by name, 'rng' (one key per example) and 'step_rng' (the step's key). Pass other values through a closure"),
        (lambda: sx.make_train_step(lambda model, batch, *, scale: 0.0, mesh=sx.make_mesh()), TypeError, "sx.make_train_step: loss_fn takes 'scale', which the step cannot fill"),
        # an aux that is not a dict of metrics, under a mode that averages it over devices
        (lambda: _run_twice("shard_map", lambda m, b: (_loss(m, b), m(b["x"])), False), TypeError, "sx.train.TrainStep: with aux an array of shape (1, 2); under mode='shard_map' each device's aux is averaged over the data axis, which is meaningful only for a dict of metrics"),
        # a state whose buffers an earlier step consumed: a Python error, not a segfault
        (lambda: _run_twice("jit", _loss, True), ValueError, "sx.train.TrainStep: the state's buffers were donated to an earlier step, which consumed them: use the state that step returned, or build the step with donate=False"),
        # sx.prepare
        (lambda: sx.prepare(), TypeError, "sx.prepare takes the objects of a training loop"),
        (lambda: sx.prepare(_nnx_pair()[1]), TypeError, "sx.prepare: argument 0 is an nnx.Optimizer, but no NNX model among the arguments has the params it was built for"),
        (lambda: sx.prepare(_nnx_pair(4)[0], _nnx_pair(8)[1]), TypeError, "sx.prepare: argument 1 is an nnx.Optimizer, but no NNX model"),
        (lambda: sx.prepare({"w": np.ones(8)}, mesh=sx.make_mesh({"data": 8}), plan=sx.fsdp(sx.make_mesh({"data": 4}))), ValueError, "sx.prepare: plan 'fsdp' is over mesh {'data': 4}, not mesh {'data': 8}"),
        (lambda: sx.prepare({"w": np.ones(8)}, plan=sx.batch_sharding(sx.make_mesh())), TypeError, "sx.prepare: plan must be a shardax Plan"),
        (lambda: sx.prepare({"w": np.ones(8)}, mesh="data"), TypeError, "sx.prepare: mesh must be a jax.sharding.Mesh, got 'data'. Build one with sx.make_mesh()"),
        # TrainState and an nnx.Optimizer
        (lambda: sx.TrainState.create(_nnx_pair(8)[0], _nnx_pair(4)[1]), ValueError, "sx.TrainState.create: the nnx.Optimizer's state does not match this model's params (wrt=Param): opt_state/0/mu/kernel/value has shape (4, 2), the model's params give (8, 2)"),
        (lambda: sx.TrainState.create({"w": jnp.ones(2)}, _nnx_pair()[1]), TypeError, "sx.TrainState.create: an nnx.Optimizer goes with the NNX module it was built for, got a model of type dict"),
        (lambda: _pytree_state().write_to(_nnx_pair()[0]), TypeError, "sx.TrainState.write_to puts values into an NNX module and its nnx.Optimizer; got a Linear for a state of a ApplyFnModel"),
        (lambda: sx.TrainState.create(*_nnx_pair()).write_to(_nnx_pair()[0], optax.adam(1e-3)), TypeError, "sx.TrainState.write_to: optimizer must be an nnx.Optimizer, got GradientTransformationExtraArgs"),
    ],
    ids=["loss-param", "loss-kwonly", "aux-shard_map", "donated", "prepare-empty", "prepare-no-model", "prepare-other-model", "prepare-mesh", "prepare-plan", "prepare-mesh-type", "create-other-model", "create-not-nnx", "write_to-pytree", "write_to-tx"],
)  # fmt: skip
def test_your_own_loop_refusals(call, error, message):
    with raises(error, message):
        call()


@pytest.mark.parametrize(
    "make_plan,needle",
    [
        (lambda m: sx.from_nnx(m, _linen_variables(), {"mlp": "model"}), "found Flax Linen boxes (nn.Partitioned / nn.LogicallyPartitioned): use sx.from_linen"),
        (lambda m: sx.from_nnx(m, _eqx_model()), "found an Equinox module"),
        (lambda m: sx.from_nnx(m, {"w": np.ones(4)}), "found a plain pytree"),
        (lambda m: sx.from_linen(m, nnx.Linear(2, 2, rngs=nnx.Rngs(0))), "sx.from_linen: no variable of the tree has a sharding annotation, so every leaf gets the default (replicated); found Flax NNX variables, none annotated"),
    ],
    ids=["linen", "equinox", "pytree", "nnx-to-linen"],
)  # fmt: skip
def test_a_tree_with_no_annotations_is_warned_about(make_plan, needle):
    with pytest.warns(UserWarning, match=re.escape(needle)):
        plan = make_plan(sx.make_mesh({"data": 4, "model": 2}))
    assert plan.specs({"w": np.ones((8, 4))})["w"] == P()


def _linen_variables():
    import flax.linen as nn
    import jax

    kernel = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    return {"params": {"kernel": nn.LogicallyPartitioned(kernel, ("embed", "mlp"))}}


def _eqx_model():
    import equinox as eqx
    import jax

    return eqx.nn.Linear(2, 2, key=jax.random.key(0))


# --- the CLI: one line on stderr, exit code 2, no traceback --------------------------------
# Subprocesses for what only a real process shows (the environment read at start, JAX's
# join, orbax at shutdown), started together since each start costs seconds; the other
# options go through the same ``main`` in this process.

SUBPROCESS_CASES = {
    "train --seed -1": (
        ["train", "--seed", "-1"],
        {},
        "--seed: expected an integer >= 0, got '-1'",
    ),
    "SHARDAX_CPU_DEVICES=abc": (
        ["info"],
        {"SHARDAX_CPU_DEVICES": "abc"},
        "$SHARDAX_CPU_DEVICES: expected an integer >= 1, got 'abc'",
    ),
    "SHARDAX_COORDINATOR=x": (
        ["info"],
        {"SHARDAX_COORDINATOR": "x", "SHARDAX_NUM_PROCESSES": "2", "SHARDAX_PROCESS_ID": "0"},
        "($SHARDAX_COORDINATOR) must be 'host:port'",
    ),
    "--resume on an empty dir": (
        ["train", "--resume", "--checkpoint-dir", "{empty}", "--hidden", "8", "--cpu-devices", "2"],
        {},
        "--resume: no checkpoint in --checkpoint-dir",
    ),
}

IN_PROCESS_CASES = {
    "bench --seed -1": (["bench", "--seed", "-1"], "--seed: expected an integer >= 0"),
    "tune-batch --seed -1": (["tune-batch", "--seed", "-1"], "--seed: expected an integer >= 0"),
    "train --cpu-devices 0": (
        ["train", "--cpu-devices", "0"],
        "--cpu-devices: expected an integer >= 1, got 0",
    ),
    "launch -n 0": (
        ["launch", "-n", "0", "--", "true"],
        "-n/--num-processes: expected an integer >= 1, got 0",
    ),
    "launch --heartbeat-timeout 0": (
        ["launch", "-n", "1", "--heartbeat-timeout", "0", "--", "true"],
        "--heartbeat-timeout: expected an integer >= 1",
    ),
    "launch --port 99999": (
        ["launch", "-n", "1", "--port", "99999", "--", "true"],
        "--port: expected a port in 1..65535",
    ),
    "unwritable --run-dir": (
        ["train", "--run-dir", "{file}/runs"],
        "--run-dir {file}/runs: cannot create it, {file} is not a directory",
    ),
    "bench --run-dir a file": (
        ["bench", "--run-dir", "{file}"],
        "--run-dir {file}: exists and is not a directory",
    ),
    "train --checkpoint-dir under a file": (
        ["train", "--checkpoint-dir", "{file}/ck"],
        "--checkpoint-dir {file}/ck: cannot create it",
    ),
    # issue 52: an object-store URL, by its scheme, before the run builds anything
    "train --checkpoint-dir s3://": (
        ["train", "--checkpoint-dir", "s3://bucket/run", "--resume"],
        "--checkpoint-dir s3://bucket/run: the s3:// URL of an object store, not a directory "
        "of a local or mounted file system; shardax does not save to object "
        "stores yet (its writer lock, atomic overwrite and damage checks need a file "
        "system); nor does orbax-checkpoint write s3:// arrays",
    ),
    "train --checkpoint-dir gs://": (
        ["train", "--checkpoint-dir", "gs://bucket/run"],
        "--checkpoint-dir gs://bucket/run: the gs:// URL of an object store, not a directory "
        "of a local or mounted file system; shardax does not save to object "
        "stores yet",
    ),
    # second sweep
    "plan --params inf": (["plan", "--params", "inf"], "--params: expected a finite parameter count >= 1"),
    "plan --device-memory nan": (["plan", "--params", "7e9", "--device-memory", "nan"], "--device-memory: expected a finite GiB > 0"),
    "train --step-timeout inf": (["train", "--step-timeout", "inf"], "--step-timeout: expected a finite number > 0, got 'inf'"),
    "launch --grace inf": (["launch", "-n", "1", "--grace", "inf", "--", "true"], "--grace: expected a finite number >= 0"),
    # third sweep
    "train --compile-cache a file": (["train", "--compile-cache", "{file}"], "--compile-cache {file}: exists and is not a directory; name a directory this user can write (created if missing), or off for none"),
    "train --run-dir of an earlier run": (["train", "--run-dir", "{earlier}"], "--run-dir {earlier}: holds an earlier run (summary.json), which this one would overwrite and mix with its own; pass --resume"),
    "plan --plans ''": (["plan", "--measure", "--plans", ""], "--plans: expected comma-separated plan names such as zero1,fsdp, got ''"),
    "plan --measure --devices": (["plan", "--measure", "--devices", "64"], "--devices 64: only without --measure"),
    "plan --measure --hardware": (["plan", "--measure", "--hardware", "h100"], "--hardware h100: only without --measure"),
    "goodput of a corrupt ledger": (["goodput", "{corrupt}"], "goodput ledger {corrupt}/goodput.json is not a ledger shardax can read: Expecting value"),
    # third sweep, re-run: an empty path (an unset variable) read as the option left out
    "train --checkpoint-dir ''": (["train", "--checkpoint-dir", ""], "argument --checkpoint-dir: expected a path, got '' (an unset variable?); leave the option out for its default"),
    "train --log-dir ''": (["train", "--log-dir", ""], "argument --log-dir: expected a path, got ''"),
    "train --model gpt --data ''": (["train", "--model", "gpt", "--data", ""], "argument --data: expected a path, got ''"),
    "goodput ''": (["goodput", ""], "argument directory: expected a path, got '' (an unset variable?)"),
    "goodput of a negative bucket": (["goodput", "{negative}"], "session 0 bucket 'step' must be a number of seconds >= 0, got -5.0"),
    # fourth sweep: plan --target refuses the options it would ignore (before any compile)
    "plan --target --measure": (["plan", "--target", "8xH100", "--batch", "8", "--measure"], "--measure: not with --target, which compiles the built-in model on the devices at hand"),
    "plan --target --params": (["plan", "--target", "8xH100", "--batch", "8", "--params", "7e9"], "--params 7e+09: not with --target, which sizes the GPT by --layers, --d-model, --heads, --seq-len and --vocab"),
    "plan --target --hardware --devices": (["plan", "--target", "8xH100", "--batch", "8", "--hardware", "tpu_v5p", "--devices", "64"], "--devices 64: not with --target, whose name gives the devices"),
    "plan --target --hardware": (["plan", "--target", "8xH100", "--batch", "8", "--hardware", "tpu_v5p"], "--hardware tpu_v5p: not with --target"),
    "plan --target --precision --param-dtype bf16": (["plan", "--target", "8xH100", "--batch", "8", "--precision", "fp16", "--param-dtype", "bf16"], "--precision fp16: not with --param-dtype bf16, which keeps params and Adam's moments in bf16"),
    "plan --target --plans beside --plan": (["plan", "--target", "8xH100", "--batch", "8", "--plan", "fsdp", "--plans", "zero1,fsdp"], "--plans zero1,fsdp: only with --plan auto (the candidates it ranks), got --plan fsdp"),
    "plan --target --microbatches": (["plan", "--target", "8xH100", "--batch", "8", "--microbatches", "4"], "--microbatches 4: not with --target"),
    "plan --target --run-dir": (["plan", "--target", "8xH100", "--batch", "8", "--run-dir", "{empty}"], "--run-dir {empty}: not with --target, which writes no run directory"),
    "plan --target --hidden": (["plan", "--target", "8xH100", "--batch", "8", "--hidden", "1024"], "--hidden 1024: not with --target, the MLP's width (--measure); the GPT's is --d-model"),
    "plan --target --model mlp": (["plan", "--target", "8xH100", "--batch", "8", "--model", "mlp"], "--target plans the built-in GPT; got --model mlp"),
    "plan --vocab without --target": (["plan", "--params", "7e9", "--vocab", "50000"], "--vocab 50000: only with --target (the GPT compiled for a cluster's devices); without it, this option would be ignored"),
    "plan --measure --tp": (["plan", "--measure", "--tp", "2"], "--tp 2: only with --target"),
    "plan --measure --param-dtype": (["plan", "--measure", "--param-dtype", "bf16"], "--param-dtype bf16: only with --target"),
    # fifth sweep: --tp where it would be ignored or idle, --png where it cannot be written
    "plan --target --tp beside --mesh": (["plan", "--target", "8xH100", "--batch", "8", "--tp", "2", "--mesh", "data=8"], "--tp 2: not with --mesh data=8, which gives the whole mesh; add model=2 to --mesh instead"),
    "plan --target --tp beside --plan fsdp": (["plan", "--target", "8xH100", "--batch", "8", "--tp", "2", "--plan", "fsdp"], "--tp 2: only with --plan fsdp+tp, or --plan auto (which ranks a fsdp+tp candidate); --plan fsdp splits no weight over the model axis"),
    "plan --target --png under a file": (["plan", "--target", "8xH100", "--batch", "8", "--png", "{file}/memory.png"], "--png {file}/memory.png: cannot write it, {file} is not a directory"),
    # issue 50: the network between a target's hosts, refused by name when unknown
    "plan --target --network unknown": (["plan", "--target", "2x8xH100", "--network", "myrinet"], "--network myrinet: network must be one of 'ib-ndr', 'ib-hdr', 'gcp-a3-high', 'gcp-a3-mega', 'gcp-a3-ultra', 'aws-p5-efa', 'aws-p5e-efa', 'ethernet-100g' (or a cloud shape: a3-highgpu-8g, a3-megagpu-8g, a3-ultragpu-8g, p5.48xlarge, p5e.48xlarge, p5en.48xlarge), got 'myrinet'"),
    # issue 52: a run's settings in a file (--config) and key=value overrides, one schema
    "train key=value of an unknown key": (["train", "batchsize=32"], "batchsize=32: unknown key 'batchsize'; did you mean batch_size?"),
    "train key=value of a run's non-setting": (["train", "config=run.yaml"], "config=run.yaml: 'config' is not a setting of a run"),
    "train on/off key=value": (["train", "verify=maybe"], "verify=maybe: verify is on or off: expected true or false"),
    "train --config missing": (["train", "--config", "{empty}/run.yaml"], "--config {empty}/run.yaml: No such file or directory"),
    "train --config of no config suffix": (["train", "--config", "{file}"], "--config {file}: expected a .yaml, .yml, .json, .toml file, got suffix ''"),
    # sixth sweep: two options of which one would be dropped, before anything starts
    "plan --target --memory-fraction beside --device-memory": (["plan", "--target", "8xH100", "--batch", "8", "--memory-fraction", "0.9", "--device-memory", "40"], "--memory-fraction 0.9: not with --device-memory 40, the budget the plan must fit in place of the fraction's share of each device's memory; give one of them"),
    "launch --cpu-devices beside the command's own": (["launch", "-n", "2", "--cpu-devices", "4", "--", "shardax", "train", "--cpu-devices", "8"], "--cpu-devices 4: the command's own --cpu-devices 8 wins in each process, so the 2 processes would drive 2 x 8 = 16 devices; give the count once"),
    # issue 49: a run that shrinks needs the restarts to see a place fail again, then go on
    "launch --min-processes without two restarts": (["launch", "-n", "2", "--min-processes", "1", "--max-restarts", "1", "--", "python", "t.py"], "--min-processes 1 needs --max-restarts 2 or more (got 1): one restart to see a place fail again before the first step, one more to go on with fewer processes"),
    "launch --snapshot-peers without restarts": (["launch", "-n", "2", "--snapshot-peers", "--", "python", "t.py"], "--snapshot-peers needs --max-restarts 1 or more (got 0): snapshots are taken for a restart inside the job"),
    "launch --min-processes above -n": (["launch", "-n", "2", "--min-processes", "3", "--max-restarts", "2", "--", "python", "t.py"], "--min-processes 3: a run cannot shrink to more than the -n 2 processes it starts with; give at most 2"),
}  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "a-file").write_text("not a directory")
    (tmp / "empty").mkdir()
    (tmp / "earlier").mkdir()
    (tmp / "earlier" / "summary.json").write_text("{}")
    for name, text in (("corrupt", "not json"), ("negative", NEGATIVE_LEDGER)):
        (tmp / name).mkdir()
        (tmp / name / "goodput.json").write_text(text)
    names = {"file": "a-file", "empty": "empty", "earlier": "earlier"}
    return {
        name: str(tmp / path)
        for name, path in {**names, "corrupt": "corrupt", "negative": "negative"}.items()
    }


NEGATIVE_LEDGER = '{"version": 1, "sessions": [{"start": 0, "end": 1, "buckets": {"step": -5.0, "startup": 0.5}}]}'


def _one_error_line(err, message):
    assert "Traceback" not in err, err
    assert message in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


@pytest.fixture(scope="module")
def cli_results(paths):
    """Every subprocess case, and ``--help`` with a bad environment, started together."""
    runs = {
        name: ([a.format(**paths) for a in argv], env)
        for name, (argv, env, _) in SUBPROCESS_CASES.items()
    }
    runs["--help"] = (["train", "--help"], {"SHARDAX_CPU_DEVICES": "abc"})
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "shardax", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env, "PYTHONWARNINGS": "ignore"},
        )
        for name, (argv, env) in runs.items()
    }
    return {name: (p.wait(timeout=600), *p.communicate()) for name, p in procs.items()}


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_cli_subprocess_bad_values_are_one_line_and_exit_2(cli_results, paths, name):
    code, _, err = cli_results[name]
    assert code == 2, err
    _one_error_line(err, SUBPROCESS_CASES[name][2].format(**paths))


def test_cli_help_works_with_a_bad_environment(cli_results):
    code, out, err = cli_results["--help"]
    assert code == 0 and "--cpu-devices" in out, err


@pytest.mark.parametrize("name", list(IN_PROCESS_CASES))
def test_cli_bad_options_are_one_line_and_exit_2(capsys, paths, name):
    argv, message = IN_PROCESS_CASES[name]
    try:
        code = cli_main([a.format(**paths) for a in argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    _one_error_line(capsys.readouterr().err, message.format(**paths))


# --- second sweep: every count through checks.py ---------------------------------------


def _counts():
    """``(name, door, call(value))`` for the public doors that take a count: each must take
    a NumPy integer as a Python one and refuse a bool with the one wording, which starts
    with the door (None: a reference model's own check, or no door)."""
    from shardax.models.gpt import GPTConfig, make_gpt

    tiny = {"layers": 1, "d_model": 8, "heads": 2, "max_seq_len": 8, "vocab": 16}
    stacked, x = {"w": jnp.ones((2, 4, 4))}, jnp.ones((4, 4))

    def head(p, h, y):
        return jnp.mean((h - y) ** 2)

    def layer(p, h):
        return h @ p["w"]

    return [
        ("make_mesh size", "sx.make_mesh", lambda v: sx.make_mesh({"data": v * 4 if v is not True else v})),
        ("batches batch_size", "sx.batches", lambda v: sx.batches({"x": np.ones((8, 2))}, v)),
        ("batches seed", "sx.batches", lambda v: sx.batches({"x": np.ones((8, 2))}, 2, seed=v)),
        ("batches num_epochs", "sx.batches", lambda v: sx.batches({"x": np.ones((8, 2))}, 2, num_epochs=v)),
        ("make_train_step accumulate", "sx.make_train_step", lambda v: sx.make_train_step(_loss, mesh=sx.make_mesh(), accumulate=v)),
        ("fsdp min_size", "sx.fsdp", lambda v: sx.fsdp(sx.make_mesh(), min_size=v)),
        ("zero1 min_size", "sx.zero1", lambda v: sx.zero1(sx.make_mesh(), min_size=v)),
        ("prefetch buffer_size", "sx.prefetch_to_device", lambda v: sx.prefetch_to_device([], buffer_size=v)),
        ("pipeline microbatches", "sx.pipeline", lambda v: sx.pipeline(layer, stacked, x, microbatches=v)),
        ("pipeline repeats", "sx.pipeline", lambda v: sx.pipeline(layer, stacked, x, microbatches=2, repeats=v)),
        ("pipeline_1f1b microbatches", "sx.pipeline_1f1b", lambda v: sx.pipeline_1f1b(layer, stacked, x, head, {}, x, microbatches=v)),
        ("bubble microbatches", "sx.parallel.bubble", lambda v: sx.parallel.bubble(2, v)),
        ("moe top_k", "sx.moe", lambda v: sx.moe(x, jnp.ones((4, 2)), layer, {"w": jnp.ones((2, 4, 4))}, top_k=v)),
        ("moe capacity_factor", "sx.moe", lambda v: sx.moe(x, jnp.ones((4, 2)), layer, {"w": jnp.ones((2, 4, 4))}, capacity_factor=v)),
        ("attention scale", "sx.attention", lambda v: sx.attention(*[jnp.ones((2, 8, 2, 4))] * 3, scale=v)),
        ("zigzag context", "sx.parallel.zigzag", lambda v: sx.parallel.zigzag({"x": np.ones((1, 8))}, v)),
        ("zigzag_layout context", "sx.parallel.zigzag_layout", lambda v: sx.parallel.zigzag_layout(v)),
        ("GPTConfig layers", None, lambda v: GPTConfig(**{**tiny, "layers": v})),
        ("GPTConfig heads", None, lambda v: GPTConfig(**{**tiny, "heads": v})),
        ("GPTConfig pipeline_microbatches", None, lambda v: GPTConfig(**tiny, pipeline_microbatches=v)),
        ("GPTConfig window", None, lambda v: GPTConfig(**tiny, window=v)),
        ("GPTConfig experts", None, lambda v: GPTConfig(**tiny, experts=v)),
        ("GPTConfig top_k", None, lambda v: GPTConfig(**tiny, experts=4, top_k=v)),
        ("GPTConfig moe_every", None, lambda v: GPTConfig(**{**tiny, "layers": 2}, experts=2, moe_every=v)),
        ("make_gpt seed", None, lambda v: make_gpt(GPTConfig(**tiny), seed=v)),
        ("LossScaling period", "sx.train.LossScaling", lambda v: sx.train.LossScaling(period=v)),
        ("StepWatchdog timeout", "sx.StepWatchdog", lambda v: sx.StepWatchdog(v).close()),
        ("StepWatchdog exit_code", "sx.StepWatchdog", lambda v: sx.StepWatchdog(5, exit_code=v).close()),
        ("AutoPlanOptions min_size", "sx.AutoPlanOptions", lambda v: sx.AutoPlanOptions(min_size=v)),
        ("AutoPlanOptions device_memory", "sx.AutoPlanOptions", lambda v: sx.AutoPlanOptions(device_memory=v)),
        ("StepClock examples_per_step", "sx.track.StepClock", lambda v: sx.track.StepClock(v)),
        ("profile_steps start", "sx.track.profile_steps", lambda v: sx.track.profile_steps(_loss, "/tmp/sx-unused-profile", v, 3)),
        ("CheckpointManager max_to_keep", "sx.CheckpointManager", lambda v: sx.CheckpointManager("/tmp/sx-unused-ckpt", max_to_keep=v).close()),
        ("validate_batch_size", "sx.cost.validate_batch_size", lambda v: sx.cost.validate_batch_size(v, sx.HardwareType.H100)),
        ("cost.estimate data", None, lambda v: estimate(1e9, data=v)),
    ]  # fmt: skip


@pytest.mark.parametrize("name,door,call", _counts(), ids=[n for n, _, _ in _counts()])
def test_numpy_integers_pass_and_bools_are_refused(name, door, call):
    call(np.int64(2))
    start = "" if door is None else re.escape(door) + ": "
    with pytest.raises(
        ValueError, match=rf"^{start}.*must be an? (integer|finite number).*, got True \(a bool\)"
    ):
        call(True)


# --- second sweep: stage-2 features answer as clearly as the rest -----------------------


def _layer(p, h):
    return jnp.tanh(h @ p["w"])


def _head(p, h, y):
    return jnp.mean((h - y) ** 2)


STACKED, X16 = {"w": jnp.ones((4, 8, 8))}, jnp.ones((16, 8))


@pytest.mark.parametrize(
    "call,error,message",
    [
        # pipelines: inputs checked against each other, shapes named
        (lambda: sx.pipeline(lambda p, h: h[:, :4], STACKED, X16, microbatches=4), ValueError, "sx.pipeline: layer_fn must return h with the structure, shape and dtype of its input (each layer's output is the next one's input); for h float32[16, 8] it returned float32[16, 4]"),
        (lambda: sx.pipeline(lambda p, h: h.astype(jnp.bfloat16), STACKED, X16, microbatches=4), ValueError, "sx.pipeline: it returned bfloat16[16, 8]"),
        (lambda: sx.pipeline("notfn", STACKED, X16, microbatches=4), TypeError, "sx.pipeline: layer_fn must be a function layer_fn(layer_params, h) -> h, got 'notfn'"),
        (lambda: sx.pipeline_1f1b(_layer, STACKED, X16, lambda p, h, y: (h - y) ** 2, {}, X16, microbatches=4), ValueError, "sx.pipeline_1f1b: loss_fn(loss_params, h, targets) must return a scalar"),
        (lambda: sx.pipeline_1f1b(_layer, STACKED, X16, _head, {}, jnp.ones((4, 8)), microbatches=4), ValueError, "sx.pipeline_1f1b: targets have 4 rows but x has 16"),
        (lambda: sx.pipeline_1f1b(_layer, STACKED, X16, _head, {}, X16, microbatches=3), ValueError, "sx.pipeline_1f1b: the batch of x (16 rows) is not divisible by microbatches=3"),
        # precision, the watchdog, the GPT
        (lambda: sx.train.LossScaling(initial="big"), ValueError, "sx.train.LossScaling: initial must be a finite number > 0, got 'big'"),
        (lambda: sx.train.LossScaling(initial=float("inf")), ValueError, "sx.train.LossScaling: initial must be a finite number > 0, got inf"),
        (lambda: sx.train.LossScaling(initial=0.5), ValueError, "sx.train.LossScaling: initial must be >= minimum, got initial=0.5 and minimum=1"),
        (lambda: sx.StepWatchdog(1, exit_code="x"), ValueError, "sx.StepWatchdog: exit_code must be an integer in 0..255, got 'x'"),
        (lambda: sx.StepWatchdog(1, exit_code=300), ValueError, "sx.StepWatchdog: exit_code must be an integer in 0..255, got 300"),
        (lambda: sx.models.gpt.GPTConfig(scan_layers="yes"), TypeError, "GPTConfig.scan_layers must be True or False, got 'yes'"),
        # auto_plan and its options
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), device_memory="80GB"), ValueError, "sx.auto_plan: device_memory must be a finite number > 0, got '80GB' (bytes per device"),
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), candidates={"mine": "fsdpp"}), ValueError, "sx.auto_plan: candidates['mine'] must be one of the known plans ['replicate', 'zero1', 'zero2', 'fsdp']"),
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), candidates={"mine": 7}), TypeError, "sx.auto_plan: candidates['mine'] must be a known plan's name"),
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), candidates={"mine": sx.fsdp(sx.make_mesh({"data": 4}))}), ValueError, "sx.auto_plan: is over mesh {'data': 4}, not auto_plan's mesh {'data': 8}"),
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), tp_rules="w"), TypeError, "sx.auto_plan: tp_rules (or a Plan, or None) must be a list of (regex, PartitionSpec) pairs, got 'w'"),
        (lambda: sx.auto_plan(sx.make_mesh(), _pytree_state(), accumulate=(1, 2)), ValueError, "sx.auto_plan: accumulate=(1, 2) ranks microbatch counts of the train step; pass loss_fn and batch"),
        (lambda: sx.AutoPlanOptions(tp_rules=[("w", "model")]), ValueError, "sx.AutoPlanOptions: tp_rules (or a Plan, or None): rules[0] ('w'): the spec must be a jax.sharding.PartitionSpec"),
        (lambda: sx.AutoPlanOptions(stage_axis=3), TypeError, "sx.AutoPlanOptions: stage_axis must be a mesh axis name, got 3"),
        # plans, remat, masks, metrics
        (lambda: sx.shard(_pytree_state(), sx.zero1(sx.make_mesh(), params="model")), ValueError, "sx.shard: params='model' selects a partial that is not a subtree of arrays of the tree"),
        (lambda: sx.zero1(sx.make_mesh(), params=3), TypeError, "sx.zero1: params must be a '/'-joined path such as 'params' or a function, got 3"),
        (lambda: sx.rules(sx.make_mesh(), "w"), TypeError, "sx.rules: rule_list must be a list of (regex, PartitionSpec) pairs, got 'w'"),
        (lambda: sx.remat("notfn", policy="none"), TypeError, "sx.remat: block must be a function, an NNX module or an Equinox module, got 'notfn'"),
        (lambda: sx.masked_mean([1.0, 3.0], mask=[0.5, 0.5]), TypeError, "sx.masked_mean: mask must be boolean (True for the real entries), got dtype float32"),
        (lambda: (s := sx.make_train_step(_loss, mesh=sx.make_mesh()))(s.shard(_pytree_state()), {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32), "mask": [True] * 8}), ValueError, "sx.train.TrainStep: got a list of shape (8,) (pass np.asarray(...) of it)"),
        (lambda: (s := sx.make_train_step(lambda m, b: (_loss(m, b), {"tag": "x"}), mesh=sx.make_mesh()))(s.shard(_pytree_state()), {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}), TypeError, "sx.train.TrainStep: loss_fn's aux['tag'] must be a number or a numeric array, got str 'x'"),
        # data and the seed's hardware table
        (lambda: sx.batches({"x": np.ones((16, 2))}, 4).set_state({}), ValueError, "sx.data.Batches.set_state: state must hold 'epoch' and 'index'"),
        (lambda: sx.batches({"x": np.ones((16, 2))}, 4).set_state({"epoch": "0", "index": 0}), ValueError, "sx.data.Batches.set_state: state['epoch'] must be an integer >= 0, got '0'"),
        (lambda: sx.cost.validate_batch_size("8", "h100"), ValueError, "sx.cost.validate_batch_size: batch_size must be an integer, got '8'"),
        (lambda: sx.DevicePlacement().validate_batch_size(8.0), ValueError, "sx.DevicePlacement.validate_batch_size: batch_size must be an integer, got 8.0"),
        # tracking
        (lambda: sx.MetricWriter("/tmp/sx-unused-run", config={"mesh": sx.make_mesh()}), TypeError, "sx.MetricWriter: config['mesh'] must be a plain value the sinks can record"),
        (lambda: sx.MetricWriter("/tmp/sx-unused-run", backends="wandb"), TypeError, "sx.MetricWriter: backends must be a list of names such as ['wandb']"),
        (lambda: estimate("7e9"), ValueError, "num_params must be a finite number > 0, got '7e9'"),
    ],
)  # fmt: skip
def test_second_sweep_errors_name_argument_rule_and_value(call, error, message):
    with raises(error, message):
        call()


# --- third sweep: sx.verify's tolerance and reference -------------------------------------


def _verify_step():
    return sx.make_train_step(_loss, mesh=sx.make_mesh())


_XY = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}


def _own_step(params, batch):
    return params, {"loss": jnp.mean(batch["x"] @ params["w"])}


def _doubled_reference(params, batch):  # another structure: a bare (doubled) loss
    return params, 2 * jnp.mean(batch["x"] @ params["w"])


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: sx.verify(_verify_step(), _pytree_state(), _XY, rtol=-1), ValueError, "sx.verify: rtol must be a finite number >= 0, got -1 (a leaf differs above atol + rtol * max|reference leaf|)"),
        (lambda: sx.verify(_verify_step(), _pytree_state(), _XY, rtol=float("nan")), ValueError, "sx.verify: rtol must be a finite number >= 0, got nan"),
        (lambda: sx.verify(_verify_step(), _pytree_state(), _XY, atol=float("inf")), ValueError, "sx.verify: atol must be a finite number >= 0, got inf"),
        (lambda: sx.verify(_verify_step(), _pytree_state(), _XY, rtol="1e-3"), ValueError, "sx.verify: rtol must be a finite number >= 0, got '1e-3'"),
        (lambda: sx.verify(_own_step, {"w": jnp.ones((4, 2))}, _XY, reference=_doubled_reference), ValueError, "sx.verify: reference= must return the structure the distributed step returns"),
    ],
)  # fmt: skip
def test_verify_refuses_a_tolerance_or_reference_it_cannot_judge_by(call, error, message):
    with raises(error, message) as caught:
        call()
    if "structure" in message:  # both structures named
        assert "{'loss': *}" in str(caught.value) and "returned/loss" in str(caught.value)


def test_metric_values_are_checked_when_written(tmp_path):
    with sx.MetricWriter(tmp_path) as writer:
        with pytest.raises(
            TypeError,
            match=r"^sx\.MetricWriter\.write: metric 'loss' must be one number .*got 'abc'",
        ):
            writer.write(1, {"loss": "abc"})
        with pytest.raises(TypeError, match=r"array of dtype float32 with shape \(3,\)"):
            writer.write(1, {"loss": jnp.ones(3)})
        writer.write(np.int64(2), {"a": np.float32(1), "b": jnp.ones(()), "c": np.ones(1)})
    assert '"step": 2' in (tmp_path / "metrics.jsonl").read_text()


def test_profile_steps_under_a_file_is_refused_when_built(paths):
    with pytest.raises(OSError, match=r"profile_steps: directory .*is not writable"):
        sx.track.profile_steps(_loss, paths["file"] + "/profile", 1, 2)


def test_masked_mean_takes_lists_and_an_all_false_mask_is_zero():
    assert float(sx.masked_mean([1.0, 3.0], [True, False])) == 1.0
    assert float(sx.masked_mean([1.0, 3.0], [False, False])) == 0.0


def test_a_rule_that_matches_nothing_warns_through_specs_too():
    plan = sx.rules(sx.make_mesh({"data": 4, "model": 2}), [("wieght", P("data"))])
    with pytest.warns(UserWarning, match=r"rules\[0\] \('wieght'"):
        plan.specs({"weight": np.ones((8, 2))})


# --- second sweep: checkpoints lose no step without a word -------------------------------


def test_one_shot_save_deletes_no_step_it_did_not_write(tmp_path):
    state = {"w": jnp.ones(2)}
    with sx.CheckpointManager(tmp_path, max_to_keep=None) as manager:
        for k in (1, 2, 3, 4):
            manager.save(k, state)
    sx.save_checkpoint(tmp_path, state, step=5)
    assert sx.CheckpointManager(tmp_path).all_steps() == [1, 2, 3, 4, 5]


def test_an_older_step_under_max_to_keep_keeps_what_was_there(tmp_path):
    state = {"w": jnp.ones(2)}
    with sx.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        manager.save(5, state)
        manager.save(6, state)
        with pytest.raises(
            ValueError,
            match=r"^sx\.CheckpointManager\.save: checkpoint step 1 is lower than the 2 steps kept "
            r".*\[5, 6\].*Nothing was written",
        ):
            manager.save(1, state)
        assert manager.all_steps() == [5, 6]
        manager.save(7, state)  # the normal rotation: the lowest goes
        assert manager.all_steps() == [6, 7]
    with sx.CheckpointManager(tmp_path, max_to_keep=3) as manager:
        manager.save(2, state)  # among the 3 highest: kept, nothing newer lost
        assert manager.all_steps() == [2, 6, 7]


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda d: sx.CheckpointManager(""), ValueError, "sx.CheckpointManager: directory must be a non-empty path, got ''"),
        (lambda d: sx.restore_checkpoint("  ", like={"w": jnp.ones(2)}), ValueError, "sx.restore_checkpoint: must be a non-empty path"),
        (lambda d: sx.save_checkpoint(d, {"w": jnp.ones(2)}, step=1, overwrite="no"), TypeError, "sx.save_checkpoint: overwrite must be True or False, got 'no'"),
        (lambda d: sx.CheckpointManager(d, async_save="no"), TypeError, "sx.CheckpointManager: async_save must be True or False, got 'no'"),
    ],
)  # fmt: skip
def test_checkpoint_paths_and_flags(tmp_path, call, error, message):
    with raises(error, message):
        call(tmp_path)
    assert os.listdir(tmp_path) == []


# --- second sweep: the watchdog ends the process even when its report fails -------------


@pytest.mark.timeout(60)
def test_a_watchdog_whose_report_fails_still_ends_the_process():
    code = (
        "import io, time\n"
        "from shardax.runtime.watchdog import StepWatchdog\n"
        "out = io.StringIO(); out.close()\n"  # writing the report raises
        "StepWatchdog(0.5, exit_code=7, file=out).arm(3)\n"
        "time.sleep(20); print('still running')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 7 and "still running" not in proc.stdout, proc
    assert "step 3 did not complete within 0.5 s; reporting it failed" in proc.stderr


@pytest.mark.timeout(60)
def test_a_watchdog_whose_on_fire_hangs_or_raises_still_ends_the_process():
    for on_fire, said in (
        ("lambda step: time.sleep(60)", "on_fire did not return within 0.5 s; exiting without it"),
        ("lambda step: 1 / 0", "on_fire raised ZeroDivisionError('division by zero'); exiting"),
    ):
        code = (
            "import io, time\n"
            "import shardax.runtime.watchdog as w\n"
            "w.ON_FIRE_GRACE = 0.5\n"
            f"w.StepWatchdog(0.5, exit_code=7, file=io.StringIO(), on_fire={on_fire}).arm(3)\n"
            "time.sleep(20); print('still running')\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=50
        )
        assert proc.returncode == 7 and "still running" not in proc.stdout, proc
        assert f"shardax: hang watchdog: {said}" in proc.stderr, proc.stderr


# --- second sweep: the CLI --------------------------------------------------------------


def test_cli_warnings_are_one_line(capsys):
    from shardax.cli.main import one_line_warnings

    with one_line_warnings("shardax train"):
        warnings.simplefilter("always")
        list(sx.batches({"x": np.ones((10, 2))}, 64, policy="pad"))
    err = capsys.readouterr().err
    assert err == (
        "shardax train: warning: batches: batch_size 64 is larger than the 10 examples: "
        "every batch is 84.4% padding\n"
    )


def test_cli_batch_that_does_not_divide_is_a_usage_error():
    from shardax.cli.common import UsageError, check_batch_divides

    check_batch_divides(128, 2, 4)
    with pytest.raises(
        UsageError,
        match=r"--batch-size 128 is not divisible by the 2 data devices × --accumulate 3 = 6; use a multiple of 6, e.g. 126",
    ):
        check_batch_divides(128, 2, 3)


def test_an_eval_step_with_another_plan_than_the_state_names_the_plan(mesh):
    state = sx.TrainState.from_params(
        {"w": jnp.zeros((64, 64))}, lambda p, x: x @ p["w"], optax.sgd(0.1)
    )
    loss = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)  # noqa: E731
    state = sx.make_train_step(loss, mesh=mesh, plan=sx.fsdp(mesh, min_size=1)).shard(state)
    evaluate = sx.make_eval_step(loss, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"^sx\.train\.EvalStep: the state is not placed as this step's plan 'replicate'",
    ):
        evaluate(state, {"x": np.ones((16, 64), np.float32)})


def test_a_batch_committed_elsewhere_is_named_not_the_state(mesh):
    state = sx.TrainState.from_params(
        {"w": jnp.zeros((64, 64))}, lambda p, x: x @ p["w"], optax.sgd(0.1)
    )
    loss = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)  # noqa: E731
    step = sx.make_train_step(loss, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
    other = sx.make_mesh({"data": 4}, devices=mesh.devices.flat[:4])
    batch = sx.distribute_batch({"x": np.ones((16, 64), np.float32)}, sx.batch_sharding(other))
    with pytest.raises(
        ValueError, match=r"^sx\.train\.TrainStep: the batch is committed to other devices"
    ):
        step(step.shard(state), batch)


# --- the door's name: shardax's own errors only, the innermost door, the same object -------


def _step_with(loss_fn, mesh):
    step = sx.make_train_step(loss_fn, mesh=mesh)
    batch = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}
    return lambda: step(step.shard(_pytree_state()), batch)


def test_your_own_errors_and_jaxs_are_not_named(mesh):
    def mine(model, batch):
        raise ValueError("my loss is broken")

    def shapes(model, batch):
        return jnp.mean(model(batch["x"]) + jnp.ones(3))

    with pytest.raises(ValueError) as e:
        _step_with(mine, mesh)()
    assert str(e.value) == "my loss is broken"
    with pytest.raises(ValueError) as e:
        _step_with(shapes, mesh)()
    assert str(e.value).startswith("Incompatible shapes for broadcasting")


def test_the_innermost_door_names_the_error(mesh):
    def attends(model, batch):
        q = jnp.ones((8, 4, 2, 2))
        return jnp.mean(sx.attention(q, q, q, impl="flash")) + _loss(model, batch)

    with raises(ValueError, "sx.attention: impl must be 'auto' or one of"):
        _step_with(attends, mesh)()


def test_a_call_from_the_library_is_named_by_the_door_the_user_called():
    # DeviceMeshManager builds its mesh with sx.make_mesh: the error names the method.
    manager = sx.DeviceMeshManager()
    with raises(ValueError, "sx.DeviceMeshManager.create_hybrid_mesh: Not enough devices"):
        manager.create_hybrid_mesh(data_parallel_size=4, model_parallel_size=4)


def test_a_named_error_is_the_same_object():
    @public("sx.count")
    def count(value):
        try:
            return as_count("n", value)
        except ValueError as e:
            e.add_note("a note")
            raise

    with pytest.raises(ValueError) as caught:
        count(True)
    error = caught.value
    assert error.args == ("sx.count: n must be an integer >= 1, got True (a bool)",)
    assert error.__notes__ == ["a note"] and caught.traceback[-1].name == "as_count"
    with pytest.raises(TypeError, match=r"^\S*count\(\) got an unexpected keyword"):
        count(1, size=2)  # the call never got in: Python's own message


def test_attention_windows_take_numpy_integers_and_refuse_bools():
    q = jnp.ones((2, 8, 2, 4))
    sx.attention(q, q, q, window=(np.int64(2), np.uint8(0)))
    with raises(ValueError, "sx.attention: window must be (left, right), two integers >= 0"):
        sx.attention(q, q, q, window=(True, 0))


# --- third sweep: silently accepted or unclear ------------------------------------------


def _linen_dense():
    import flax.linen as nn

    return nn.Dense(4)


def _donated_state():
    step = sx.make_train_step(_loss, mesh=sx.make_mesh(), donate=True)
    state = step.shard(_pytree_state())
    step(state, {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)})
    return state  # consumed by the step


def _all_false_mask_step():
    step = sx.make_train_step(
        lambda m, b: sx.masked_mean(jnp.mean((m(b["x"]) - b["y"]) ** 2, -1), b["mask"]),
        mesh=sx.make_mesh(),
    )
    batch = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}
    return step(step.shard(_pytree_state()), {**batch, "mask": np.zeros(8, bool)})


def _zigzag_for_4_on_context_2():
    q, _ = sx.parallel.zigzag(jnp.ones((2, 16, 2, 4)), 4)
    with jax.set_mesh(sx.make_mesh({"data": 4, "context": 2})):
        return jax.jit(lambda q: sx.attention(q, q, q, causal=True, layout="zigzag:4"))(q)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: sx.prepare(_linen_dense()), TypeError, "sx.prepare: objects[0] is the Linen module Dense, which holds no arrays: pass its variables"),
        (lambda: sx.prepare(object(), 42, "text"), TypeError, "sx.prepare: objects[0] must be a model, an optimizer or its state, a train state, a pytree of arrays or an iterable of batches, got object"),
        (lambda: sx.prepare({"w": jnp.ones(2)}, 42), TypeError, "sx.prepare: objects[1] must be a model, an optimizer or its state, a train state, a pytree of arrays or an iterable of batches, got int 42"),
        (lambda: sx.moe(jnp.ones((8, 4)), jnp.ones((4, 2)), lambda p, t: jnp.sum(t @ p), jnp.ones((2, 4, 4))), ValueError, "sx.moe: expert_fn must map one expert's tokens (n, d) to outputs (n, d_out), got outputs of shape () for tokens of shape"),
        (lambda: sx.moe(jnp.ones((8, 4)), jnp.ones((4, 2)), lambda p, t: (t @ p, t @ p), jnp.ones((2, 4, 4))), TypeError, "sx.moe: expert_fn must map one expert's tokens (n, d) to one array of outputs (n, d_out), got tuple of 2"),
        (lambda: sx.save_checkpoint("/tmp/sx-unused-ckpt", _donated_state(), step=1), ValueError, "sx.save_checkpoint: state leaf 'params/w' (and 2 more) has been deleted: its buffer was donated to a step"),
        # an empty path: the working directory, or (Ledger) no file, without a word
        (lambda: sx.MetricWriter(""), ValueError, "sx.MetricWriter: run_dir must be a non-empty path, got '' (use '.' for the working directory)"),
        (lambda: sx.MetricWriter("/tmp/sx-unused-run", log_dir=""), ValueError, "sx.MetricWriter: log_dir must be a non-empty path, got ''"),
        (lambda: sx.compile_cache(""), ValueError, "sx.compile_cache: directory must be a non-empty path, got ''"),
        (lambda: sx.track.Ledger(""), ValueError, "sx.track.Ledger: path must be a non-empty path, got '' (None keeps the ledger in memory)"),
        (lambda: sx.track.profile_steps(_loss, "", 1, 2), ValueError, "sx.track.profile_steps: directory must be a non-empty path, got ''"),
        (_all_false_mask_step, ValueError, "sx.train.TrainStep: batch['mask'] is all False, shape (8,): the batch has no real example"),
        (_zigzag_for_4_on_context_2, ValueError, "sx.attention: layout='zigzag:4' says the sequence was reordered for 4 devices of axis 'context', but it has size 2 here; reorder with sx.parallel.zigzag(batch, 2) and pass layout='zigzag:2'"),
        (lambda: sx.attention(*[jnp.ones((2, 8, 2, 4))] * 3, scale=-1.0), ValueError, "sx.attention: scale must be a finite number > 0, got -1.0"),
        (lambda: sx.attention(*[jnp.ones((2, 8, 2, 4))] * 3, segment_ids=jnp.zeros((2, 8))), TypeError, "sx.attention: segment_ids must be integers (one id per token; a query sees the keys of its own id), got dtype float32; cast them with .astype(jnp.int32)"),
        (lambda: sx.attention(*[jnp.ones((2, 8, 2, 4))] * 3, layout="zigzag:0"), ValueError, "sx.attention: layout must be one of ['contiguous', 'zigzag'] or 'zigzag:C' with C an integer >= 1 (the context axis size the batch was reordered for, sx.parallel.zigzag_layout(C)), got 'zigzag:0'"),
    ],
)  # fmt: skip
def test_third_sweep_errors_name_argument_rule_and_value(call, error, message):
    with raises(error, message):
        call()
    assert not os.path.exists("/tmp/sx-unused-ckpt/1")


def test_prepare_passes_an_empty_optimizer_state():
    params = {"w": jnp.ones((8, 4))}
    placed, opt_state = sx.prepare(params, optax.sgd(0.1).init(params))
    assert placed["w"].sharding.is_fully_replicated and opt_state == optax.sgd(0.1).init(params)


def test_compile_cache_under_a_file_is_refused_before_jax_is_touched(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    (tmp_path / "f").write_text("")
    with raises(
        NotADirectoryError,
        "sx.compile_cache: directory must be a directory for the compiled programs, got",
    ):
        sx.compile_cache(tmp_path / "f")
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "Expecting value"),
        ('{"sessions": [{"buckets": {"step": -1}}]}', "session 0 bucket 'step' must be a number of seconds >= 0, got -1"),
        ('{"sessions": [{"buckets": {"step": NaN}}]}', "session 0 bucket 'step' must be a number of seconds >= 0, got nan"),
        ('{"sessions": [{"buckets": {"stepz": 1}}]}', "session 0 has bucket 'stepz', not one of"),
        ('{"sessions": [{}]}', 'session 0 has no "buckets" object'),
        ("[]", 'it must be a JSON object with a "sessions" list'),
    ],
)  # fmt: skip
def test_an_unreadable_goodput_ledger_is_named_with_the_way_out(tmp_path, text, message):
    from shardax.track.goodput import FILE

    (tmp_path / FILE).write_text(text)
    with raises(
        ValueError,
        f"sx.track.Ledger: goodput ledger {tmp_path / FILE} is not a ledger shardax can read: {message}",
    ):
        sx.track.Ledger(tmp_path / FILE)
    with pytest.raises(ValueError, match="Delete it \\(or move it aside\\) to start a new one"):
        sx.track.Ledger(tmp_path / FILE)


def test_gpt_resume_with_another_batch_size_is_refused_naming_the_option():
    from shardax.data.text import LMBatches

    data = np.arange(4096, dtype=np.uint8)
    saved = LMBatches(data, 16, 32, seed=0).get_state()
    with pytest.raises(
        ValueError,
        match=r"^the checkpoint was saved with --batch-size 16, but this run has --batch-size 32",
    ):
        LMBatches(data, 32, 32, seed=0).set_state(saved)
    LMBatches(data, 16, 32, seed=0).set_state({"step": 3})  # a state saved before these keys


# --- fourth sweep: the outside programs' patterns, refused by name ------------------------


def _graphs_tuple():
    import collections

    fields = "nodes edges receivers senders globals n_node n_edge"
    return collections.namedtuple("GraphsTuple", fields)(*[np.zeros((8, 4), np.float32)] * 7)


def _graph_step(**how):
    mesh = sx.make_mesh({"data": -1})
    step = sx.make_train_step(lambda model, g: jnp.mean(model(g.nodes)), mesh=mesh, **how)
    return step, step.shard(_pytree_state())


def _pmap_era_batchnorm():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, axis_name="model")(nn.Dense(2)(x))

    mesh = sx.make_mesh({"data": 4, "model": 2})
    x = np.ones((8, 2), np.float32)
    step = sx.make_train_step(lambda model, b: jnp.mean(model(b["x"])), mesh=mesh)
    variables = Net().init(jax.random.key(0), x)
    return step(step.shard(sx.TrainState.from_linen(Net(), variables, optax.sgd(0.1))), {"x": x})


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: (lambda s: s[0](s[1], _graphs_tuple()))(_graph_step(mode="shard_map")), ValueError, "sx.train.TrainStep: the batch is a graph batch (GraphsTuple: nodes, edges and graphs), whose rows are not examples, but mode='shard_map' splits"),
        (lambda: (lambda s: s[0](s[1], {"g": _graphs_tuple()}))(_graph_step(accumulate=2)), ValueError, "sx.train.TrainStep: batch leaf 'g' is a graph batch"),
        (_pmap_era_batchnorm, ValueError, "sx.train.TrainStep: BatchNorm 'BatchNorm_0' has axis_name='model', but 'model' is a mesh axis (the mesh's axes: ['data', 'model'])"),
    ],
)  # fmt: skip
def test_fourth_sweep_outside_programs_are_refused_by_name(call, error, message):
    with raises(error, message):
        call()


# --- fourth sweep: sx.loop, refused when the run is made or when a step is handed ---------


def _loop(directory, body=None, steps=2, **kwargs):
    """A run of ``steps`` steps of a two-number state over ``directory`` (None: no
    checkpoints); ``body(run, state)`` is each step's (default: hand the state and a loss)."""
    body = body or (lambda run, state: run.after_step(state, jnp.float32(1.0)))
    with sx.loop.run({"w": jnp.ones(2)}, checkpoints=directory, goodput=False, **kwargs) as run:
        for _ in run.batches(range(steps)):
            body(run, {"w": run.state["w"] + 1})
    return run


class _LoopPaths:
    """The directories a row asks for: a file, a path under it, an earlier run's
    checkpoints, and a read-only directory (made on first use; skipped where it cannot be)."""

    def __init__(self, tmp_path, request):
        self.tmp, self.request = tmp_path, request
        self.file = tmp_path / "file"
        self.file.write_text("")

    @property
    def earlier(self):
        _loop(self.tmp / "earlier", steps=1)
        return self.tmp / "earlier"

    @property
    def read_only(self):
        return self.request.getfixturevalue("read_only_directory")


@pytest.fixture
def read_only_directory(tmp_path):
    """A directory this process cannot write: chmod for a user; for root, whom chmod does
    not stop, a read-only tmpfs (skipped where mounting is not allowed)."""
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o555)
        yield tmp_path / "ro"
        os.chmod(tmp_path / "ro", 0o755)
        return
    (tmp_path / "mnt").mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(tmp_path / "mnt")]
    )
    if made.returncode != 0:
        pytest.skip("root without the right to mount a tmpfs: no read-only directory")
    try:
        yield tmp_path / "mnt"
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "mnt")])


@pytest.mark.parametrize(
    "call,error,message",
    [
        # sx.loop.run's arguments, checked when the run is made (before any step)
        (lambda d: sx.loop.run({}, every=5), TypeError, "sx.loop.run: every must be a dict of the steps between actions, with the keys ['save', 'eval', 'log'] (e.g. every={'save': 1000, 'log': 50}), got 5"),
        (lambda d: sx.loop.run({}, resume="no"), TypeError, "sx.loop.run: resume must be True or False, got 'no'"),
        (lambda d: sx.loop.run({}, evaluate={"accuracy": 1.0}), TypeError, "sx.loop.run: evaluate must be a function state -> {name: number}, got {'accuracy': 1.0} (a builtins.dict)"),
        (lambda d: sx.loop.run({}, checkpoints=d.file), NotADirectoryError, "sx.loop.run: checkpoints must be a directory, got {file}, which is a file"),
        (lambda d: sx.loop.run({}, checkpoints=d.file / "ckpt"), NotADirectoryError, "sx.loop.run: checkpoints must be a directory, got {file}/ckpt, which cannot be made: {file} is a file"),
        (lambda d: sx.loop.run({}, checkpoints=d.read_only / "ckpt"), PermissionError, "sx.loop.run: checkpoints must be a directory this process can write, got {read_only}/ckpt; {read_only}, where it would be made, is "),
        # no run lost: a fresh run over an earlier run's steps, a state never handed, the
        # metrics in the state's place, a vector loss, (loss, aux) with an array aux, late
        (lambda d: _loop(d.earlier, resume=False), ValueError, "sx.loop.Run: the checkpoint directory {tmp}/earlier already holds checkpoints (steps 1) of an earlier run: a run started afresh would save its steps among them and a resume would take the newest, whichever run it is from. Pass resume=True to continue from them, or choose an empty directory"),
        (lambda d: _loop(d.tmp / "c", lambda run, state: None), RuntimeError, "sx.loop.Run: the loop took 2 batches (steps 1..2) but never called run.after_step(state, metrics), so the run never had a state of theirs: nothing was saved at the end"),
        (lambda d: _loop(d.tmp / "c", lambda run, state: run.after_step({"loss": 1.0})), TypeError, "sx.loop.Run.after_step: state must be the run's state, a dict with keys ['w'] as the run started, got a dict with keys ['loss'] (it lacks the run's leaf 'w'); call run.after_step(state, metrics) with the state the step returned"),
        (lambda d: _loop(None, lambda run, state: run.after_step(state, {"loss": [np.nan, 1.0]})), ValueError, "sx.loop.Run.after_step: metrics['loss'] must be a scalar (one number per step, which the run logs and, for the loss, checks finite), got shape (2,); reduce it (jnp.mean)"),
        (lambda d: _loop(None, lambda run, state: run.after_step(state, (1.0, [0.5]))), TypeError, "sx.loop.Run.after_step: metrics (loss, aux) must have a dict of scalar metrics as aux, got aux [0.5] (a builtins.list); pass the loss alone, or a dict of scalars {'loss': loss, ...}"),
        (lambda d: _loop(None).after_step({"w": jnp.ones(2)}, 1.0), RuntimeError, "sx.loop.Run.after_step: the run has ended (its with block was left at step 2): run.after_step() after it would count, save or log nothing. Call it inside the block"),
    ],
    ids=["every-int", "resume-str", "evaluate-dict", "ckpt-file", "ckpt-under-file", "ckpt-read-only", "fresh-over-earlier", "never-handed", "metrics-as-state", "vector-loss", "loss-aux-array", "after-the-block"],
)  # fmt: skip
def test_fourth_sweep_loop_refusals(tmp_path, request, call, error, message):
    paths = _LoopPaths(tmp_path, request)
    with pytest.raises(error) as caught:
        call(paths)
    fill = {"{file}": paths.file, "{tmp}": tmp_path}
    if "{read_only}" in message:
        fill["{read_only}"] = paths.read_only
    for name, path in fill.items():
        message = message.replace(name, str(path))
    _says(str(caught.value), message)
    assert [s for s in (tmp_path / "c").glob("*") if s.name.isdigit()] == []  # nothing saved


@pytest.mark.parametrize(
    "body,message",
    [
        (lambda run: list(run.batches(iter([]))), "sx.loop.Run.batches: the loader gave no batch, so this loop ran 0 steps (the run is at step 0): it is empty or exhausted (an iterator a loop before used up); pass a new one"),
        (lambda run: [run.after_step({"w": jnp.ones(2)}, 1.0) for _ in run.batches(range(3), steps=1)] + list(run.batches(range(3))), "sx.loop.Run.batches: the run is at step 1 of steps=1, so this loop gets no batch; pass a larger steps= to train further"),
    ],
    ids=["exhausted-loader", "second-loop"],
)  # fmt: skip
def test_fourth_sweep_loop_says_when_a_loop_gets_no_batch(body, message):
    with (
        pytest.warns(UserWarning, match=re.escape(message)),
        sx.loop.run({"w": jnp.ones(2)}, goodput=False) as run,
    ):
        body(run)


# --- fourth sweep: targets, estimates, the step's doors, keep_plan, moe -------------------


def _estimate_with(**given):
    step = sx.make_train_step(_loss, mesh=sx.make_mesh())
    abstract = {
        "x": jax.ShapeDtypeStruct((8, 4), jnp.float32),
        "y": jax.ShapeDtypeStruct((8, 2), jnp.float32),
    }
    return sx.estimate(step, jax.eval_shape(_pytree_state), abstract, **given)


_XY = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)}


def _abstract_state_in_a_step():
    step = sx.make_train_step(_loss, mesh=sx.make_mesh())
    return step(jax.eval_shape(_pytree_state), _XY)


def _verify_with_an_abstract_batch():
    step = sx.make_train_step(_loss, mesh=sx.make_mesh())
    return sx.verify(
        step, _pytree_state(), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _XY)
    )


def _eqx_state_of_another_model():
    import equinox as eqx

    class Norm(eqx.Module):
        bn: eqx.nn.BatchNorm

        def __init__(self):
            self.bn = eqx.nn.BatchNorm(2, "batch", mode="ema")

    class Other(Norm):
        pass

    model, _ = eqx.nn.make_with_state(Norm)()
    _, other = eqx.nn.make_with_state(Other)()
    return sx.TrainState.create(model, optax.sgd(0.1), state=other)


def _eqx_state_of_a_same_named_model_of_another_width():
    import equinox as eqx

    class Norm(eqx.Module):
        bn: eqx.nn.BatchNorm

        def __init__(self, width):
            self.bn = eqx.nn.BatchNorm(width, "batch", mode="ema")

    model, _ = eqx.nn.make_with_state(Norm)(4)
    _, wider = eqx.nn.make_with_state(Norm)(8)
    return sx.TrainState.create(model, optax.sgd(0.1), state=wider)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: _estimate_with(tokens=-256), ValueError, "sx.estimate: tokens (per step) must be a finite number > 0, got -256"),
        (lambda: _estimate_with(links={"intra-host": 0}), ValueError, "sx.estimate: links['intra-host'] (bytes/s) must be a finite number > 0, got 0"),
        (lambda: _estimate_with(links={"nvlink": 1.0}), ValueError, "sx.estimate: links names 'nvlink', which is not a link; the links are 'intra-host', 'inter-host', 'inter-slice' ('intra-host': NVLink or ICI"),
        (lambda: sx.target("2x8xH100", network="myrinet"), ValueError, "sx.target: network must be one of 'ib-ndr', 'ib-hdr', 'gcp-a3-high', 'gcp-a3-mega', 'gcp-a3-ultra', 'aws-p5-efa', 'aws-p5e-efa', 'ethernet-100g' (or a cloud shape: a3-highgpu-8g, a3-megagpu-8g, a3-ultragpu-8g, p5.48xlarge, p5e.48xlarge, p5en.48xlarge), got 'myrinet'"),
        (lambda: sx.target("2x16xH100"), ValueError, "sx.target: name '2x16xH100' puts 16 H100 GPUs on one host, but an HGX/DGX H100 host (one NVLink domain, the server the datasheet's figures describe) holds at most 8; write '32xH100' (4 hosts of 8)"),
        (_abstract_state_in_a_step, TypeError, "sx.train.TrainStep: the state holds abstract values (jax.ShapeDtypeStruct), and a step runs on arrays: build the state with step.init(...)"),
        (_verify_with_an_abstract_batch, TypeError, "sx.verify: batch holds abstract values (jax.ShapeDtypeStruct at ['x']: float32[8, 4]), and sx.verify runs the step and its one-device reference on values: pass concrete ones"),
        (lambda: sx.make_train_step(_loss, config=sx.train.StepConfig(mesh=sx.make_mesh()), accumulate=2), TypeError, "sx.make_train_step: config holds the step's settings, so accumulate=2 beside it would conflict with them: set them in the config (dataclasses.replace(config, accumulate=...))"),
        (lambda: sx.make_train_step(_loss, config="fsdp"), TypeError, "sx.make_train_step: config must be a sx.train.StepConfig"),
        (_eqx_state_of_another_model, ValueError, "sx.TrainState.create: state is not the model's eqx.nn.State: the model's stateful layer 'Norm.bn.ema_first_time_index' has no entry in it"),
        (_eqx_state_of_a_same_named_model_of_another_width, ValueError, "sx.TrainState.create: state is not the model's eqx.nn.State: its entry for the stateful layer 'Norm.bn.ema_state_index' holds arrays of shapes [(8,), (8,)], and the model's BatchNorm has input_size 4"),
    ],
)  # fmt: skip
def test_fourth_sweep_errors_name_argument_rule_and_value(call, error, message):
    with raises(error, message):
        call()


def test_fourth_sweep_inputs_that_now_work(mesh):
    config = sx.train.StepConfig(mesh=mesh, accumulate=2)  # as sx.auto_plan takes it
    assert sx.make_train_step(_loss, config=config).config == config
    assert sx.make_train_step(_loss, config=config, plan="auto").config.accumulate == 2
    assert sx.make_eval_step(_loss, config=config).accumulate == 2
    assert sx.keep_plan() is sx.keep_plan  # @sx.keep_plan() as @sx.keep_plan
    y, aux = sx.moe(
        jnp.zeros((0, 4)), jnp.ones((4, 2)), lambda p, h: h @ p, jnp.ones((2, 4, 4)), top_k=1
    )
    assert y.shape == (0, 4) and [float(v) for v in aux[:3]] == [0.0, 0.0, 0.0]  # was NaN


def test_keep_plan_on_a_step_with_nothing_placed_says_so():
    @jax.jit
    @sx.keep_plan
    def train_step(w, x):
        return w * x

    with pytest.warns(UserWarning, match=r"^sx.keep_plan: train_step holds nothing: none of its arguments or outputs was placed by sx.prepare"):  # fmt: skip
        train_step(jnp.ones(2), jnp.ones(2))


def _on_target(loss_fn=_loss):
    return sx.make_train_step(loss_fn, mesh=sx.make_mesh({"data": 8}, devices=sx.target("8xH100")))


def _printing_loss(model, batch):
    loss = _loss(model, batch)
    jax.debug.print("loss {}", loss)
    return loss


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: _on_target().shard(_pytree_state()), ValueError, "sx.train.TrainStep.shard: shard(state) runs on arrays, and the step's mesh is of compile-only devices (8 x NVIDIA H100 80GB HBM3, from sx.target), which hold no arrays and run nothing: compile the step for abstract inputs"),
        (lambda: _on_target()(_pytree_state(), _XY), ValueError, "sx.train.TrainStep: step(state, batch) runs on arrays, and the step's mesh is of compile-only devices"),
        (lambda: sx.verify(_on_target(), _pytree_state(), _XY), ValueError, "sx.verify: verifying the step runs on arrays, and the step's mesh is of compile-only devices"),
        (lambda: sx.estimate(_on_target(_printing_loss), jax.eval_shape(_pytree_state), jax.eval_shape(lambda: _XY)), RuntimeError, "sx.estimate: the step calls back to the host (jax.debug.print, jax.debug.callback, jax.pure_callback or io_callback in the loss or model)"),
    ],
)  # fmt: skip
def test_fourth_sweep_compile_only_targets_say_what_to_do(call, error, message):
    with raises(error, message):
        call()


_HOLD_LIBTPU = "from jax.experimental import topologies as t; t.get_topology_desc('v5p:2x2x1', platform='tpu'); print('held', flush=True); input()"
_BESIDE_IT = """
import shardax as sx
from shardax.cost import plugins as ct
attached, ct.tpu_chips_attached = ct.tpu_chips_attached, lambda: True
try:
    sx.target("v5p-8")
except RuntimeError as e:
    print(e)
ct.tpu_chips_attached = attached
print(sx.target("v5p-8"))
"""


@pytest.mark.compile_only("tpu")
@pytest.mark.timeout(120)
def test_libtpu_loaded_by_another_process_is_met_by_shardax():
    """Where another process holds libtpu's lock: on a machine with TPU chips (faked),
    shardax's message (never libtpu's `sudo rm` of a live lock); without (this one), the
    compile-only target loads beside it."""
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LIBTPU], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-c", _BESIDE_IT], capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    refused, target = second.stdout.splitlines()[:2]
    _says(
        refused,
        "sx.target: target 'v5p-8' loads libtpu, which refused: another process on this machine has loaded it and holds its lock /tmp/libtpu_lockfile",
    )
    assert "do not delete the file" in refused and "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in refused
    assert target.startswith("Target('v5p-8'"), second.stderr


# --- fifth sweep: the stage-4 features again, each case the fourth sweep did not name ------


def _in_run(body):
    """``body(run)`` inside a run of a two-number state with no checkpoints."""
    with sx.loop.run({"w": jnp.ones(2)}, goodput=False) as run:
        return body(run)


@pytest.mark.parametrize(
    "call,error,message",
    [
        # sx.loop.run's arguments, checked when the run is made
        (lambda d: sx.loop.run({}, writer=123), TypeError, "sx.loop.run: writer must be a sx.MetricWriter (or any object with write(step, metrics)) or a directory for one (str or os.PathLike), got 123"),
        (lambda d: sx.loop.run({}, writer=d.file), NotADirectoryError, "sx.loop.run: writer must be a directory, got {file}, which is a file"),
        (lambda d: sx.loop.run(None, checkpoints=d.tmp / "c"), ValueError, "sx.loop.run: state has no array or number leaf to save, got None, and checkpoints= saves the state"),
        (lambda d: sx.loop.run({"w": jnp.ones(2)}, every={"save": 2}), ValueError, "sx.loop.run: every['save']=2 schedules saves, but checkpoints= is not given, so nothing would be saved: pass checkpoints=, or drop 'save'"),
        (lambda d: sx.loop.run({"w": jnp.ones(2)}, every={"eval": 2}), ValueError, "sx.loop.run: every['eval']=2 schedules evaluations, but evaluate= is not given, so nothing would be evaluated"),
        # the run's methods: a loader or mesh that is not one, a step handed twice, a
        # state whose leaves a resume could not restore into, evaluate's result, re-entry
        (lambda d: _in_run(lambda run: run.batches(5)), TypeError, "sx.loop.Run.batches: loader must be an iterable of batches (a list, a generator, sx.batches(...), a data loader), got 5"),
        (lambda d: _in_run(lambda run: run.batches(range(2), "data")), TypeError, "sx.loop.Run.batches: mesh must be a jax.sharding.Mesh (sx.make_mesh) or a jax.sharding.Sharding to place the batches on, or None to take them as they come, got 'data'"),
        (lambda d: _loop(d.tmp / "c", lambda run, state: [run.after_step(state, 1.0) for _ in range(2)]), RuntimeError, "sx.loop.Run.after_step: run.after_step() was called again for step 1, whose batch run.batches() gave once: each batch is one step"),
        (lambda d: _loop(d.tmp / "c", lambda run, state: run.after_step({"w": state["w"].astype(jnp.int32)}, 1.0)), ValueError, "sx.loop.Run.after_step: state leaf 'w' is int32[2], but the run's state has float32[2] there: a checkpoint of this state would not restore into the state the run starts with (a resume would be refused)"),
        (lambda d: _loop(d.tmp / "c", lambda run, state: run.after_step({"w": jnp.ones(5)}, 1.0)), ValueError, "sx.loop.Run.after_step: state leaf 'w' is float32[5], but the run's state has float32[2] there"),
        (lambda d: _loop(None, evaluate=lambda state: 0.5), TypeError, "sx.loop.Run: evaluate must return a dict {name: number} of scores, got 0.5"),
        (lambda d: _loop(None).__enter__(), RuntimeError, "sx.loop.Run: this run was already entered (it is ended, at step 2): a run is entered once"),
    ],
    ids=["writer-int", "writer-file", "nothing-to-save", "save-without-checkpoints", "eval-without-evaluate", "loader-int", "mesh-str", "after_step-twice", "leaf-dtype", "leaf-shape", "evaluate-float", "re-entered"],
)  # fmt: skip
def test_fifth_sweep_loop_refusals(tmp_path, request, call, error, message):
    paths = _LoopPaths(tmp_path, request)
    with pytest.raises(error) as caught:
        call(paths)
    _says(str(caught.value), message.replace("{file}", str(paths.file)))
    assert [s for s in (tmp_path / "c").glob("*") if s.name.isdigit()] == []  # nothing saved


def test_fifth_sweep_a_log_with_no_writer_warns():
    with pytest.warns(UserWarning, match=re.escape("sx.loop.run: every['log']=5 schedules logging, but writer= is not given, so no metric is written")):  # fmt: skip
        sx.loop.run({"w": jnp.ones(2)}, every={"log": 5}, goodput=False)


def _step_with_options(options):
    step = sx.make_train_step(_loss, mesh=sx.make_mesh(), compiler_options=options)
    return step(step.shard(_pytree_state()), _XY)


@pytest.mark.parametrize(
    "call,error,message",
    [
        # the step's settings: a plan's factory, a sequence axis the mesh lacks, an XLA
        # option XLA refuses when it compiles, a built state where its builder goes
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh(), plan=sx.fsdp), TypeError, "sx.make_train_step: plan must be a shardax Plan, got sx.fsdp, the function that makes one from a mesh: call it, plan=sx.fsdp(mesh)"),
        (lambda: sx.train.StepConfig(mesh=sx.make_mesh(), seq_axis="context"), ValueError, "sx.train.StepConfig: seq_axis must be a mesh axis name (the axis that splits each sequence, e.g. 'context'), one of {'data': 8}, or None; got 'context'"),
        (lambda: _step_with_options({"xla_cpu_bogus_flag": True}), ValueError, "sx.train.TrainStep: compiler_options['xla_cpu_bogus_flag'] = True: XLA refused it when compiling: No such compile option: 'xla_cpu_bogus_flag'"),
        (lambda: _step_with_options({"xla_cpu_enable_fast_math": "maybe"}), ValueError, "sx.train.TrainStep: compiler_options['xla_cpu_enable_fast_math'] = 'maybe': XLA refused it when compiling"),
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh()).init(_pytree_state()), TypeError, "sx.train.TrainStep.init: init_fn must be a function (*args, **kwargs) -> sx.TrainState that builds the state (the step runs it onto its shardings), got a sx.TrainState, which is built already: place it with step.shard(state)"),
        # sx.estimate: the fraction of peak it assumes; an option XLA refuses, named
        (lambda: _estimate_with(compute_efficiency=1.5), ValueError, "sx.estimate: compute_efficiency must be the fraction of peak the prediction assumes, in (0, 1], got 1.5"),
        (lambda: _estimate_with(compute_efficiency="0.4"), ValueError, "sx.estimate: compute_efficiency must be a finite number > 0, got '0.4'"),
        (lambda: sx.estimate(sx.make_train_step(_loss, mesh=sx.make_mesh(), compiler_options={"xla_cpu_bogus_flag": True}), jax.eval_shape(_pytree_state), jax.eval_shape(lambda: _XY)), ValueError, "sx.estimate: compiler_options['xla_cpu_bogus_flag'] = True: XLA refused it when compiling: No such compile option"),
        # sx.verify: the mesh and reference of your own step, an eval step
        (lambda: sx.verify(_own_step, {"w": jnp.ones((4, 2))}, _XY, mesh="data"), TypeError, "sx.verify: mesh must be a jax.sharding.Mesh, got 'data'. Build one with sx.make_mesh()"),
        (lambda: sx.verify(_own_step, {"w": jnp.ones((4, 2))}, _XY, reference="one device"), TypeError, "sx.verify: reference must be a function: the one-device step to compare with, got 'one device'"),
        (lambda: sx.verify(sx.make_eval_step(_loss, mesh=sx.make_mesh()), _pytree_state(), _XY), TypeError, "sx.verify: step is an eval step (sx.make_eval_step), which updates nothing"),
        # sx.moe and sx.keep_plan
        (lambda: sx.moe(jnp.ones((8, 4)), jnp.ones((4, 2)), "mlp", jnp.ones((2, 4, 4))), TypeError, "sx.moe: expert_fn must be a function expert_fn(params_of_one_expert, tokens), got 'mlp'"),
        (lambda: sx.moe(jnp.ones((8, 4)), jnp.ones((4, 2)), lambda p, h: h @ p, jnp.ones((2, 4, 4)), batch_axes=0), TypeError, "sx.moe: batch_axes must be a tuple of mesh axis names, e.g. ('data',), or None, got 0"),
        (lambda: sx.keep_plan(sx.fsdp(sx.make_mesh())), TypeError, "sx.keep_plan: step must be the user's train step, got the plan 'fsdp': sx.keep_plan takes no plan"),
    ],
    ids=["plan-factory", "seq_axis", "xla-option-name", "xla-option-value", "init-state", "estimate-efficiency", "estimate-efficiency-str", "estimate-xla-option", "verify-mesh", "verify-reference", "verify-eval-step", "moe-expert_fn", "moe-batch_axes", "keep_plan-plan"],
)  # fmt: skip
def test_fifth_sweep_errors_name_argument_rule_and_value(call, error, message):
    with raises(error, message):
        call()


def _matmul(p, h):
    return h @ p


def test_fifth_sweep_inputs_that_now_work():
    mesh = sx.make_mesh({"data": 4, "expert": 2})
    with jax.set_mesh(mesh):  # one batch axis by name, as data_axis takes it
        moe = lambda x: sx.moe(x, jnp.ones((4, 2)), _matmul, jnp.ones((2, 4, 4)), batch_axes="data")  # noqa: E731  # fmt: skip
        y = jax.jit(lambda x: moe(x)[0])(jnp.ones((8, 4)))
    assert y.shape == (8, 4)


def _target_mesh():
    return sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))


_COMPILE_ONLY = "the devices to place on are compile-only (8 x NVIDIA H100 80GB HBM3, from sx.target): they hold no arrays and run nothing, so no value can be placed on them"


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: sx.prepare({"w": np.ones((8, 2))}, mesh=m, plan=sx.fsdp(m, min_size=1)), f"sx.prepare: {_COMPILE_ONLY}"),
        (lambda m: sx.distribute_batch(_XY, sx.batch_sharding(m)), f"sx.distribute_batch: {_COMPILE_ONLY}"),
        (lambda m: sx.global_batch(_XY, m), f"sx.global_batch: {_COMPILE_ONLY}"),
        (lambda m: sx.shard({"w": np.ones((8, 2))}, sx.fsdp(m, min_size=1)), f"sx.shard: {_COMPILE_ONLY}"),
        (lambda m: _in_run(lambda run: run.batches([_XY], m)), "sx.loop.Run.batches: mesh is of compile-only devices (8 x NVIDIA H100 80GB HBM3, from sx.target), which hold no arrays: no batch can be placed on them"),
    ],
    ids=["prepare", "distribute_batch", "global_batch", "shard", "loop-batches"],
)  # fmt: skip
def test_fifth_sweep_placing_on_a_compile_only_mesh_says_what_to_do(call, message):
    with raises(ValueError, message):
        call(_target_mesh())


# --- sixth sweep, the outside programs' patterns (issue 56, item 1) -------------------------


def _verify_mesh_bound_step():
    mesh = sx.make_mesh()
    rows = jax.sharding.NamedSharding(mesh, P("data"))

    @jax.jit
    def constrained_step(params, batch):  # its body names the 8-device mesh
        return _own_step(params, jax.lax.with_sharding_constraint(batch, rows))

    params = jax.device_put({"w": jnp.ones((4, 2))}, jax.sharding.NamedSharding(mesh, P()))
    return sx.verify(constrained_step, params, jax.device_put(_XY, rows))


@pytest.mark.parametrize(
    "call,error,message",
    [
        (_verify_mesh_bound_step, ValueError, "sx.verify: the step constrained_step is bound to its 8-device mesh's devices (a sharding or constraint in its body names them), so verify cannot run it on one device as the reference: pass reference=, the same step for one device"),
    ],
    ids=["verify-mesh-bound-step"],
)  # fmt: skip
def test_sixth_sweep_outside_patterns_name_the_way_round(call, error, message):
    with raises(error, message):
        call()


# --- the sixth sweep (issue 56 items 2-4): the search's checks from one home, the data
# path, the run's steps, the mesh, a damaged checkpoint ------------------------------------


def _search(space, init=None, loss_fn=_loss, batch=None):
    init = init or _pytree_state
    batch = {"x": jnp.zeros((16, 4)), "y": jnp.zeros((16, 2))} if batch is None else batch
    return sx.search_plans(space, init, loss_fn=loss_fn, batch=batch)


def _stacked_state():
    return sx.TrainState.from_params(
        {"blocks": jnp.zeros((4, 4, 4)), "w": jnp.zeros((4, 2))},
        lambda p, x: x @ p["w"],
        optax.sgd(0.1),
    )


def _loop_steps_twice():
    with sx.loop.run({"w": jnp.ones(2)}, steps=3, goodput=False) as run:
        for _ in run.batches(range(9), steps=5):
            pass  # pragma: no cover


def _damaged_restore(tmp_path):
    with sx.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": jnp.arange(4096.0)})
        manager.save(2, {"w": jnp.arange(4096.0)})
    files = [os.path.join(r, n) for r, _, ns in os.walk(tmp_path / "2" / "state") for n in ns]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with sx.CheckpointManager(tmp_path) as manager:
        manager.restore({"w": jnp.zeros(4096)}, step=2)


_TP = [(r"w", P(None, "model"))]
_STAGES = [(r"blocks", P("stage"))]


@pytest.mark.parametrize(
    "call,error,message",
    [
        # sx.search_plans takes auto_plan's checks (train/auto/options.py)
        (lambda t: _search(sx.SearchSpace(meshes=[{"data": 8}], pipeline_rules=_STAGES)), ValueError, "sx.search_plans: pipeline_rules split the stacked layers over mesh axis 'stage' (stage_axis), which must be in the mesh with size > 1; the mesh's axes are {'data': 8}"),
        (lambda t: _search(sx.SearchSpace(meshes=[{"data": 8}, {"data": 4, "context": 2}], pipeline_rules=_STAGES)), ValueError, "sx.search_plans: pipeline_rules split the stacked layers over mesh axis 'stage' (stage_axis), which is not in any searched mesh ([{'data': 8}, {'data': 4, 'context': 2}]) with size > 1"),
        (lambda t: _search(sx.SearchSpace(meshes=[{"data": 2, "stage": 4}], pipeline_rules=[(r"nothing", P("stage"))])), ValueError, "sx.search_plans: pipeline_rules place no leaf of the state over mesh axis 'stage' (stage_axis); give rules matching the stacked layers"),
        (lambda t: _search(sx.SearchSpace(meshes=[{"data": 8}], tp_rules=_TP)), ValueError, "sx.search_plans: tp_rules name mesh axis 'model', which is not in the mesh {'data': 8}; add it to a mesh"),
        (lambda t: sx.auto_plan(sx.make_mesh(), _pytree_state, tp_rules=_TP), ValueError, "sx.auto_plan: tp_rules name mesh axis 'model', which is not in the mesh {'data': 8}"),
        (lambda t: _search(sx.SearchSpace(meshes=[sx.train.Layout({"data": 8}, plans={"mine": "fsdp"})])).flags, ValueError, "sx.train.AutoPlan.flags: the pick's plan 'mine' is one of your own (candidates= or a Layout's plans), for which shardax train has no --plan"),
        (lambda t: sx.SearchSpace(plans=()), ValueError, "sx.SearchSpace: plans is empty, so there is nothing to rank; name plans such as ('fsdp', 'zero1'), or pass None for every default plan"),
        (lambda t: _search(sx.SearchSpace(), loss_fn=lambda model: 0.0), TypeError, "sx.search_plans: loss_fn must take (model, batch), as the step calls it, got "),
        (lambda t: sx.auto_plan(sx.make_mesh(), _pytree_state, loss_fn=lambda model: 0.0, batch=_XY), TypeError, "sx.auto_plan: loss_fn must take (model, batch), as the step calls it"),
        (lambda t: _search(sx.SearchSpace(), init=lambda: {"w": jnp.zeros((4, 2))}), ValueError, "sx.search_plans: abstract_state_or_init must be a shardax TrainState (of arrays or ShapeDtypeStructs) or a function of no arguments returning one, so abstract values can be built; got function, which returned a dict. Wrap params with sx.TrainState.from_params"),
        (lambda t: sx.train.Layout(sx.fsdp(sx.make_mesh())), TypeError, "sx.train.Layout: mesh must be a sx.make_mesh spec (e.g. {'data': 4, 'stage': 2}) or a jax.sharding.Mesh, got Plan (a plan goes in plans=)"),
        # the data path, the run's steps, the mesh
        (lambda t: sx.prefetch_to_device({"x": np.ones((8, 2))}, sx.make_mesh()), TypeError, "sx.prefetch_to_device: iterable must be an iterable of batches (a list of them, a generator, sx.batches(...)), got a dict (keys ['x']), which would yield its keys"),
        (lambda t: _loop_steps_twice(), ValueError, "sx.loop.Run.batches: steps=5 here, but the run was made with steps=3"),
        (lambda t: sx.make_mesh({"data": 2}, devices=[jax.devices()[0]] * 2), ValueError, "sx.make_mesh: devices must list each device once (a mesh places one shard on each), got "),
        # a truncated checkpoint: named as damaged, in one line
        (lambda t: _damaged_restore(t), OSError, "sx.CheckpointManager.restore: checkpoint step 2 in "),
    ],
    ids=["search-pipeline-no-stage", "search-pipeline-no-stage-any", "search-pipeline-no-leaf", "search-tp-axis", "auto-tp-axis", "search-own-plan-flags", "search-plans-empty", "search-loss-one-arg", "auto-loss-one-arg", "search-init-dict", "layout-plan-as-mesh", "prefetch-dict", "loop-steps-twice", "mesh-device-twice", "checkpoint-damaged"],
)  # fmt: skip
def test_sixth_sweep_losses_and_silences_are_clear(tmp_path, call, error, message):
    with raises(error, message) as caught:
        call(tmp_path)
    if error is OSError:
        assert "is damaged (it cannot be read: OUT_OF_RANGE: " in str(caught.value)
        assert len(str(caught.value)) < 500


@pytest.mark.compile_only("gpu")
def test_sixth_sweep_a_space_of_two_device_kinds_is_refused():
    space = sx.SearchSpace(meshes=[sx.make_mesh({"data": 8}), sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))])  # fmt: skip
    with raises(ValueError, "sx.search_plans: meshes must all be of one kind of device"):
        _search(space)


def _int_leaf_state():
    return sx.TrainState.from_params(
        {"w": jnp.zeros((4, 2)), "n": jnp.zeros((), jnp.int32)}, lambda p, x: x @ p["w"], optax.sgd(0.1)
    )  # fmt: skip


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: sx.estimate(sx.make_train_step(_loss, mesh=sx.make_mesh()), jax.eval_shape(_pytree_state), {"x": jax.ShapeDtypeStruct((0, 4), jnp.float32), "y": jax.ShapeDtypeStruct((0, 2), jnp.float32)}), ValueError, "sx.estimate: batch['x'] has 0 rows (shape (0, 4)): a step of an empty batch prices nothing"),
        (lambda: sx.estimate(sx.make_train_step(_loss, mesh=sx.make_mesh()), jax.eval_shape(_int_leaf_state), jax.eval_shape(lambda: _XY)), TypeError, "sx.estimate: state.params['n'] is int32, but the step differentiates the params, which must be floating point"),
    ],
    ids=["estimate-0-rows", "estimate-int-param"],
)  # fmt: skip
def test_sixth_sweep_estimate_names_what_it_cannot_price(call, error, message):
    with raises(error, message):
        call()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: sx.CheckpointManager("gs://bucket/run"), "sx.CheckpointManager: directory must be a directory of a local or mounted file system, got the gs:// URL 'gs://bucket/run': shardax does not save to object stores yet (its writer lock, atomic overwrite and damage checks need a file system). Mount the bucket"),
        (lambda: sx.CheckpointManager("s3://bucket/run"), "sx.CheckpointManager: directory must be a directory of a local or mounted file system, got the s3:// URL 's3://bucket/run': shardax does not save to object stores yet (its writer lock, atomic overwrite and damage checks need a file system); nor does orbax-checkpoint write s3:// arrays"),
        (lambda: sx.loop.run({"w": jnp.ones(2)}, checkpoints="gs://bucket/run"), "sx.loop.run: checkpoints must be a directory of a local or mounted file system, got the gs:// URL"),
    ],
    ids=["manager-gs", "manager-s3", "loop-gs"],
)  # fmt: skip
def test_a_remote_checkpoint_path_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, call, message
):
    monkeypatch.chdir(tmp_path)
    with raises(ValueError, message):
        call()
    assert os.listdir(tmp_path) == []  # no local ./gs:/bucket/run


def test_a_file_url_is_a_local_checkpoint_directory(tmp_path):
    with sx.CheckpointManager(f"file://{tmp_path}/run") as manager:
        manager.save(1, {"w": jnp.ones(2)})
        assert manager.directory == str(tmp_path / "run") and manager.all_steps() == [1]


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, -1, 5), "sx.BatchSizeRecommendation: min_batch_size must be an integer >= 1, got 0"),
        ((1, 2, 3, 0), "sx.BatchSizeRecommendation: max_memory_batch_size (or None) must be an integer >= 1, got 0"),
        ((8, 4, 6), "sx.BatchSizeRecommendation: min_batch_size must be <= optimal_batch_size, got 8 > 4"),
    ],
    ids=["min-0", "max-memory-0", "min-above-optimal"],
)  # fmt: skip
def test_a_batch_size_recommendation_holds_sizes_in_order(args, message):
    with raises(ValueError, message):
        sx.BatchSizeRecommendation(*args)


def _while_loss(model, batch):
    y = model(batch["x"])
    grow = lambda c: c * 2.0 + 1.0  # noqa: E731
    trips = jax.lax.while_loop(lambda c: jnp.sum(c) < 100.0, grow, jax.lax.stop_gradient(y))
    return jnp.mean((y - batch["y"]) ** 2), {"grown": jnp.sum(trips)}


def test_sixth_sweep_estimate_notes_a_while_loop_of_unknown_trips():
    """A data-dependent while_loop is priced as one trip of its body, and the report says
    so; a fori_loop (XLA knows its trip count) gets no such note."""
    batch = jax.eval_shape(lambda: _XY)
    mesh = sx.make_mesh()
    report = sx.estimate(sx.make_train_step(_while_loss, mesh=mesh), jax.eval_shape(_pytree_state), batch)  # fmt: skip
    assert [n for n in report.notes if "while loop" in n] == [
        "1 while loop(s) of the step run a number of trips decided at run time (a "
        "jax.lax.while_loop on data, not a fori_loop or scan): each is priced as one trip of "
        "its body, so the step's FLOPs, bytes and time are a lower bound"
    ]
    plain = sx.estimate(sx.make_train_step(_loss, mesh=mesh), jax.eval_shape(_pytree_state), batch)
    assert not [n for n in plain.notes if "while loop" in n]


# --- the sixth sweep, the rest (issue 56 item 4): a step that returns nothing, abstract
# values to place, per-step options read only at start-up, tables of no platform, a batch
# no device holds, a full disk under the run directory ---------------------------------


def _none_step(params, batch):
    jnp.sum(batch["x"])  # forgets to return the new params


_CPU_TABLES = {
    "device": "cpu", "jax": "0.10.0", "date": "2026-12-01", "stream": [{"gbs": 25.0}],
    "gemm": [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 1.0}],
    "launch": [{"key": "per_kernel", "us": 2.0}, {"key": "one_kernel_program", "us": 20.0}],
}  # fmt: skip


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: sx.verify(_none_step, {"w": jnp.ones((4, 2))}, _XY), ValueError, "sx.verify: step _none_step returned None, but its state holds no NNX object to update in place (only arrays), so the state comes back unchanged and verify would compare nothing; a functional step returns the new state first: (state, metrics)"),
        (lambda: sx.prepare(jax.eval_shape(_pytree_state), mesh=sx.make_mesh()), TypeError, "sx.prepare: objects[0] holds abstract values (jax.ShapeDtypeStruct at .step: int32[]), and prepare places arrays: build the objects (model, optimizer) first, or build them placed with jax.jit(init, out_shardings=plan(abstract))"),
        (lambda: sx.train.StepConfig(mesh=sx.make_mesh(), compiler_options={"xla_force_host_platform_device_count": 8}), ValueError, "sx.train.StepConfig: compiler_options['xla_force_host_platform_device_count'] is read once, when the process starts JAX's backend, not when a step compiles, so it would have no effect here: the number of CPU devices is fixed when the CPU backend starts; set it before: jax.config.update('jax_num_cpu_devices', n)"),
        (lambda: sx.make_train_step(_loss, mesh=sx.make_mesh(), compiler_options={"xla_gpu_all_reduce_combine_threshold_bytes": -1}), ValueError, "sx.make_train_step: compiler_options['xla_gpu_all_reduce_combine_threshold_bytes'] (a size in bytes) must be an integer >= 0, got -1"),
        (lambda: from_tables(_CPU_TABLES, where="cpu.json"), ValueError, "cpu.json: measured on a cpu device (it has no 'platform': its device is 'cpu'); the per-op model prices GPU programs, so its tables come from a GPU"),
        (lambda: sx.cost.validate_batch_size(10**12, sx.HardwareType.H100), ValueError, "sx.cost.validate_batch_size: batch_size must be a number of examples one h100 device can hold, at least one byte each: at most its 79.65 GiB of memory, 85,520,809,984 examples; got 1,000,000,000,000"),
    ],
    ids=["verify-none-step", "prepare-abstract", "option-at-start", "option-negative-bytes", "tables-no-platform", "batch-size-past-memory"],
)  # fmt: skip
def test_sixth_sweep_the_rest_name_argument_rule_and_value(call, error, message):
    with raises(error, message):
        call()


def test_a_batch_size_a_device_holds_is_judged_as_the_seed_judges_it():
    assert sx.cost.validate_batch_size(10**9, sx.HardwareType.H100) == (True, "Batch size 1000000000 is optimal for h100.")  # fmt: skip


@pytest.fixture
def full_directory(tmp_path):
    """A directory on a file system with no space left (a 16 KiB tmpfs, filled; root
    only), skipped where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("a full file system needs root to mount a tmpfs")
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)]).returncode:
        pytest.skip("root without the right to mount a tmpfs: no full file system")
    try:
        with contextlib.suppress(OSError):
            (mount / "filler").write_bytes(b"x" * (16 << 10))
        (mount / "run").mkdir()
        yield mount / "run"
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_full_disk_under_run_dir_names_it_and_keeps_the_run(full_directory, tmp_path, capsys):
    """metrics.jsonl cannot be written: one warning naming --run-dir and the file, the run
    goes on to its end and its checkpoints; summary.json cannot be written either: the
    summary goes to stdout and the error names --run-dir."""
    ck = tmp_path / "ck"
    argv = ["train", "--epochs", "1", "--hidden", "16", "--batch-size", "480", "--log-every", "1"]
    code = cli_main([*argv, "--run-dir", str(full_directory), "--checkpoint-dir", str(ck)])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert err.splitlines() == [
        f"shardax train: warning: --run-dir {full_directory}: the metrics are not written from here on: [Errno 28] No space left on device (writing step 2): '{full_directory}/metrics.jsonl'; the run goes on without them",
        f"shardax train: error: --run-dir {full_directory}: summary.json was not written (No space left on device); the summary is printed above as JSON instead; the checkpoints are in {ck}",
    ]  # fmt: skip
    summary = json.loads(out[out.index("\n{") :])
    assert summary["steps"] == 3 and summary["metrics_error"].startswith("[Errno 28]")
    assert sx.CheckpointManager(ck).all_steps()[-1] == 3


def test_a_full_disk_under_a_loops_checkpoints_names_the_argument(full_directory):
    with raises(OSError, f"sx.loop.Run.after_step: checkpoint step 1 was not saved in {full_directory}/ck: No space left on device. Nothing of step 1 was committed; the steps saved before it are kept. Free space in {full_directory}/ck, or pass another directory as checkpoints="):  # fmt: skip
        _loop(full_directory / "ck", every={"save": 1})
