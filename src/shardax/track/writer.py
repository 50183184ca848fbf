"""``MetricWriter``: scalars from process 0, written by a background thread.

``write(step, scalars)`` only puts the step's values (device arrays as the step returned
them, or numbers) on a queue and returns: it never waits for the step to finish. A
worker thread fetches them (``jax.device_get``) and writes every sink: always a JSONL file
(``metrics.jsonl`` in the run directory), TensorBoard event files when ``log_dir`` is
given, and W&B or MLflow when asked for. On every process but 0 the writer writes
nothing and ``write`` returns at once, so the same loop runs on every host.

>>> with sx.MetricWriter(tmp_path, log_dir=tmp_path / "tb") as writer:
...     for step in range(1, 4):
...         writer.write(step, {"train/loss": jnp.float32(1 / step)})
>>> len((tmp_path / "metrics.jsonl").read_text().splitlines())
3
"""

from __future__ import annotations

import json
import numbers
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.checks import as_count, as_path, expect_type, public, received
from shardax.track.sinks import BACKENDS, JsonlSink, Sink, check_writable, make_sink

_STOP = object()


def _work(q: queue.Queue, sinks: list[Sink], errors: list[BaseException]) -> None:
    """Fetches each write's values and hands them to every sink; keeps the first error."""
    while True:
        item = q.get()
        try:
            if item is _STOP:
                return
            if errors:
                continue  # keep draining, so nothing waits on a failed worker
            step, scalars, wall_time = item
            fetched = jax.device_get(scalars)
            # In the given order; an array of one element counts as its element.
            values = {k: float(np.asarray(fetched[k]).reshape(())) for k in scalars}
            for sink in sinks:
                sink.write(step, values, wall_time)
        except BaseException as e:  # re-raised by the next write(), flush() or close()
            errors.append(e)
        finally:
            q.task_done()


def check_scalar(name: Any, value: Any) -> None:
    """Raises ``TypeError`` unless ``name`` is a string and ``value`` one number: a Python
    or NumPy number, or an array (NumPy or JAX, possibly still being computed) of one
    numeric element. Checked on the caller's thread, never waiting for the value."""
    expect_type("each metric name", name, str, "a string such as 'train/loss'")
    dtype, size = getattr(value, "dtype", None), getattr(value, "size", None)
    if isinstance(value, numbers.Real) and not isinstance(value, str):
        return
    numeric = dtype is not None and (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_)
    if numeric and size == 1:
        return
    shape = f" with shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
    kind = received(value) if dtype is None else f"an array of dtype {dtype}{shape}"
    raise TypeError(
        f"metric {name!r} must be one number (a Python or NumPy number, "
        f"or an array of one numeric element), got {kind}"
    )


def check_config(config: Any) -> dict[str, Any]:
    """``config`` as a dict, each value checked to be JSON (what every sink records):
    else ``TypeError`` naming the key, so a bad value fails when the writer is built."""
    if config is None:
        return {}
    expect_type("config", config, Mapping, "a dict {name: plain value}")
    for key, value in config.items():
        expect_type("each config key", key, str, "a string")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"config[{key!r}] must be a plain value the sinks can record "
                f"(a string, number, bool, None, or a list or dict of them), got "
                f"{received(value)}; pass str(...) of it ({e})"
            ) from None
    return dict(config)


@public("sx.MetricWriter")
class MetricWriter:
    """Scalars to JSONL, TensorBoard, W&B or MLflow, from process 0, asynchronously.

    Args:
      run_dir: ``metrics.jsonl`` goes here (always).
      log_dir: TensorBoard event files go here; also where W&B and MLflow keep their
        offline files. None: no TensorBoard.
      backends: extra sinks, from ``"tensorboard"`` (the default when ``log_dir`` is
        given), ``"wandb"``, ``"mlflow"``; each needs the extra of that name.
      config: the run's settings (flat, plain values), recorded by the sinks that keep
        them (W&B config, MLflow params, a TensorBoard text summary).

    Directories are created and checked here, before any step runs: an unwritable one is
    an ``OSError`` naming it; a backend whose extra is missing an ``ImportError`` naming
    the extra. Use it as a context manager, or call [`close`][shardax.MetricWriter.close],
    which waits for everything queued to be written.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        log_dir: str | os.PathLike[str] | None = None,
        backends: Iterable[str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(backends, str):
            raise TypeError(
                f"backends must be a list of names such as [{backends!r}], got "
                f"the string {backends!r}"
            )
        names = list(backends) if backends is not None else (["tensorboard"] if log_dir else [])
        config = check_config(config)
        for name in names:
            if name not in BACKENDS:
                raise ValueError(f"backends: each must be one of {list(BACKENDS)}, got {name!r}")
        self.active = jax.process_index() == 0
        self.run_dir = Path(as_path("run_dir", run_dir))
        self.log_dir = Path(as_path("log_dir", log_dir)) if log_dir is not None else None
        self.path = self.run_dir / "metrics.jsonl"
        self._sinks: list[Sink] = []
        self._errors: list[BaseException] = []
        self._closed = False
        if not self.active:
            return
        where = self.log_dir if self.log_dir is not None else self.run_dir
        if self.log_dir is not None:
            check_writable(self.log_dir, "log_dir")
        try:
            self._sinks.append(JsonlSink(self.path))
            for name in dict.fromkeys(names):
                self._sinks.append(make_sink(name, where, config))
        except BaseException:
            for sink in self._sinks:
                sink.close()
            raise
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=_work,
            args=(self._queue, self._sinks, self._errors),
            name="shardax-metrics",
            daemon=True,
        )
        self._thread.start()

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Queues ``scalars`` (name -> scalar array or number) for ``step``; returns at once.

        Names are tags as given (``"train/loss"``); values may be device arrays still
        being computed. Raises the error a sink hit on an earlier write.
        """
        if not self.active:
            return
        if self._closed:
            raise ValueError("the writer is closed")
        step = as_count("step", step, minimum=0)
        expect_type("scalars", scalars, Mapping, "a dict {name: number}")
        for name, value in scalars.items():
            check_scalar(name, value)
        self._raise()
        self._queue.put((step, dict(scalars), time.time()))

    def flush(self) -> None:
        """Waits until everything queued so far is written (the sinks may buffer)."""
        if self.active and not self._closed:
            self._queue.join()
        self._raise()

    def close(self) -> None:
        """Writes everything queued, closes the sinks and stops the thread."""
        if not self.active or self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        for sink in self._sinks:  # every sink closed; the first failure is raised
            try:
                sink.close()
            except Exception as e:  # a full disk: what a failed write left in a buffer
                self._errors.append(e)
        self._raise()

    def _raise(self) -> None:
        if self._errors:
            raise RuntimeError(f"writing metrics failed: {self._errors[0]}") from (self._errors[0])

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
