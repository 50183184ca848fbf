"""``shardax train``'s options come from the jobs' declarations (``shardax.cli.job``), and
each vocabulary the CLI offers is imported from the layer that implements it.

Every check here stops before anything compiles: the refusals come first in ``run``.
"""

import argparse
import ast
import inspect

import pytest

import shardax as sx
from shardax.cli import job, train, train_gpt, train_mlp
from shardax.cli.main import build_parser
from shardax.cli.main import main as cli
from shardax.models import gpt, mlp
from shardax.parallel import context
from shardax.parallel.remat_policy import POLICIES
from shardax.plan.named import MESH_PLANS
from shardax.plan.zero import GATHERS
from shardax.train.config import MODES
from shardax.train.precision import PRECISIONS

JOB_MODULES = {"mlp": train_mlp, "gpt": train_gpt}
SHARED_MODULES = ("cli.job", "cli.loop", "cli.hooks", "cli.common", "cli.track", "cli.train")


def train_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["train"]._actions if a.option_strings}


def args_read(module) -> set[str]:
    """The ``args.NAME`` attributes a module reads."""
    tree = ast.parse(inspect.getsource(module))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "args"
    }


def a_value(opt: job.Option) -> list[str]:
    """Command-line words that give ``opt`` a valid value."""
    kw = opt.kwargs
    if kw.get("action") == "store_const":
        return [opt.flag]
    if "choices" in kw:
        return [opt.flag, list(kw["choices"])[-1]]
    return [opt.flag, "1" if "type" in kw else "x"]


def test_the_jobs_are_registered_with_their_modules():
    assert set(job.JOBS) == set(JOB_MODULES)
    assert job.JOBS["gpt"].options == train_gpt.OPTIONS
    assert job.JOBS["mlp"].options == train_mlp.OPTIONS


def test_every_option_of_the_parser_is_shared_or_declared_by_the_jobs_that_read_it():
    actions = train_actions()
    declared = job.job_options()
    assert set(declared) <= set(actions), "a declared option the parser lacks"
    shared = set(actions) - set(declared) - {"help", "cpu_devices"}
    for dest, opt in declared.items():
        assert actions[dest].option_strings == [opt.flag]
        assert actions[dest].default is None  # given is told from left out
    for model, module in JOB_MODULES.items():
        own = {o.dest for o in job.JOBS[model].options}
        read = args_read(module)
        assert read <= set(actions), (
            model,
            "reads an option the parser lacks",
            read - set(actions),
        )
        # A job reads its own options and the shared ones, never another job's...
        assert read & set(declared) == own, (model, sorted(read & set(declared) ^ own))
        # ...and each job-only option is taken by exactly the jobs that read it.
        for dest in own:
            assert model in job.takers(dest)
    for dest in declared:
        readers = [m for m, module in JOB_MODULES.items() if dest in args_read(module)]
        assert job.takers(dest) == readers, dest
    # The command's shared code reads only shared options (or what the jobs set).
    import importlib

    for name in SHARED_MODULES:
        module = importlib.import_module(f"shardax.{name}")
        assert not (args_read(module) & set(declared)), name
    assert {"mesh", "plan", "mode", "batch_size", "lr", "precision", "seed"} <= shared


@pytest.mark.parametrize("model", list(job.JOBS))
def test_an_option_of_another_job_is_refused_by_name(model, capsys):
    own = {o.dest for o in job.JOBS[model].options}
    others = [o for d, o in job.job_options().items() if d not in own]
    assert others  # each job has options the other does not take
    for opt in others:
        assert cli(["train", "--model", model, *a_value(opt)]) == 2
        err = capsys.readouterr().err
        takers = ", ".join(job.takers(opt.dest))
        assert f"{opt.flag}: only for --model {takers}, got --model {model}" in err, err
        assert err.count("\n") == 1


def test_each_job_fills_in_its_own_defaults():
    for model, registered in job.JOBS.items():
        args = build_parser().parse_args(["train", "--model", model])
        job.check_model_options(args)
        job.apply_options(args)
        for opt in registered.options:
            assert getattr(args, opt.dest) == opt.default
        for dest, value in registered.defaults.items():
            assert getattr(args, dest) == value
    args = build_parser().parse_args(["train", "--model", "gpt", "--steps", "7"])
    job.apply_options(args)
    assert args.steps == 7 and args.layers == 2


def test_a_plan_the_job_does_not_build_is_refused_by_name(capsys):
    assert set(train.plan_names()) == set(mlp.PLANS) | set(gpt.PLANS)
    assert train_actions()["plan"].choices == job.plan_names()
    for model, registered in job.JOBS.items():
        for plan in set(job.plan_names()) - set(registered.plans):
            assert cli(["train", "--model", model, "--plan", plan]) == 2
            err = capsys.readouterr().err
            assert f"--plan {plan}: only for --model " in err
            assert f"--model {model} takes {', '.join(registered.plans)}" in err


def test_each_vocabulary_is_the_implementing_layers():
    actions = train_actions()
    assert tuple(actions["mode"].choices) == MODES
    assert tuple(actions["precision"].choices) == tuple(PRECISIONS)
    assert tuple(actions["remat"].choices) == POLICIES
    assert tuple(actions["attention"].choices) == gpt.ATTENTION == ("auto", *context.IMPLS)
    assert set(context.IMPLS) == set(context._SCHEMES)  # the schemes are the implemented ones
    assert tuple(actions["positions"].choices) == gpt.POSITIONS
    # The plans: the mesh's own (sx.plan.named) in every model, auto and plan --target.
    for plans in (mlp.PLANS, gpt.PLANS):
        assert set(MESH_PLANS) <= set(plans)
    from shardax.cli.plan_target import TARGET_PLANS

    assert set(MESH_PLANS) <= set(TARGET_PLANS)


def test_zero_gather_forward_is_zero1s_option(capsys):
    """--zero-gather forward: sx.zero1(mesh, gather="forward"); refused by name without a
    ZeRO plan."""
    assert train_actions()["zero_gather"].choices == GATHERS
    assert cli(["train", "--zero-gather", "forward"]) == 2
    err = capsys.readouterr().err
    assert "--zero-gather forward: only with --plan zero1 or zero2, got --plan replicate" in err
    args = build_parser().parse_args(["train", "--plan", "zero1", "--zero-gather", "forward"])
    job.check_model_options(args)
    job.apply_options(args)
    args.precision = "bf16"  # the job resolves the default from the platform
    mesh = sx.make_mesh({"data": 8})
    step, evaluate = job.build_steps(args, lambda model, batch: 0.0, mesh, sx.zero1(mesh))
    assert step.plan.gathers_forward and evaluate.plan.gathers_forward
