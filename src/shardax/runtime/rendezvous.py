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
import socket
import time

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
                    "address and process count"
                ) from None
            try:
                hello = _read_line(conn, deadline).split()
            except OSError:
                conn.close()
                continue
            if len(hello) != 3 or hello[0] != _HELLO or not (hello[1] + hello[2]).isdigit():
                conn.close()  # not one of ours (a port scan, a health check)
                continue
            rank, count = int(hello[1]), int(hello[2])
            problem = ""
            if count != num_processes:
                problem = (
                    f"process {rank} was started with num_processes={count}, process 0 with "
                    f"{num_processes}"
                )
            elif rank in peers:
                problem = f"process_id {rank} is given to two processes"
            if problem:
                conn.sendall(f"error {problem}\n".encode())
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
                    "started there, or the address is wrong"
                ) from None
            time.sleep(0.1)
    with conn:
        try:
            conn.sendall(f"{_HELLO} {rank} {count}\n".encode())
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
