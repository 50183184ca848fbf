"""`shardax train --model gpt` compiles its step once: the FLOPs line reads the
executable the steps run (``shardax.cli.common.step_flops``), never a second compile.

Compiles are counted by JAX's own event (``/jax/core/compile/backend_compile_duration``,
one per program XLA compiles or loads from the persistent cache), by the function's name:
the train step and the eval step are both ``jit(whole)`` under ``--mode jit`` and
``jit(mapped)`` under ``--mode shard_map``, one program each. The model's shape is this
test's own, so no program of another test in this process is found already compiled.
"""

import collections

import jax
import pytest

from shardax.cli.main import main as cli

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
GPT = ["--model", "gpt", "--layers", "1", "--d-model", "24", "--heads", "3", "--seq-len", "12",
       "--batch-size", "8", "--steps", "2", "--eval-every", "2"]  # fmt: skip


@pytest.mark.parametrize(("mode", "program"), [("jit", "jit(whole)"), ("shard_map", "jit(mapped)")])
def test_train_gpt_compiles_its_step_once(tmp_path, capfd, mode, program):
    names: collections.Counter[str] = collections.Counter()

    def count(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            names[kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        assert cli(["train", *GPT, "--mode", mode, "--run-dir", str(tmp_path / "run")]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    printed = capfd.readouterr().out
    assert "FLOPs/step (compiled)" in printed  # the FLOPs line came from the compiled step
    # one train step and one eval step; a second compile for the FLOPs made it 3
    assert names[program] == 2, dict(names)
