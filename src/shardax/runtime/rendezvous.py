"""A Python roll call before ``jax.distributed.initialize``: every process is there, or a
Python exception says who is missing.

JAX's own join, when a process never comes, aborts the others from C++ after its
deadline with a message blaming "another task". So [`shardax.initialize`][shardax.initialize] first
meets on the coordinator's port in Python: process 0 listens, every other process
connects and says its rank and the process count; once all ``num_processes`` are
there, process 0 says "go", closes the port, and JAX's coordinator takes it. A process
that never joins, a rank given twice or a different process count is a ``TimeoutError``
or ``ValueError`` naming the address, the timeout and the ranks.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import time
from importlib import metadata

_HELLO = "shardax-join"


def _deadline_left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _read_line(conn: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(_deadline_left(deadline), 0.01))
        chunk = conn.recv(256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _serve(address: str, port: int, num_processes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        server = socket.create_server(
            ("", port), family=family, dualstack_ipv6=family == socket.AF_INET6
        )
    except OSError as e:
        raise OSError(
            f"process 0 cannot listen on port {port} of the coordinator address "
            f"{address}: {e.strerror}; pick a free port"
        ) from None
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < num_processes - 1:
            server.settimeout(max(_deadline_left(deadline), 0.01))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                raise TimeoutError(
                    f"process 0 of {num_processes} waited {timeout:g} s "
                    f"(initialization_timeout) at coordinator {address} for processes "
                    f"{missing}, which never joined; start every process with the same "
                    f"address and process count{_loopback_hint(address.rsplit(':', 1)[0])}"
                ) from None
            try:
                hello = _read_line(conn, deadline).split(maxsplit=3)
            except OSError:
                conn.close()
                continue
            if len(hello) != 4 or hello[0] != _HELLO or not (hello[1] + hello[2]).isdigit():
                conn.close()  # not one of ours (a port scan, a health check)
                continue
            rank, count = int(hello[1]), int(hello[2])
            try:
                theirs = json.loads(hello[3])
            except ValueError:
                theirs = {}
            if count != num_processes:
                problem = (
                    f"process {rank} was started with num_processes={count}, process 0 with "
                    f"{num_processes}"
                )
            elif rank in peers:
                problem = f"process_id {rank} is given to two processes"
            else:
                problem = _differs(rank, theirs, facts())
            if problem:  # every process that came says why, not only this one
                for peer in (conn, *peers.values()):
                    with contextlib.suppress(OSError):
                        peer.sendall(f"error {problem}\n".encode())
                conn.close()
                raise ValueError(f"at coordinator {address}: {problem}")
            peers[rank] = conn
        for conn in peers.values():
            conn.sendall(b"go\n")
        for conn in peers.values():  # the peers close first, so the port is free at once
            with contextlib.suppress(OSError):
                _read_line(conn, time.monotonic() + 5)
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def facts() -> dict[str, str]:
    """What every process of a run must share: the versions of JAX, jaxlib and shardax
    (read from the installed packages: JAX itself is not imported)."""
    out = {}
    for name in ("jax", "jaxlib", "shardax"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["host"] = socket.gethostname()
    return out


def _differs(rank: int, theirs: dict[str, str], mine: dict[str, str]) -> str:
    """The sentence naming what process ``rank`` runs differently from process 0, or ""."""
    wrong = [
        f"{name} {theirs.get(name, 'unknown')} (process 0: {mine[name]})"
        for name in ("jax", "jaxlib", "shardax")
        if theirs.get(name) != mine[name]
    ]
    if not wrong:
        return ""
    host = theirs.get("host", "an unknown host")
    return (
        f"process {rank} on host {host} runs {', '.join(wrong)}; every process must run the "
        "same versions (install the same lock file, e.g. uv sync --locked, on every host)"
    )


def _loopback_hint(host: str) -> str:
    """For a loopback coordinator host: why processes on other hosts never reach it."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
    except (OSError, ValueError):
        return ""
    if not loopback:
        return ""
    return (
        f". The coordinator's host {host} is a loopback address: processes on other hosts "
        "reach their own host there, never process 0; give process 0's hostname or IP address"
    )


def _join(address: str, host: str, port: int, rank: int, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection(
                (host, port), timeout=max(_deadline_left(deadline), 0.01)
            )
        except OSError:
            if _deadline_left(deadline) <= 0:
                raise TimeoutError(
                    f"process {rank} of {count} could not reach coordinator "
                    f"{address} within {timeout:g} s (initialization_timeout): process 0 never "
                    f"started there, or the address is wrong{_loopback_hint(host)}"
                ) from None
            time.sleep(0.1)
    with conn:
        try:
            conn.sendall(f"{_HELLO} {rank} {count} {json.dumps(facts())}\n".encode())
            answer = _read_line(conn, deadline)
        except OSError:
            answer = ""
    if answer.startswith("error "):
        raise ValueError(f"at coordinator {address}: {answer[6:]}")
    if answer != "go":
        raise TimeoutError(
            f"process {rank} of {count} reached coordinator {address}, but the "
            f"other processes did not all join within {timeout:g} s (initialization_timeout)"
        )


def roll_call(
    address: str, host: str, port: int, process_id: int, num_processes: int, timeout: float
) -> None:
    """Returns once all ``num_processes`` processes have met at ``address``; raises
    ``TimeoutError`` (naming the address, the timeout and who is missing) or
    ``ValueError`` (a rank given twice, a different process count) otherwise."""
    if num_processes == 1:
        return
    if process_id == 0:
        _serve(address, port, num_processes, timeout)
    else:
        _join(address, host, port, process_id, num_processes, timeout)
