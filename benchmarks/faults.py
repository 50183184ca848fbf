"""Faults injected into real runs: in-job recovery against checkpoint-restart and no fault.

``shardax launch -n 4 --cpu-devices 2`` trains the small GPT (gloo between the processes).
Three runs of ``--duration`` seconds each, side by side:

- **no fault**: the run as it is, snapshots on (``--max-restarts``, ``--snapshot-every 1``);
- **in-job recovery**: the same, while every ``--interval`` seconds (±25%) a random process
  is killed with -9 or stopped (SIGSTOP): the launcher restarts every process, which resume
  from their newest host-memory snapshot;
- **checkpoint-restart** (before in-job recovery): persistent checkpoints every
  ``--save-every`` steps and no restart in the job: each fault ends the job, and a
  "scheduler" (this script) starts it again with ``--resume`` at once.

Each is stopped with SIGTERM at the end (it saves and exits 75); its steps per wall-hour
are its last completed step over the time. The recovery run's ``status.json`` gives, per
fault, the seconds from the failure to the next completed step and the steps lost. Before
them, ``--pairs`` pairs of short runs, with and without snapshots, interleaved, give the
per-step snapshot cost (the median step time of each). From these figures, the lost
fraction of a 1,024-GPU run with a 7.9 h mean time to failure (arXiv 2410.21680) is
predicted beside checkpoint-restart's (a 15 min restart and a 1.5 h save interval: 12.7%).

With ``--peers`` it measures instead peer snapshots (``shardax launch --snapshot-peers``):
the step time without snapshots, with the default ones and with peer ones, interleaved,
and ``--pairs`` runs in which process 1's host is replaced halfway (its snapshots gone:
its shards come from a peer), their restart records.

With ``--acceptance N`` it runs instead N short jobs of ``--acceptance-steps`` steps, of 2
and of 4 processes in turn, with a snapshot every step, each hit by two faults at random
steps: first one planned with ``$SHARDAX_FAULT`` (a raise, a kill -9, or a kill -9 while a
snapshot is written: ``raise``, ``kill``, ``snapshot-kill``), then, once the restarted run
has trained again, a kill -9 or a SIGSTOP from outside to a random process. Each job must
exit 0, lose at most one step per fault and end with final params bitwise equal to the
same job without a fault; the table says how many did.

    python benchmarks/faults.py                      # 3 x 600 s, a fault every 30 s
    python benchmarks/faults.py --duration 180 --interval 30 --json
    python benchmarks/faults.py --acceptance 10      # 20 faults in 10 jobs
    python benchmarks/faults.py --peers --processes 2 --pair-steps 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from shardax.runtime import launcher, status

GPT = ["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "64",
       "--batch-size", "16", "--log-every", "1000"]  # fmt: skip
MTTF_HOURS, GPUS = 7.9, 1024  # arXiv 2410.21680: 1,024 GPUs
CKPT_RESTART_LOST = (0.25 + 1.5 / 2) / MTTF_HOURS  # 15 min restart, half a 1.5 h interval
AUTO_BUDGET = 0.05  # --snapshot-every auto: a snapshot costs at most this share of a step


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of each run")
    parser.add_argument("--interval", type=float, default=30, help="seconds between faults")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--cpu-devices", type=int, default=2, help="per process")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint-restart's")
    parser.add_argument("--pairs", type=int, default=2, help="snapshot cost: runs of each")
    parser.add_argument("--pair-steps", type=int, default=60, help="steps of each such run")
    parser.add_argument("--acceptance", type=int, default=0, help="jobs of two faults each")
    parser.add_argument("--acceptance-steps", type=int, default=24, help="steps of each job")
    parser.add_argument(
        "--peers", action="store_true", help="peer snapshots: their step cost, a host replaced"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def launch(
    args: argparse.Namespace,
    root: Path,
    name: str,
    *train: str,
    restarts: int,
    processes: int | None = None,
    fault: str | None = None,
    launch_options: Sequence[str] = (),
) -> tuple[subprocess.Popen, Path]:
    """``shardax launch`` of ``shardax train`` in ``root/name``; the process and its
    launch directory."""
    run = root / name
    argv = [sys.executable, "-m", "shardax", "launch", "-n", str(processes or args.processes),
            "--cpu-devices", str(args.cpu_devices), "--max-restarts", str(restarts),
            *launch_options, "--launch-dir", str(run / "launch"), "--", sys.executable, "-m",
            "shardax", "train", *GPT, "--seed", str(args.seed), "--run-dir", str(run / "run"),
            *train]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    log = (run / "out.log").open("a")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDAX_")}
    if fault:
        env["SHARDAX_FAULT"] = fault
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, run / "launch"


def final_params(ckpt: Path) -> dict[str, bytes]:
    """The newest checkpoint's state in ``ckpt``, each leaf's bytes by path (read with
    orbax as NumPy arrays, whatever the shardings it was saved with)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(ckpt / str(step) / "state")
    tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = reader.restore(ckpt / str(step) / "state", restore_args=as_numpy)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in leaves}


def acceptance_job(args: argparse.Namespace, root: Path, job: int, rng: random.Random) -> dict:
    """One job of ``--acceptance``: a planned fault, then one from outside (the module)."""
    processes = 2 if job % 2 == 0 else 4
    steps = args.acceptance_steps
    kind = ("raise", "kill", "snapshot-kill")[job % 3]
    first = f"{rng.randrange(processes)}:{rng.randint(2, steps // 3)}:{kind}"
    train = [
        "--steps",
        str(steps),
        "--snapshot-every",
        "1",
        "--save-every",
        "1000",
        "--checkpoint-dir",
        str(root / f"job{job}" / "ckpt"),
    ]
    began = time.monotonic()
    proc, launch_dir = launch(
        args, root, f"job{job}", *train, restarts=3, processes=processes, fault=first
    )
    second: dict = {}
    try:
        while proc.poll() is None and not second:  # after the first restart has trained
            record = launcher.read_status(launch_dir)
            restarts = record.get("restarts", [])
            if len(restarts) == 1 and restarts[0].get("first_step") is not None:
                target = rng.randint(restarts[0]["first_step"] + 1, steps - 3)
                while completed(launch_dir, processes) < target and proc.poll() is None:
                    time.sleep(0.01)
                rank = rng.randrange(processes)
                sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record["ranks"][str(rank)]["pid"], sig)
                    second = {"rank": rank, "kind": signal.Signals(sig).name, "step": target}
            time.sleep(0.05)
        code = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "no exit within 900 s"
    restarts = launcher.read_status(launch_dir).get("restarts", [])
    return {
        "job": job,
        "processes": processes,
        "faults": [first, second],
        "exit_code": code,
        "restarts": restarts,
        "seconds": time.monotonic() - began,
        "ckpt": str(root / f"job{job}" / "ckpt"),
    }


def acceptance(args: argparse.Namespace, root: Path) -> dict:
    """``--acceptance N``: N jobs of two faults each; what every job must meet, counted."""
    rng = random.Random(args.seed)
    want = {}
    for processes in (2, 4):  # the same jobs without a fault
        ckpt = root / f"reference-{processes}" / "ckpt"
        proc, _ = launch(
            args,
            root,
            f"reference-{processes}",
            "--steps",
            str(args.acceptance_steps),
            "--snapshot-every",
            "1",
            "--save-every",
            "1000",
            "--checkpoint-dir",
            str(ckpt),
            restarts=1,
            processes=processes,
        )
        assert proc.wait(timeout=900) == 0, f"the reference run of {processes} failed"
        want[processes] = final_params(ckpt)
    jobs = [acceptance_job(args, root, job, rng) for job in range(args.acceptance)]
    for job in jobs:
        job["bitwise"] = (
            job["exit_code"] == 0 and final_params(Path(job["ckpt"])) == want[job["processes"]]
        )
    restarts = [r for job in jobs for r in job["restarts"]]
    recover_s = [
        r["seconds_to_next_step"] for r in restarts if r.get("seconds_to_next_step") is not None
    ]
    lost = [r.get("steps_lost") for r in restarts]
    return {
        "jobs": jobs,
        "faults": sum(len([f for f in job["faults"] if f]) for job in jobs),
        "restarts": len(restarts),
        "exit_0": sum(job["exit_code"] == 0 for job in jobs),
        "bitwise": sum(job["bitwise"] for job in jobs),
        "steps_lost_max": max((x for x in lost if x is not None), default=None),
        "steps_lost_unknown": sum(x is None for x in lost),
        "recovery_s_p50": statistics.median(recover_s) if recover_s else None,
        "recovery_s_p95": statistics.quantiles(recover_s, n=20)[-1] if len(recover_s) > 1 else None,
    }


def print_acceptance(result: dict, args: argparse.Namespace) -> None:
    print(
        f"{args.acceptance} jobs of {args.acceptance_steps} steps (2 and 4 processes x "
        f"{args.cpu_devices} CPU devices, the small GPT), a snapshot every step"
    )
    for job in result["jobs"]:
        lost = [r.get("steps_lost") for r in job["restarts"]]
        print(
            f"  job {job['job']}: {job['processes']} processes, faults {job['faults'][0]} "
            f"then {job['faults'][1] or 'none'}: exit {job['exit_code']}, "
            f"{len(job['restarts'])} restarts, steps lost {lost}, bitwise {job['bitwise']}, "
            f"{job['seconds']:.0f} s"
        )
    print(
        f"  {result['faults']} faults, {result['restarts']} restarts: {result['exit_0']} of "
        f"{len(result['jobs'])} jobs exit 0, {result['bitwise']} bitwise equal to no fault; "
        f"steps lost per fault at most {result['steps_lost_max']}; failure to next "
        f"completed step p50 {result['recovery_s_p50']} s, p95 {result['recovery_s_p95']} s"
    )


def completed(launch_dir: Path, processes: int) -> int:
    """The last step every process has completed, by their status records."""
    steps = [(status.read_record(launch_dir, r) or {}).get("completed") for r in range(processes)]
    return min((s or 0) for s in steps)


def inject_faults(
    launch_dir: Path, args: argparse.Namespace, stop: threading.Event, rng: random.Random
) -> list[dict]:
    """Every ``interval`` seconds (±25%), kill -9 or SIGSTOP a random process of the launch
    (once it has trained since the last fault); returns what it did."""
    done: list[dict] = []
    last = -1
    while not stop.wait(args.interval * rng.uniform(0.75, 1.25)):
        now = completed(launch_dir, args.processes)
        ranks = launcher.read_status(launch_dir).get("ranks", {})
        if now <= last or len(ranks) != args.processes:
            continue  # still recovering from the last one
        rank = rng.randrange(args.processes)
        kind = rng.choice([signal.SIGKILL, signal.SIGSTOP])
        try:
            os.kill(ranks[str(rank)]["pid"], kind)
        except ProcessLookupError:
            continue
        done.append({"rank": rank, "kind": signal.Signals(kind).name, "at": time.time()})
        last = now
    return done


def timed_run(args: argparse.Namespace, root: Path, name: str, faults: bool, *train: str,
              restarts: int) -> dict:  # fmt: skip
    """One run of ``--duration`` seconds (with faults injected if ``faults``); its steps per
    wall-hour, faults and restarts."""
    rng = random.Random(args.seed + hash(name) % 1000)
    proc, launch_dir = launch(args, root, name, *train, restarts=restarts)
    start, stop, injected = time.monotonic(), threading.Event(), []
    thread = None
    if faults:
        thread = threading.Thread(
            target=lambda: injected.extend(inject_faults(launch_dir, args, stop, rng))
        )
        thread.start()
    time.sleep(args.duration)
    stop.set()
    if thread is not None:
        thread.join()
    steps = completed(launch_dir, args.processes)
    proc.send_signal(signal.SIGTERM)
    try:
        with_ok = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:  # a preemption that did not end: said in the result
        proc.kill()  # its processes end with it (shardax.runtime.launcher)
        with_ok = "no exit within 120 s of SIGTERM"
    elapsed = time.monotonic() - start
    record = launcher.read_status(launch_dir)
    return {"steps": steps, "seconds": args.duration, "steps_per_hour": steps / args.duration
            * 3600, "faults": injected, "restarts": record.get("restarts", []),
            "exit_code": with_ok, "wall": elapsed}  # fmt: skip


def checkpoint_restart(args: argparse.Namespace, root: Path) -> dict:
    """Checkpoint-restart: no restart in the job; the job started again with ``--resume``
    after each fault, until ``--duration`` seconds have passed."""
    rng = random.Random(args.seed + 7)
    ckpt = root / "ckpt-restart" / "ckpt"
    begin, faults, starts, steps = time.monotonic(), [], 0, 0
    while time.monotonic() - begin < args.duration:
        resume = ["--resume"] if ckpt.exists() and any(ckpt.iterdir()) else []
        train = ["--steps", "100000", "--checkpoint-dir", str(ckpt), "--save-every",
                 str(args.save_every), "--snapshot-every", "0", *resume]  # fmt: skip
        proc, launch_dir = launch(args, root, f"ckpt-restart/{starts}", *train, restarts=0)
        starts += 1
        left = args.duration - (time.monotonic() - begin)
        wait = min(left, args.interval * rng.uniform(0.75, 1.25))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
        steps = max(steps, completed(launch_dir, args.processes))
        if time.monotonic() - begin >= args.duration:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        ranks = launcher.read_status(launch_dir).get("ranks", {})
        if ranks and proc.poll() is None:
            rank = rng.randrange(args.processes)
            os.kill(ranks[str(rank)]["pid"], signal.SIGKILL)
            faults.append({"rank": rank, "kind": "SIGKILL", "at": time.time()})
        proc.wait(timeout=300)
    return {"steps": steps, "seconds": args.duration, "faults": faults, "starts": starts,
            "steps_per_hour": steps / args.duration * 3600}  # fmt: skip


def snapshot_cost(args: argparse.Namespace, root: Path) -> dict:
    """Median step time with and without a snapshot every step, in interleaved runs."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    for pair in range(args.pairs):
        for key, every in (("with", "1"), ("without", "0")):
            name = f"cost/{key}-{pair}"
            proc, _ = launch(args, root, name, "--steps", str(args.pair_steps),
                             "--snapshot-every", every, restarts=1)  # fmt: skip
            proc.wait(timeout=900)
            summary = json.loads((root / name / "run" / "summary.json").read_text())
            times[key].append(summary["seconds_per_step"])
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    return {"step_s_with": with_s, "step_s_without": without_s,
            "overhead": with_s / without_s - 1, "runs": times}  # fmt: skip


def peers(args: argparse.Namespace, root: Path) -> dict:
    """Peer snapshots (``shardax launch --snapshot-peers``): the median step time without
    snapshots, with the default ones and with peer ones every step, in interleaved runs;
    then ``--pairs`` runs in which process 1's host is replaced halfway (a ``host`` fault:
    its snapshots gone, its shards fetched from a peer), each one's restart record."""
    kinds = {"without": ("0", ()), "snapshots": ("1", ()), "peers": ("1", ("--snapshot-peers",))}
    times: dict[str, list[float]] = {key: [] for key in kinds}
    for pair in range(args.pairs):
        for key, (every, options) in kinds.items():
            name = f"peers/{key}-{pair}"
            proc, _ = launch(args, root, name, "--steps", str(args.pair_steps), "--snapshot-every",
                             every, restarts=1, launch_options=options)  # fmt: skip
            proc.wait(timeout=900)
            summary = json.loads((root / name / "run" / "summary.json").read_text())
            times[key].append(summary["seconds_per_step"])
    replaced = []
    for pair in range(args.pairs):
        name = f"peers/host-{pair}"
        proc, launch_dir = launch(args, root, name, "--steps", str(args.pair_steps),
                                  "--snapshot-every", "1", restarts=1,
                                  launch_options=("--snapshot-peers",),
                                  fault=f"1:{args.pair_steps // 2}:host")  # fmt: skip
        code = proc.wait(timeout=900)
        (restart,) = launcher.read_status(launch_dir)["restarts"]
        fetched = "its shards came from a peer's copy" in (root / name / "out.log").read_text()
        replaced.append({"exit_code": code, "fetched_from_peer": fetched, **{
            k: restart.get(k) for k in ("restored_step", "steps_lost", "seconds_to_next_step")
        }})  # fmt: skip
    step = {key: statistics.median(value) for key, value in times.items()}
    return {"processes": args.processes, "cpu_devices": args.cpu_devices, "step_s": step,
            "overhead_snapshots": step["snapshots"] / step["without"] - 1,
            "overhead_peers": step["peers"] / step["without"] - 1, "runs": times,
            "replaced_host": replaced}  # fmt: skip


def print_peers(result: dict) -> None:
    step = result["step_s"]
    print(f"{result['processes']} processes x {result['cpu_devices']} CPU devices, the small "
          "GPT, a snapshot every step (medians of interleaved runs)")  # fmt: skip
    print(f"  no snapshots     {step['without'] * 1e3:7.1f} ms a step")
    for key, words in (("snapshots", "snapshots     "), ("peers", "peer snapshots")):
        print(f"  {words}   {step[key] * 1e3:7.1f} ms ({result['overhead_' + key]:+.0%})")
    for r in result["replaced_host"]:
        print(f"  host replaced: exit {r['exit_code']}, fetched from a peer: "
              f"{r['fetched_from_peer']}, restored step {r['restored_step']}, steps lost "
              f"{r['steps_lost']}, {r['seconds_to_next_step']:.1f} s to the next step")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="shardax-faults-"))
    if args.peers:
        result = peers(args, root)
        print(json.dumps(result, indent=1)) if args.json else print_peers(result)
        return
    if args.acceptance:
        result = acceptance(args, root)
        print(json.dumps(result, indent=1)) if args.json else print_acceptance(result, args)
        return
    cost = snapshot_cost(args, root)
    steady = timed_run(args, root, "no-fault", False, "--steps", "100000", restarts=1000)
    recovered = timed_run(args, root, "recovery", True, "--steps", "100000", restarts=1000)
    restart = checkpoint_restart(args, root)
    recover_s = [r["seconds_to_next_step"] for r in recovered["restarts"]
                 if r.get("seconds_to_next_step") is not None]  # fmt: skip
    lost = [r["steps_lost"] for r in recovered["restarts"] if r.get("steps_lost") is not None]
    p50 = statistics.median(recover_s) if recover_s else float("nan")
    p95 = statistics.quantiles(recover_s, n=20)[-1] if len(recover_s) > 1 else p50
    # Lost at 1,024 GPUs: the snapshots' share of each step, then each fault's restart and
    # lost steps. With a snapshot every step the share is the measured overhead; under
    # auto (the default) at most its 5% budget, with the steps lost that auto's interval cost.
    step_s, faults_s = cost["step_s_without"], MTTF_HOURS * 3600
    every_step = cost["overhead"] + (p95 + cost["step_s_with"]) / faults_s
    predicted = AUTO_BUDGET + (p95 + statistics.mean(lost or [0]) * step_s) / faults_s
    result = {
        "processes": args.processes, "cpu_devices": args.cpu_devices,
        "snapshot_cost": cost, "no_fault": steady, "recovery": recovered,
        "checkpoint_restart": restart,
        "recovery_s_p50": p50, "recovery_s_p95": p95,
        "steps_lost_max": max(lost) if lost else None,
        "steps_lost_mean": statistics.mean(lost) if lost else None,
        "predicted_lost_fraction_1024_gpus": predicted,
        "predicted_lost_fraction_1024_gpus_snapshot_every_step": every_step,
        "checkpoint_restart_lost_fraction_1024_gpus": CKPT_RESTART_LOST,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.processes} processes x {args.cpu_devices} CPU devices, the small GPT, "
          f"{args.duration:.0f} s per run, a fault every ~{args.interval:.0f} s")  # fmt: skip
    for name, run in (("no fault", steady), ("in-job recovery", recovered),
                      ("checkpoint-restart", restart)):  # fmt: skip
        ratio = run["steps_per_hour"] / steady["steps_per_hour"]
        print(f"  {name:20s} {run['steps_per_hour']:9.0f} steps/h ({ratio:.2f} x no fault), "
              f"{len(run['faults'])} faults")  # fmt: skip
    print(
        f"  failure to next completed step: p50 {p50:.1f} s, p95 {p95:.1f} s; steps lost per "
        f"fault: max {result['steps_lost_max']}, mean {result['steps_lost_mean']}"
    )
    print(
        f"  snapshot every step: {cost['step_s_with'] * 1e3:.1f} ms against "
        f"{cost['step_s_without'] * 1e3:.1f} ms a step ({cost['overhead']:+.1%})"
    )
    print(
        f"  predicted lost fraction at {GPUS} GPUs, MTTF {MTTF_HOURS} h: {predicted:.1%} "
        f"(checkpoint-restart: {CKPT_RESTART_LOST:.1%})"
    )


if __name__ == "__main__":
    main()
