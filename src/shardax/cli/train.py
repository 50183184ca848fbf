"""``shardax train``: an NNX MLP on scikit-learn's digits, on all devices.

The main job. It builds a mesh (``--mesh``), shards the model and Adam state with a plan
(``--plan replicate|fsdp|tp``), feeds each global batch split over the ``data`` axis, and
shows a progress bar with loss, accuracy and examples/s (process 0 only). At the end it
writes ``summary.json`` and ``curves.png`` to the run directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import numpy as np

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    console,
    mesh_spec,
    positive_float,
    positive_int,
    print_json,
    pyplot,
    run_dir,
)
from shardax.cli.demo import PLANS, load_digits, make_mlp, make_plan
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE

MODES = ("jit", "single", "shard_map", "pmap")
TARGET_ACCURACY = 0.95


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax train``."""
    parser.add_argument(
        "--mesh",
        type=mesh_spec,
        default=None,
        help="mesh axes, e.g. data=4,model=2 (default: data=-1; with --plan tp: data=-1,model=2)",
    )
    parser.add_argument(
        "--plan", choices=PLANS, default="replicate", help="how to shard the model and Adam state"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="jit",
        help="jit: one program over the mesh, any plan (default); shard_map: per-device "
        "step with an explicit gradient all-reduce; pmap: seed 003's layout; single: one "
        "device. shard_map and pmap keep a whole copy of the state per device (replicate)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=128, help="global batch size (default: 128)"
    )
    parser.add_argument("--epochs", type=positive_int, default=15, help="passes over the data")
    parser.add_argument("--hidden", type=positive_int, default=256, help="hidden width")
    parser.add_argument(
        "--lr", type=positive_float, default=3e-3, help="Adam learning rate (default: 3e-3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where to write summary.json and curves.png (default: runs/train-<time>)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save a checkpoint every epoch, and on SIGTERM (preemption: saved at the next "
        f"step, then exit code {PREEMPTED_EXIT_CODE})",
    )
    parser.add_argument(
        "--save-every", type=positive_int, default=None, help="also save every N steps"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--step-timeout",
        type=positive_float,
        default=None,
        help="hang watchdog: a step (after the first, which compiles) that takes longer than "
        f"S seconds dumps every thread's stack and exits with code {WATCHDOG_EXIT_CODE} "
        "(default: off)",
    )
    add_json_flag(parser)


def _mesh(args: argparse.Namespace) -> Any:
    import jax

    import shardax as sx

    if args.mode == "single":
        if args.mesh is not None or args.plan != "replicate":
            raise UsageError("--mode single runs on one device: drop --mesh and --plan")
        return sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    spec = args.mesh or ([("data", -1), ("model", 2)] if args.plan == "tp" else [("data", -1)])
    if "data" not in dict(spec):
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {args.mesh}")
    try:
        return sx.make_mesh(spec)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def _check_batch_fits(args: argparse.Namespace, mesh: Any) -> None:
    """The global batch must split evenly over the data axis; the error names both sizes
    and the ways out (a resumed run keeps its batch size, so only the mesh can change)."""
    data_size, batch = mesh.shape["data"], args.batch_size
    if batch % data_size == 0:
        return
    fits = [d for d in range(mesh.size, 0, -1) if batch % d == 0 and mesh.size % d == 0]
    meshes = ", ".join(
        f"data={d}" + (f",model={mesh.size // d}" if d < mesh.size else "") for d in fits[:3]
    )
    if args.resume:
        way = (
            f"a resumed run keeps the checkpoint's global batch (its data position counts "
            f"batches of {batch}), so pass a --mesh whose data axis divides {batch} on these "
            f"{mesh.size} devices ({meshes}), or run on a device count it divides"
        )
    else:
        way = (
            f"pass a --batch-size that is a multiple of {data_size}, or a --mesh whose data "
            f"axis divides {batch} ({meshes})"
        )
    raise UsageError(
        f"--batch-size {batch} is not divisible by the data axis size {data_size} of mesh "
        f"{dict(mesh.shape)}; {way}"
    )


def _resume(args: argparse.Namespace, manager: Any, state: Any) -> tuple[Any, dict[str, Any]]:
    """The state and data state (epoch done, history, loader position) to start from."""
    if not args.resume:
        if manager is not None and manager.latest_step() is not None:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints; pass "
                "--resume to continue from them, or choose an empty directory"
            )
        return state, {"epoch": 0, "history": [], "loader": {"epoch": 0, "index": 0}}
    if manager is None:
        raise UsageError("--resume needs --checkpoint-dir")
    if manager.latest_step() is None:
        raise UsageError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    try:
        restored = manager.restore(like=state)
    except ValueError as e:
        raise UsageError(f"--resume: the checkpoint does not fit this model: {e}") from None
    return restored.state, restored.data_state


def train(args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Trains and returns the summary (plain data)."""
    import jax
    import jax.numpy as jnp
    import optax
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    import shardax as sx
    from shardax.data.policy import pad_batch

    mesh = _mesh(args)
    data_size = mesh.shape["data"]
    _check_batch_fits(args, mesh)
    if args.save_every is not None and not args.checkpoint_dir:
        raise UsageError(f"--save-every {args.save_every} needs --checkpoint-dir")
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

    state = sx.TrainState.create(
        make_mlp(64, args.hidden, 1, 10, args.seed), optax.adam(args.lr), rng=args.seed
    )
    try:
        plan = make_plan(args.plan, mesh)
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, mode=args.mode)
        state = step.shard(state)
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} --mode {args.mode} on mesh {dict(mesh.shape)}: {e}"
        ) from None
    batch_sharding = sx.batch_sharding(mesh)

    @jax.jit
    def evaluate(state: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        loss, aux = loss_fn(state.model, batch)
        return {"loss": loss, **aux}

    # The whole test set in one batch, padded to a multiple of the data axis, with a mask.
    padded = -(-len(x_test) // data_size) * data_size
    test_batch = sx.distribute_batch(pad_batch({"x": x_test, "y": y_test}, padded), batch_sharding)
    is_main = jax.process_index() == 0
    manager = sx.CheckpointManager(args.checkpoint_dir) if args.checkpoint_dir else None
    state, data_state = _resume(args, manager, state)
    total_steps = args.epochs * steps_per_epoch
    # Steps done; the history of finished epochs; the per-step metrics (floats) and
    # seconds of an epoch a preemption interrupted, so its means come out the same.
    done = int(data_state.get("step", int(data_state["epoch"]) * steps_per_epoch))
    history, partial = data_state["history"], data_state.get("epoch_metrics", [])
    first_done = done // steps_per_epoch
    if done >= total_steps:
        raise UsageError(
            f"--resume: the checkpoint has finished epoch {first_done}; pass --epochs > "
            f"{first_done} to train further"
        )
    described = sx.describe(state)
    if is_main:
        out.print(sx.describe(state.params))
        out.print(
            f"train state (params + Adam) per device: "
            f"{described.total_bytes_per_device / 2**10:.1f} KiB of "
            f"{described.total_bytes / 2**10:.1f} KiB"
        )
        out.print(
            f"training an MLP on digits: {mesh.size} {jax.devices()[0].platform} device(s), "
            f"mesh {dict(mesh.shape)}, plan {args.plan}, mode {args.mode}, "
            f"batch {args.batch_size}, {args.epochs} epochs"
            + (f", resuming at step {done}" if done else "")
        )
    progress = Progress(
        TextColumn("epoch {task.fields[epoch]}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.3f}"),
        TextColumn("{task.fields[rate]:,.0f} ex/s"),
        TimeRemainingColumn(),
        console=out,
        disable=not is_main,
    )
    start = time.perf_counter()
    try:
        loader.set_state(data_state["loader"])
    except ValueError as e:
        raise UsageError(f"--resume: {e}") from None
    feed = sx.prefetch_to_device(loader, batch_sharding)
    watchdog = sx.StepWatchdog(args.step_timeout) if args.step_timeout else None
    # From the first step on, a SIGTERM saves (at the step every process agrees on) and stops.
    preemption = sx.watch_preemption()
    with (
        progress,
        feed,
        preemption,
        manager or contextlib.nullcontext(),
        watchdog or contextlib.nullcontext(),
    ):
        task = progress.add_task(
            "train",
            total=total_steps,
            completed=done,
            epoch=first_done + 1,
            loss=0.0,
            acc=0.0,
            rate=0.0,
        )
        metrics: list[dict[str, Any]] = list(partial)
        checked = len(metrics)  # metrics[:checked] are known to be finite
        epoch_start = time.perf_counter() - data_state.get("epoch_seconds", 0.0)

        def check_losses(epoch: int) -> None:
            """Stops at the first non-finite loss not checked yet, before anything saves."""
            nonlocal checked
            for j in range(checked, len(metrics)):
                sx.check_finite(metrics[j]["loss"], (epoch - 1) * steps_per_epoch + j + 1)
            checked = len(metrics)

        def save(n: int) -> None:
            if manager is not None:
                floats = [{k: float(v) for k, v in m.items()} for m in metrics]
                manager.save(n, state, {
                    "epoch": n // steps_per_epoch,
                    "step": n,
                    "history": history,
                    "epoch_metrics": floats if n % steps_per_epoch else [],
                    "epoch_seconds": time.perf_counter() - epoch_start,
                    "loader": feed.get_state(),
                })  # fmt: skip

        for g in range(done, total_steps):
            epoch, i = g // steps_per_epoch + 1, g % steps_per_epoch
            if i == 0:
                metrics, checked, epoch_start = [], 0, time.perf_counter()
            watched = watchdog.step(g + 1) if watchdog and g > done else contextlib.nullcontext()
            with watched:  # the first step compiles: not watched
                state, m = step(state, next(feed))
                if watchdog:
                    jax.block_until_ready(m["loss"])
            metrics.append(m)
            if i % 4 == 3 or i == steps_per_epoch - 1:
                progress.update(
                    task,
                    completed=g + 1,
                    epoch=epoch,
                    loss=float(m["loss"]),
                    acc=float(m["accuracy"]),
                    rate=min((i + 1) * args.batch_size, len(x_train))
                    / (time.perf_counter() - epoch_start),
                )
            saved = False
            if i == steps_per_epoch - 1:
                seconds = time.perf_counter() - epoch_start
                check_losses(epoch)
                test = evaluate(state, test_batch)
                # Batch means weighted by their real rows: the mean over the epoch's examples.
                rows = np.minimum(
                    args.batch_size, len(x_train) - args.batch_size * np.arange(i + 1)
                )
                mean = {
                    k: float(np.average([float(m[k]) for m in metrics], weights=rows))
                    for k in metrics[0]
                }
                history.append(
                    {
                        "epoch": epoch,
                        "train_loss": mean["loss"],
                        "train_accuracy": mean["accuracy"],
                        "test_loss": float(test["loss"]),
                        "test_accuracy": float(test["accuracy"]),
                        "seconds": seconds,
                        "examples_per_s": len(x_train) / seconds,
                    }
                )
                save(g + 1)
                saved = True
            elif args.save_every and (g + 1) % args.save_every == 0:
                check_losses(epoch)
                save(g + 1)
                saved = True
            if sx.reached_preemption(g + 1):  # every process agrees on this step
                if not saved:
                    check_losses(epoch)
                    save(g + 1)
                raise sx.Preempted(g + 1, args.checkpoint_dir)
    total = time.perf_counter() - start
    steady = history[1:] or history
    shardings = sx.plan.map_arrays(lambda p, x: _spec_text(x), state)
    return {
        "command": "train",
        "devices": mesh.size,
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": str(jax.devices()[0].device_kind),
        "mesh": dict(mesh.shape),
        "plan": args.plan,
        "mode": args.mode,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "steps": args.epochs * steps_per_epoch,
        "resumed_from_epoch": first_done,
        "state_bytes": described.total_bytes,
        "state_bytes_per_device": described.total_bytes_per_device,
        "checkpoint_dir": args.checkpoint_dir,
        "train_examples": len(x_train),
        "test_examples": len(x_test),
        "test_accuracy": history[-1]["test_accuracy"],
        "target_accuracy": TARGET_ACCURACY,
        "seconds": total,
        "examples_per_s": float(np.median([h["examples_per_s"] for h in steady])),
        "param_specs": {k: v for k, v in _flatten(shardings).items() if k.startswith("params/")},
        "history": history,
    }


def _spec_text(x: Any) -> str:
    """The array's PartitionSpec, one entry per dimension (``P()`` when replicated), or
    "one device"."""
    from jax.sharding import PartitionSpec

    spec = getattr(x.sharding, "spec", None)
    if spec is None:
        return "one device"
    if all(entry is None for entry in spec):
        return str(PartitionSpec())
    return str(PartitionSpec(*spec, *[None] * (x.ndim - len(spec))))


def _flatten(tree: Any) -> dict[str, Any]:
    import jax

    from shardax.plan.tree import path_str

    return {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def plot_curves(history: list[dict[str, float]], path: Any, title: str) -> None:
    """Loss and accuracy per epoch, train and test, side by side in one PNG."""
    plt = pyplot("train")
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    ax_loss.plot(epochs, [h["test_loss"] for h in history], "s-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", yscale="log", title="loss")
    ax_acc.plot(epochs, [h["train_accuracy"] for h in history], "o-", label="train")
    ax_acc.plot(epochs, [h["test_accuracy"] for h in history], "s-", label="test")
    ax_acc.axhline(TARGET_ACCURACY, color="gray", ls=":", label=f"{TARGET_ACCURACY:.0%}")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Trains, writes ``summary.json`` and ``curves.png``, prints the result."""
    import jax

    out = console(args)
    summary = train(args, out)
    is_main = jax.process_index() == 0
    if is_main:
        directory = run_dir(args.run_dir, "train")
        summary["run_dir"] = str(directory)
        summary["plot"] = str(directory / "curves.png")
        plot_curves(
            summary["history"],
            directory / "curves.png",
            f"MLP on digits, {summary['devices']} × {summary['platform']}, mesh "
            f"{summary['mesh']}, plan {summary['plan']}",
        )
        (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if args.json:
            print_json(summary)
        else:
            ok = summary["test_accuracy"] >= TARGET_ACCURACY
            out.print(
                f"test accuracy [bold {'green' if ok else 'red'}]{summary['test_accuracy']:.4f}[/]"
                f" in {summary['seconds']:.1f} s ({summary['examples_per_s']:,.0f} examples/s); "
                f"wrote {directory}/summary.json and curves.png"
            )
    return 0
