"""Where scalars go: a JSONL file, TensorBoard event files, W&B, MLflow.

A sink has ``write(step, scalars, wall_time)`` (plain floats) and ``close()``. The JSONL
sink needs nothing; the others are extras, imported only when asked for, and a missing
one is an ``ImportError`` naming the extra to install. W&B and MLflow work offline:
W&B runs in ``WANDB_MODE`` (default ``offline``), MLflow logs to ``MLFLOW_TRACKING_URI``
(default ``<directory>/mlruns``).

>>> sink = JsonlSink(tmp_path / "metrics.jsonl")
>>> sink.write(10, {"train/loss": 0.5}, wall_time=0.0)
>>> sink.close()
>>> (tmp_path / "metrics.jsonl").read_text()
'{"step": 10, "time": 0.0, "train/loss": 0.5}\\n'
"""

from __future__ import annotations

import importlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

BACKENDS = ("tensorboard", "wandb", "mlflow")
"""The optional sinks, by the name of the extra that installs each."""


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float], wall_time: float) -> None: ...

    def close(self) -> None: ...


def check_writable(directory: str | os.PathLike[str], what: str = "directory") -> Path:
    """Creates ``directory`` and checks that a file can be written in it; else an
    ``OSError`` whose message names ``what``, the path and the reason."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shardax-write-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(
            e.errno, f"{what} {str(directory)!r} is not writable: {e.strerror or e}"
        ) from None
    return path


def require_extra(module: str, extra: str) -> Any:
    """Imports ``module``, or raises an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"the {extra!r} metric backend needs {module.split('.')[0]}, which is not "
            f"installed; install it with: pip install 'shardax[{extra}]'"
        ) from None


class JsonlSink:
    """One JSON object per write, ``{"step", "time", **scalars}``, flushed each line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        check_writable(self.path.parent)
        self._file = self.path.open("a")

    def write(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        try:
            self._file.write(json.dumps({"step": step, "time": wall_time, **scalars}) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: name the file and the step
            raise OSError(e.errno, f"{e.strerror} (writing step {step})", str(self.path)) from e

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:  # what a failed write left in the buffer
            raise OSError(e.errno, e.strerror, str(self.path)) from e


class TensorBoardSink:
    """Event files for ``tensorboard --logdir``, written by tensorboardX: one event per
    write holding every scalar (a tensorboardX ``add_scalar`` per value costs ~6× more)."""

    def __init__(self, directory: str | os.PathLike[str], config: dict[str, Any]) -> None:
        tensorboardX = require_extra("tensorboardX", "tensorboard")
        # tensorboardX is an optional extra (shardax[tensorboard]), required just above
        from tensorboardX import summary
        from tensorboardX.proto.summary_pb2 import Summary

        check_writable(directory, "log directory")
        self._summary, self._Summary = summary, Summary
        self._writer = tensorboardX.FileWriter(str(directory), flush_secs=10)
        if config:
            text = f"```\n{json.dumps(config, indent=2)}\n```"
            self._writer.add_summary(summary.text("config", text), 0)

    def write(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        values = [v for tag, x in scalars.items() for v in self._summary.scalar(tag, x).value]
        self._writer.add_summary(self._Summary(value=values), step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run; offline unless ``WANDB_MODE`` says otherwise."""

    def __init__(self, directory: str | os.PathLike[str], config: dict[str, Any]) -> None:
        wandb = require_extra("wandb", "wandb")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "shardax"),
            dir=str(check_writable(directory, "log directory")),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=config,
        )

    def write(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run, in ``MLFLOW_TRACKING_URI`` or else ``<directory>/mlruns``."""

    def __init__(self, directory: str | os.PathLike[str], config: dict[str, Any]) -> None:
        mlflow = require_extra("mlflow", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = check_writable(Path(directory) / "mlruns", "log directory").resolve().as_uri()
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name("shardax")
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment("shardax")
        )
        self._run_id = self._client.create_run(experiment_id).info.run_id
        for key, value in config.items():
            self._client.log_param(self._run_id, key, value)

    def write(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        ms = int(wall_time * 1000)
        for key, value in scalars.items():
            self._client.log_metric(self._run_id, key, value, timestamp=ms, step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


_FACTORIES: dict[str, Callable[[Path, dict[str, Any]], Sink]] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
}


def make_sink(name: str, directory: str | os.PathLike[str], config: dict[str, Any]) -> Sink:
    """The optional sink ``name`` (one of ``BACKENDS``) writing under ``directory``."""
    if name not in _FACTORIES:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {name!r}")
    return _FACTORIES[name](Path(directory), config)
