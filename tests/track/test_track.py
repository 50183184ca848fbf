"""Tracking: MetricWriter read back by TensorBoard itself, profiler traces, the step clock."""

import gzip
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import shardax as sx
from shardax.track import StepClock, Window
from shardax.track.profile import parse_steps


def read_tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``log_dir``'s event files, as TensorBoard loads them."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_the_scalars_and_jsonl_has_every_write(tmp_path):
    mesh = sx.make_mesh({"data": -1})
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with sx.MetricWriter(tmp_path / "run", log_dir=tmp_path / "tb", config={"lr": 0.1}) as w:
        for step in (10, 20, 30):
            # device arrays as a step returns them (replicated over 8 devices), and numbers
            loss = jax.device_put(jnp.float32(1 / step), replicated)
            w.write(step, {"train/loss": loss, "perf/examples_per_s": 100.0 * step})
    scalars = read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [10, 20, 30]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [0.1, 0.05, 1 / 30])
    np.testing.assert_allclose([v for _, v in scalars["perf/examples_per_s"]], [1e3, 2e3, 3e3])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20, 30]
    assert lines[0]["train/loss"] == pytest.approx(0.1)
    assert set(lines[0]) == {"step", "time", "train/loss", "perf/examples_per_s"}


def test_without_log_dir_only_jsonl_is_written(tmp_path):
    with sx.MetricWriter(tmp_path) as w:
        w.write(1, {"loss": 2.0})
        w.flush()
        assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_bf16_scalar_is_a_number(tmp_path):
    """A bf16 loss (a bf16 model's, unconverted) is one number: NumPy's issubdtype does not
    count bfloat16 as a number, JAX's does."""
    with sx.MetricWriter(tmp_path) as w:
        w.write(1, {"loss": jnp.asarray(2.5, jnp.bfloat16)})
        w.flush()
        assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.5


def test_bad_directories_backends_and_values_are_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"log_dir '.*a-file/tb' is not writable"):
        sx.MetricWriter(tmp_path / "run", log_dir=blocker / "tb")
    with pytest.raises(ValueError, match=r"must be one of \['tensorboard', 'wandb', 'mlflow'\]"):
        sx.MetricWriter(tmp_path, backends=["comet"])
    w = sx.MetricWriter(tmp_path)
    with pytest.raises(TypeError, match=r"metric 'loss' must be one number .*got 'not a number'"):
        w.write(1, {"loss": "not a number"})  # refused on the caller's thread, at once
    w._sinks[0]._file.close()  # a sink that fails in the worker: the next call says so
    w.write(1, {"loss": 1.0})
    with pytest.raises(RuntimeError, match="writing metrics failed"):
        w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write(2, {"loss": 1.0})


def test_a_backend_whose_extra_is_missing_names_the_extra(tmp_path):
    for module, extra in (("wandb", "wandb"), ("mlflow", "mlflow")):
        try:
            __import__(module)
            continue  # installed: nothing to check
        except ImportError:
            pass
        with pytest.raises(ImportError, match=rf"pip install 'shardax\[{extra}\]'"):
            sx.MetricWriter(tmp_path, log_dir=tmp_path / "tb", backends=[extra])


def test_profile_steps_writes_a_trace_of_the_chosen_steps(tmp_path):
    calls = []

    @jax.jit
    def f(x):
        return jnp.tanh(x @ x)

    def step(x):
        calls.append(x.shape)
        return f(x)

    profiled = sx.track.profile_steps(step, tmp_path / "prof", 2, 3)
    x = jnp.ones((64, 64))
    for _ in range(5):
        x = profiled(x)
    assert profiled.calls == 5 and len(calls) == 5
    trace = profiled.trace_dir
    assert trace.parent.parent.parent == tmp_path / "prof" / "process_0"
    names = {p.name for p in trace.iterdir()}
    xplane = [n for n in names if n.endswith(".xplane.pb")]
    assert xplane and (trace / xplane[0]).stat().st_size > 0  # TensorBoard's profile plugin
    with gzip.open(trace / "perfetto_trace.json.gz") as fp:  # Perfetto
        events = json.load(fp)["traceEvents"]
    assert any("train" in str(e.get("name", "")) for e in events)  # the step annotations
    # A second profiler may start now: the first stopped its trace.
    with sx.track.profile_steps(step, tmp_path / "prof2", 1, 10) as early:
        early(x)  # the loop ends before step 10: close() stops the trace
    assert early.trace_dir is not None and any(early.trace_dir.glob("*.xplane.pb"))


def test_profiled_train_step_keeps_its_attributes(tmp_path):
    mesh = sx.make_mesh({"data": -1})
    step = sx.make_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), mesh=mesh)
    profiled = sx.track.profile_steps(step, tmp_path, 1, 1)
    assert profiled.mesh is mesh and profiled.shard == step.shard


@pytest.mark.parametrize("text", ["5:3", "0:2", "3", "a:b", "2:", "-1:4"], ids=lambda t: repr(t))
def test_parse_steps_rejects_bad_ranges(text):
    with pytest.raises(ValueError, match=r"expected A:B with 1 <= A <= B"):
        parse_steps(text)
    assert parse_steps("5:8") == (5, 8)
    with pytest.raises(ValueError, match="stop must be >= start, got 5:3"):
        sx.track.profile_steps(lambda: None, "x", 5, 3)


def test_window_figures_and_the_input_bound_note_once():
    w = Window(steps=10, seconds=2.0, wait_seconds=0.5, examples=1280, tokens=0)
    assert (w.step_time, w.examples_per_s, w.data_wait_fraction) == (0.2, 640.0, 0.25)
    assert set(w.scalars()) == {
        "perf/step_time_s",
        "perf/examples_per_s",
        "perf/data_wait_fraction",
    }
    assert Window(1, 1.0, 0.0, 8, 512).scalars()["perf/tokens_per_s"] == 512.0
    clock = StepClock(128)
    assert clock.input_bound(Window(10, 2.0, 0.2, 0, 0)) is None  # 10%: not input-bound
    note = clock.input_bound(w)
    assert note.startswith("input-bound: 25% of the wall time over 10 steps")
    assert clock.input_bound(w) is None  # said once
    with pytest.raises(TypeError, match=r"sx.data.timed\(iterable\)"):
        StepClock(1, input=iter([]))


def slow_source(n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield {"x": np.full((8, 4), i, np.float32)}


def test_data_wait_counts_the_time_a_loop_blocks_on_input():
    # A source that sleeps and no compute: nearly all the wall time is waiting.
    for feed in (sx.data.timed(slow_source(8, 0.02)), sx.prefetch_to_device(slow_source(8, 0.02))):
        clock = StepClock(8, input=feed)
        for _ in feed:
            clock.tick()
        window = clock.total()
        assert window.steps == 8 and window.examples == 64
        assert feed.wait_seconds >= 8 * 0.02 * 0.5
        assert window.data_wait_fraction > 0.5
