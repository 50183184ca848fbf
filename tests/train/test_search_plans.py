"""sx.search_plans: the plan-a-cluster guide's example (a user's own NNX model ranked over
a data × stage mesh and a data × context mesh) run as written, each candidate compiled
and analysed once; the space's refusals; plan="auto" checks its settings without building
a step."""

import re
from pathlib import Path

import pytest

import shardax as sx
from shardax.cost import estimation

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "plan-a-cluster.md"
SECTION = "## Rank meshes for your own model"


def blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def example():
    """The guide's first block (its model and loss) and the section's blocks, run as the
    docs test runs them, counting the analyses."""
    text = GUIDE.read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    namespace: dict = {}
    analysed = []
    analyse = estimation.analyse

    def counted(*args, **kwargs):
        analysed.append(1)
        return analyse(*args, **kwargs)

    estimation.analyse = counted
    try:
        for source in [blocks(text)[0], *blocks(section)]:
            exec(compile(source, str(GUIDE), "exec"), namespace)
    finally:
        estimation.analyse = analyse
    namespace["analysed"] = len(analysed)
    return namespace


def test_the_guides_example_ranks_a_stage_and_a_context_mesh(example):
    report = example["report"]
    by = {c.name: c for c in report.candidates}
    assert list(by) == ["stage=4:fsdp", "stage=4:pipeline", "context=2:fsdp"]
    assert example["analysed"] == 3  # each candidate analysed once, by sx.estimate's analysis
    assert all(c.estimate is not None and not c.skipped for c in by.values())
    assert dict(by["stage=4:pipeline"].mesh.shape) == {"data": 2, "stage": 4}
    assert by["context=2:fsdp"].config.seq_axis == "context"
    assert by["stage=4:fsdp"].config.seq_axis is None
    # The pipeline plan splits the stacked layers over the stages: the least state.
    assert by["stage=4:pipeline"].argument_bytes < by["stage=4:fsdp"].argument_bytes
    assert report.candidate.argument_bytes == report.estimate.compiled_bytes["arguments"]
    c = report.candidate
    shape = ",".join(f"{k}={v}" for k, v in c.mesh.shape.items())
    assert report.flags.startswith(f"--mesh {shape} --plan ")
    assert report.launch("python train.py") == "python train.py"  # one host
    assert "stage=4: mesh data=2,stage=4; context=2: mesh data=4,context=2" in report.reason
    assert report.to_dict()["candidates"][2]["mesh"] == {"data": 4, "context": 2}


def test_the_space_refuses_what_no_mesh_has(example):
    space = example["space"]
    init, loss_fn, batch = example["init"], example["loss_fn"], example["sequences"]
    wrong = sx.SearchSpace(meshes=space.meshes, plans=("fsdp", "tp"))
    with pytest.raises(ValueError, match=r"plans \['fsdp', 'tp'\]: tp on none of the meshes"):
        sx.search_plans(wrong, init, loss_fn=loss_fn, batch=batch)
    twice = sx.SearchSpace(meshes=[sx.train.Layout({"data": 8}, name="a")] * 2)
    with pytest.raises(ValueError, match="two searched meshes have the same name"):
        sx.search_plans(twice, init, loss_fn=loss_fn, batch=batch)
    with pytest.raises(ValueError, match=r"needs a 'data' \(or 'replica'\) axis"):
        sx.search_plans(sx.SearchSpace(meshes=[{"stage": 8}]), init, loss_fn=loss_fn, batch=batch)
    config = sx.train.StepConfig(
        mesh=sx.make_mesh({"data": 8}), plan=sx.fsdp(sx.make_mesh({"data": 8}))
    )
    with pytest.raises(ValueError, match="build it with plan=None and mode='jit'"):
        sx.SearchSpace(config=config)


def test_auto_step_checks_its_settings_without_building_a_step(monkeypatch, mesh):
    from shardax.train import step as step_module

    def refuse(*args, **kwargs):
        raise AssertionError("a TrainStep was built to validate")

    monkeypatch.setattr(step_module.TrainStep, "__init__", refuse)
    step = sx.make_train_step(lambda model, batch: 0.0, mesh=mesh, plan="auto", accumulate=2)
    assert step.config.accumulate == 2 and step.plan is None
    with pytest.raises(TypeError, match="loss_fn takes 'extra'"):
        sx.make_train_step(lambda model, batch, extra: 0.0, mesh=mesh, plan="auto")


def test_each_mesh_keeps_the_counts_that_split_its_rows(mesh):
    import numpy as np

    from shardax.train.auto.space import _dividing

    batch = {"x": np.zeros((16, 4), np.float32)}  # 16 rows: 2 per device on data=8
    assert _dividing((1, 2, 4), mesh, "data", batch) == (1, 2)
    small = sx.make_mesh({"data": 2, "stage": 4})  # 8 rows per data shard: every count
    assert _dividing((1, 2, 4), small, "data", batch) == (1, 2, 4)
    assert _dividing((4, 8), mesh, "data", batch) == (4, 8)  # none: the check names the rule
    assert _dividing(2, mesh, "data", batch) == 2


def test_precisions_are_checked_and_fp8_is_refused_where_it_does_not_apply(example):
    init, loss_fn, batch = example["init"], example["loss_fn"], example["sequences"]
    for given, error, says in (
        ("fp8", TypeError, "precisions must be a list of precision names"),
        ((), ValueError, "precisions is empty"),
        (("bf16", "int8"), ValueError, "precisions: 'int8' is not a precision name"),
        (("bf16", "bf16"), ValueError, "precisions names one twice"),
    ):
        with pytest.raises(error, match=re.escape(says)):
            sx.SearchSpace(precisions=given)
    space = sx.SearchSpace(plans=("fsdp",), precisions=("bf16", "fp8"))
    # XLA:CPU widens fp8 operands: no prediction of fp8's speed means anything here
    says = "'fp8' does not apply here: fp8 matmuls need fp8 tensor cores (an NVIDIA GPU of "
    with pytest.raises(ValueError, match=re.escape(says) + r".*these are cpu devices \(cpu\)"):
        sx.search_plans(space, init, loss_fn=loss_fn, batch=batch)
