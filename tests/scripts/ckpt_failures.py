"""Subprocess worker for checkpoint/test_async_failures.py: async saves that fail or are
never waited for. Each mode prints what happened; the test checks that the process ends.

    python ckpt_failures.py MODE DIRECTORY [MOUNTPOINT]

``readonly`` turns the directory read-only after the first save: ``chmod`` for a user,
a remount of the tmpfs at MOUNTPOINT for root (whom ``chmod`` does not stop).
"""

import atexit
import os
import resource
import signal
import subprocess
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402

import shardax as sx  # noqa: E402

mode, directory = sys.argv[1], sys.argv[2]
small = {"w": jnp.ones((4,))}
big = {"w": jax.random.normal(jax.random.key(0), (512, 512))}  # 1 MiB, incompressible


def small_files():
    """Files over 64 KiB fail to grow, as on a full disk. Python writes no bytecode after:
    a module imported later would leave its cut-short .pyc (a short write is no error) in
    the tests' shared PYTHONPYCACHEPREFIX, for every later process to fail on."""
    sys.dont_write_bytecode = True
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))


def steps_of_a_run(run, steps):
    state = run.state
    for _ in run.batches(range(steps)):
        state = {"w": state["w"] + 1}
        run.after_step(state)
    return state


if mode == "run-hold":  # a run that holds its directory, with a save in flight
    with sx.loop.run(small, checkpoints=directory, every={"save": 1}, goodput=False) as run:
        steps_of_a_run(run, 2)
        # what an async save of step 3 looks like while it is written
        os.makedirs(os.path.join(directory, "3.orbax-checkpoint-tmp-1"), exist_ok=True)
        print("holding", flush=True)
        sys.stdin.readline()
        os.rmdir(os.path.join(directory, "3.orbax-checkpoint-tmp-1"))
        steps_of_a_run(run, 1)
    print("end", flush=True)
    sys.exit(0)
if mode == "run-full":  # the disk fills up before sx.loop.run's (synchronous) save of step 2
    try:
        with sx.loop.run(big, checkpoints=directory, every={"save": 1}, goodput=False) as run:
            state = run.state
            for _ in run.batches(range(3)):
                state = {"w": state["w"] + 1}
                if run.step == 2:  # files over 64 KiB fail, as on a full disk
                    small_files()
                run.after_step(state)
    except OSError as e:
        print(f"run: {e}", flush=True)
    print(f"steps: {sx.CheckpointManager(directory).all_steps()}", flush=True)
    print("end", flush=True)
    sys.exit(0)
if mode == "run-second":  # a second run started on the directory
    try:
        with sx.loop.run(small, checkpoints=directory, goodput=False) as run:
            steps_of_a_run(run, 5)
    except RuntimeError as e:
        print(f"second: {e}", flush=True)
    print(f"steps: {sx.CheckpointManager(directory).all_steps()}", flush=True)
    print("end", flush=True)
    sys.exit(0)

manager = sx.CheckpointManager(directory, async_save=True)
manager.save(1, small)
manager.wait()

if mode == "readonly":  # the step's directory cannot be made
    if len(sys.argv) > 3:
        subprocess.run(["mount", "-o", "remount,ro", sys.argv[3]], check=True)
    else:
        os.chmod(directory, 0o555)
elif mode == "full":  # a write fails half-way (as a full disk): files over 64 KiB fail
    small_files()

if mode in ("readonly", "full"):
    manager.save(2, big)
    try:
        manager.wait()
    except OSError as e:
        print(f"wait: {e}", flush=True)
    print(f"steps: {manager.all_steps()}", flush=True)
    manager.close()
elif mode == "unwaited":
    manager.save(2, big)  # the script ends with the save in flight
    # (atexit runs after shardax's hook, which runs as the threads stop) whether orbax's
    # late write callbacks, on a loop already closed, still meet shardax's quiet hook
    atexit.register(
        lambda: print(f"quiet: {hasattr(sys.unraisablehook, 'shardax_late_completions')}")
    )
elif mode == "second":
    other = sx.CheckpointManager(directory, async_save=True)
    try:
        other.save(2, {"w": jnp.zeros((4,))})
    except RuntimeError as e:
        print(f"second: {e}", flush=True)
    manager.save(2, big)
    manager.close()
    print(f"steps: {other.all_steps()}", flush=True)
    other.save(3, small)  # the first manager closed: the directory is free
    other.close()
elif mode == "hold":  # another process holds the directory while this one saves
    print("holding", flush=True)
    sys.stdin.readline()
    manager.close()
print("end", flush=True)
