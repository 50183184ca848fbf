"""How a manager names and finds its steps: orbax's standard names, minus the
directories named like a step that hold no shardax checkpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any


class _CheckpointSteps:
    """orbax's standard step names, minus directories named like a step that hold no
    shardax checkpoint (no "state" item): ``on_stray(path)`` is told, and orbax never
    lists, reads or garbage-collects them."""

    def __init__(self, base: Any, on_stray: Any) -> None:
        self._base, self._on_stray = base, on_stray
        self.single_host_load_and_broadcast = getattr(base, "single_host_load_and_broadcast", False)

    def _ours(self, metadata: Any) -> bool:
        if os.path.isdir(os.path.join(os.fspath(metadata.path), "state")):
            return True
        self._on_stray(metadata.path)
        return False

    def build_name(self, step: int) -> str:
        return self._base.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return iter([m for m in self._base.find_all(base_path) if self._ours(m)])

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self._base.find_step(base_path, step)
        if not self._ours(metadata):
            raise ValueError(f"no shardax checkpoint for step {step} in {base_path}")
        return metadata
