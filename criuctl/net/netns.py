"""Run a function in another process's network namespace: a pod's, from its node's agent; and read
that namespace's own addresses (`addresses`), which needs no entering.

A pod has a network namespace of its own. The rules that keep a job's connections whole while one
of its ranks moves (`criuctl.net.netcut`) must act on the pod's own packets, so they go into the
pod's namespace, where they also die with it (nothing is left behind when the pod ends). The agent
lives in its node's namespace and runs threads; it forks a child that enters the pod's namespace,
runs the function, sends back its JSON answer or its error, and exits: the agent's own threads
never change namespace. Below `netcut`; imports only `errors`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import itertools
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from criuctl.core.errors import CriuctlError

_CLONE_NEWNET = 0x40000000
# setns, looked up once here: a child forked from the agent's threads calls it and nothing more
# (a dlopen in the child could wait on a lock another thread held at the fork)
_SETNS = ctypes.CDLL(None, use_errno=True).setns
LISTEN_TIMEOUT = 10.0  # s for the child of `listen_in` to hand its socket back


class NetnsError(CriuctlError):
    """The namespace could not be entered (its process is gone), or the function failed in it."""


class PortTaken(NetnsError):
    """The port is taken in the pod's namespace: a process of the pod listens on it."""


def addresses(pid: int) -> list[str]:
    """The addresses of process `pid`'s network namespace other than loopback and link-local, read
    from its /proc (no fork, no setns): a pod's IP as its CNI gave it, known here before the kubelet
    writes it into the pod's status. Empty when the process is gone or has none yet."""
    found: list[str] = []
    try:
        lines = Path(f"/proc/{pid}/net/fib_trie").read_text().splitlines()
        v6 = Path(f"/proc/{pid}/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    for above, line in itertools.pairwise(lines):  # "|-- ADDR" over "/32 host LOCAL": one of its own
        addr = above.strip().removeprefix("|-- ")
        local = above.strip().startswith("|-- ") and line.strip() == "/32 host LOCAL"
        if local and addr not in found and not ipaddress.ip_address(addr).is_loopback:
            found.append(addr)
    for row in v6:  # address (32 hex), ifindex, prefix, scope (00: global), flags, name
        hexa, _, _, scope, *_ = row.split()
        if scope == "00":
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(hexa))))
    return found


def _same(pid: int) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino


def run_in(pid: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in process `pid`'s network namespace; its result must be JSON. An error in it
    comes back as a NetnsError with the same words (a CriuctlError's what and hint)."""
    try:
        if _same(pid):
            return fn(*args)
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(
            f"process {pid}'s network namespace cannot be opened ({exc.strerror})",
            "its pod has ended, or the agent lacks hostPID/root",
        ) from exc
    read, write = os.pipe()
    try:
        child = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        os.close(fd)
        raise
    if child == 0:  # pragma: no cover - the forked child (its coverage is not collected)
        os.close(read)
        answer: dict[str, Any]
        try:
            if _SETNS(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise NetnsError(f"cannot enter process {pid}'s network namespace: {os.strerror(err)}", "")
            answer = {"result": fn(*args)}
        except CriuctlError as exc:
            answer = {"what": exc.what, "hint": exc.hint}
        except BaseException as exc:  # any failure is said to the parent, never raised in the child
            answer = {"what": f"{type(exc).__name__}: {exc}", "hint": ""}
        try:
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.close(fd)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(child, 0)
    try:
        answer = json.loads(data)
    except ValueError:
        raise NetnsError(
            f"the helper in process {pid}'s network namespace died", "see the agent log"
        ) from None
    if "result" not in answer:
        raise NetnsError(answer["what"], answer["hint"])
    return answer["result"]


def listen_in(pid: int, port: int) -> socket.socket:
    """A TCP socket listening on `port`, every address, in process `pid`'s network namespace: made
    by a child that enters the namespace and hands it back over a socket pair (SCM_RIGHTS), so
    that no thread of the caller changes namespace. A socket keeps the namespace it was made in:
    the caller serves a pod's port from its node's namespace. PortTaken when a process there
    listens on it; NetnsError when the namespace is gone or the child did not answer in time."""
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(f"process {pid}'s network namespace cannot be opened ({exc.strerror})", "") from exc
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        child = os.fork()
    except OSError:
        for end in (ours, theirs):
            end.close()
        os.close(fd)
        raise
    if child == 0:  # pragma: no cover - the forked child
        try:
            if _SETNS(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            sock = _listener(port)
            socket.send_fds(theirs, [b"ok"], [sock.fileno()])
        except OSError as exc:  # said to the parent, never raised in the child
            with contextlib.suppress(OSError):
                theirs.sendall(f"{exc.errno}:{exc.strerror or exc}".encode()[:1000])
        finally:
            os._exit(0)
    theirs.close()
    os.close(fd)
    ours.settimeout(LISTEN_TIMEOUT)
    try:
        msg, fds, _, _ = socket.recv_fds(ours, 1024, 1)
    except OSError:  # (a timeout is one)
        msg, fds = b":its helper did not answer", []
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)
    finally:
        ours.close()
        os.waitpid(child, 0)
    if fds:
        return socket.socket(fileno=fds[0])
    code, _, why = msg.decode(errors="replace").partition(":")
    where = f"port {port} in process {pid}'s network namespace"
    if code == str(errno.EADDRINUSE):
        raise PortTaken(
            f"{where} is taken",
            "a process of the pod listens on it: give the webhook and the agents another --prestop-port",
        )
    raise NetnsError(f"cannot listen on {where} ({why or 'its helper died'})", "")


def _listener(port: int) -> socket.socket:
    """Listening on `port` at every address: IPv6 and IPv4 at once where the namespace has IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        addr: tuple[str, int] = ("::", port)
    except OSError:
        sock, addr = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        if sock.family != socket.AF_INET6:
            raise
        sock.close()  # IPv6 is there but has no address (disabled in the pod): IPv4 alone
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
    sock.listen(64)
    sock.setblocking(False)
    return sock
