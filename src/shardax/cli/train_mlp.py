"""``shardax train --model mlp`` (the default): an NNX MLP on scikit-learn's digits.

One evaluation per epoch on the whole test set; the history has one entry per epoch
(loss and accuracy, train and test). The shared loop is ``shardax.cli.loop``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardax as sx
from shardax.cli.common import UsageError, plot_curves, positive_int
from shardax.cli.digits import load_digits
from shardax.cli.job import Job, build_steps, eval_batch, job_mesh, option, place, register
from shardax.data.policy import pad_batch
from shardax.models.mlp import PLANS, make_mlp, make_plan

TARGET_ACCURACY = 0.95


OPTIONS = (
    option("--epochs", 15, type=positive_int, help="passes over the data"),
    option("--hidden", 256, type=positive_int, help="hidden width"),
)
"""The options only this job takes (``shardax train --model mlp``), with their defaults."""


@register(
    "mlp", OPTIONS, defaults={"batch_size": 128, "lr": 3e-3}, plans=PLANS, needs={"sklearn": "demo"}
)
def make_job(args: argparse.Namespace, out: Any) -> Job:
    """The MLP job: digits, the MLP and its plan, per-epoch evaluation."""
    mesh, data_size, _ = job_mesh(args)
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    # Each process reads its share of every global batch; the order depends on the seed
    # and the epoch only; the last batch is padded, with a "mask" leaf marking real rows.
    try:
        loader = sx.batches(
            {"x": x_train, "y": y_train},
            args.batch_size,
            shuffle=True,
            seed=args.seed,
            policy="pad",
            num_epochs=None,
        )
    except ValueError as e:
        raise UsageError(f"--batch-size {args.batch_size}: {e}") from None
    steps_per_epoch = loader.steps_per_epoch

    def loss_fn(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
        logits = model(batch["x"])
        mask = batch["mask"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return sx.masked_mean(losses, mask), {"accuracy": sx.masked_mean(correct, mask)}

    # inject_hyperparams keeps the learning rate in the state, so the step reports it.
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=args.lr)
    state = sx.TrainState.create(make_mlp(64, args.hidden, 1, 10, args.seed), tx, rng=args.seed)
    try:
        plan = make_plan(args.plan, mesh)
    except ValueError as e:
        raise UsageError(f"--plan {args.plan} on mesh {dict(mesh.shape)}: {e}") from None
    step, evaluate_step = build_steps(args, loss_fn, mesh, plan)
    state = place(args, step, state)

    # The whole test set in one batch, padded to a multiple of the data axis, with a mask.
    padded = -(-len(x_test) // data_size) * data_size
    test_batch = eval_batch(mesh, pad_batch({"x": x_test, "y": y_test}, padded))
    # Real rows of each step of an epoch (the last batch is padded).
    rows = np.minimum(args.batch_size, len(x_train) - args.batch_size * np.arange(steps_per_epoch))

    def evaluate(state: Any) -> dict[str, float]:
        return {f"test_{k}": float(v) for k, v in evaluate_step(state, test_batch).items()}

    def records(first: int, window: list[dict[str, float]], test: dict, seconds: float):
        # Batch means weighted by their real rows: the mean over the epoch's examples.
        weights = rows[(np.arange(first, first + len(window)) - 1) % steps_per_epoch]
        mean = {k: float(np.average([m[k] for m in window], weights=weights)) for k in window[0]}
        return [
            {
                "epoch": (first + len(window) - 1) // steps_per_epoch,
                "step": first + len(window) - 1,
                "train_loss": mean["loss"],
                "train_accuracy": mean["accuracy"],
                **test,
                "seconds": seconds,
                "examples_per_s": float(weights.sum()) / seconds,
            }
        ]

    def summary(common: dict[str, Any]) -> dict[str, Any]:
        history = common["history"]
        steady = history[1:] or history
        return {
            "epochs": args.epochs,
            "resumed_from_epoch": common["resumed_from_step"] // steps_per_epoch,
            "train_examples": len(x_train),
            "test_examples": len(x_test),
            "test_accuracy": history[-1]["test_accuracy"],
            "target_accuracy": TARGET_ACCURACY,
            "examples_per_s": float(np.median([h["examples_per_s"] for h in steady])),
        }

    return Job(
        title="an MLP on digits",
        mesh=mesh,
        state=state,
        step=step,
        loader=loader,
        steps=args.epochs * steps_per_epoch,
        eval_every=steps_per_epoch,
        evaluate=evaluate,
        records=records,
        unit="examples",
        items_per_step=args.batch_size,
        progress=lambda m: f"loss {m['loss']:.4f}  acc {m['accuracy']:.3f}",
        summary=summary,
        plot=plot,
        report=report,
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch, train and test."""
    panels = [("loss", "cross-entropy loss"), ("accuracy", "accuracy")]
    plot_curves(summary, path, "MLP on digits", "epoch", panels)


def report(summary: dict[str, Any], out: Any) -> None:
    """The test accuracy against the target, time and throughput."""
    ok = summary["test_accuracy"] >= TARGET_ACCURACY
    out.print(
        f"test accuracy [bold {'green' if ok else 'red'}]{summary['test_accuracy']:.4f}[/]"
        f" in {summary['seconds']:.1f} s ({summary['examples_per_s']:,.0f} examples/s)"
    )
