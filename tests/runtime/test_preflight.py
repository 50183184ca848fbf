"""The preflight of a multi-process join (``shardax.runtime.rendezvous``): processes running
other versions of JAX, jaxlib or shardax are named before JAX's join, on every process; a
loopback coordinator that other hosts cannot reach is named on a timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from test_multihost import CLEAN_ENV

from shardax.cli.launch import free_port
from shardax.runtime import rendezvous


def test_differs_names_the_process_its_host_and_each_version():
    mine = {"jax": "0.10.2", "jaxlib": "0.10.2", "shardax": "0.6.0", "host": "a"}
    assert rendezvous._differs(1, dict(mine, host="b"), mine) == ""
    said = rendezvous._differs(3, {**mine, "jax": "0.12.0", "host": "node7"}, mine)
    assert said.startswith("process 3 on host node7 runs jax 0.12.0 (process 0: 0.10.2);")
    assert "every process must run the same versions" in said
    assert set(rendezvous.facts()) == {"jax", "jaxlib", "shardax", "host"}


@pytest.mark.timeout(60)
def test_a_process_with_another_jax_is_refused_on_every_process():
    port = free_port()
    code = textwrap.dedent(f"""
        import sys
        from shardax.runtime import rendezvous
        rank = int(sys.argv[1])
        if rank == 1:  # as if another jax were installed on its host
            facts = rendezvous.facts
            rendezvous.facts = lambda: {{**facts(), "jax": "0.4.1"}}
        try:
            rendezvous.roll_call("127.0.0.1:{port}", "127.0.0.1", {port}, rank, 2, 30)
        except ValueError as e:
            print("refused:", e)
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True, env=CLEAN_ENV
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    for out in outs:
        assert "refused: at coordinator 127.0.0.1:" in out, outs
        assert "process 1 on host" in out and "runs jax 0.4.1 (process 0:" in out, outs


def test_a_loopback_coordinator_is_named_when_nobody_comes():
    port = free_port()
    with pytest.raises(TimeoutError, match="is a loopback address: processes on other hosts"):
        rendezvous.roll_call(f"localhost:{port}", "localhost", port, 1, 2, 0.5)


@pytest.mark.timeout(120)
def test_a_process_driving_fewer_devices_is_named_and_no_process_goes_on():
    from shardax.cli.launch import process_env, start_processes

    port = free_port()
    envs = [process_env(r, 2, port, cpu_devices=n, base=CLEAN_ENV) for r, n in ((0, 2), (1, 1))]
    code = "import shardax as sx; sx.initialize(); print('joined')"
    procs = start_processes([sys.executable, "-c", code], envs)
    outs = [p.communicate(timeout=100)[0].decode() for p in procs]
    said = "RuntimeError: sx.initialize: process 1 drives 1 device(s), the others 2"
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode != 0 and "joined" not in out, outs
    # Each process says it; one that leaves first may end the other's runtime before it
    # prints (on a loaded machine), so at least one line, and no process goes on.
    assert any(said in out for out in outs), outs
