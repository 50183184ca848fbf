"""Replacing a committed checkpoint step atomically: stage, then swap by renames.

The new version of step ``s`` is saved (by orbax, itself atomically) under
``<directory>/.staged/s``; then ``<directory>/s`` is renamed to ``<directory>/.replaced-s``,
the staged step to ``<directory>/s``, and the replaced one deleted. Each rename is atomic,
so a process killed at any point leaves, after ``recover``, either the old step or the
new one, whole:

- killed while staging: ``s`` is the old step; the staged leftovers are deleted;
- killed between the two renames: ``s`` is missing and ``.replaced-s`` is the old step,
  which is renamed back;
- killed before the delete: ``s`` is the new step; ``.replaced-s`` is deleted.

Only process 0 renames; every process waits for it.

>>> recover(tmp_path)  # nothing to do in a directory without leftovers
[]
"""

from __future__ import annotations

import os
import shutil

import jax
from jax.experimental import multihost_utils

STAGED = ".staged"
"""The directory (inside the checkpoint directory) new versions of steps are saved in."""
REPLACED = ".replaced-"
"""Prefix of a step directory moved aside while its new version is swapped in."""
TMP = ".orbax-checkpoint-tmp"
"""What orbax puts in the name of a step directory until the step is committed."""


def sync_processes(name: str) -> None:
    """Returns once every process has reached it (``name`` must match); nothing with one."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def recover(directory: str) -> list[str]:
    """Finishes or undoes an interrupted swap in ``directory``, and deletes the unfinished
    saves orbax left (``*.orbax-checkpoint-tmp*``); returns what it did. Only for the
    directory's writer (the holder of its lock, ``shardax.checkpoint.lock``), on process
    0: another writer's swap or save in flight looks just like an interrupted one."""
    done: list[str] = []
    if not os.path.isdir(directory):
        return done
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(REPLACED):
            step_dir = os.path.join(directory, name[len(REPLACED) :])
            if os.path.exists(step_dir):  # the new step is in place
                shutil.rmtree(path)
                done.append(f"deleted {name}")
            else:  # killed between the renames: the old step goes back
                os.rename(path, step_dir)
                done.append(f"restored {name}")
        elif name == STAGED or TMP in name:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"deleted {name}")
    return done


def swap_in(directory: str, step: int) -> None:
    """Moves the staged step ``step`` into ``directory`` in place of the committed one."""
    if jax.process_index() == 0:
        target = os.path.join(directory, str(step))
        aside = os.path.join(directory, f"{REPLACED}{step}")
        os.rename(target, aside)
        os.rename(os.path.join(directory, STAGED, str(step)), target)
        shutil.rmtree(aside)
        shutil.rmtree(os.path.join(directory, STAGED))
    sync_processes("shardax-checkpoint-swap")
