"""The processes that hold a workload across a migration, so that no crash loses or doubles it.

An agent never freezes or restores a workload in its own process. It starts one of these, talks
to it over two pipes — commands on its stdin, one JSON event per line on its stdout — and the
stdin pipe is a lease: when the agent dies, the pipe closes, and a helper that has not been told
to commit undoes what it did.

    source  freeze the tree, seal the bundle          → {"event": "frozen", ...}
            "commit": the tree dies (post-copy: once the last page is pulled)
                                                      → "committed", then "done"
            "abort" or the lease breaks: the tree runs on where it was → "thawed"
    target  verify the bundle, restore the tree *stopped* → {"event": "restored", ...}
            "commit": the tree runs; this process stays as its supervisor → "running"
            "abort" or the lease breaks: the restored tree is killed → "aborted"

A source that dies *after* committing a post-copy migration, before the last page is pulled,
takes the job with it: that window lasts as long as the page transfer (see docs/architecture.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from criuctl import checkpoint, supervisor, workloads
from criuctl.errors import CriuctlError

HOLD_FILE = "hold.json"  # next to an outgoing bundle: lets a restarted agent thaw an orphaned freeze


def _emit(event: str, **fields: object) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # the agent is gone: the lease decides
        print(json.dumps({"event": event, **fields}), flush=True)


def _error(exc: CriuctlError) -> None:
    _emit("error", what=exc.what, hint=exc.hint, detail=exc.detail)


def _command() -> str:
    """The agent's next command; '' when the lease broke (the agent died or closed it)."""
    try:
        return sys.stdin.readline().strip()
    except OSError:
        return ""


def source(a: argparse.Namespace) -> int:
    parent = Path(a.parent)
    started = time.monotonic()
    try:
        frozen = checkpoint.freeze(a.workload, parent, lazy_port=a.lazy_port)
    except CriuctlError as exc:
        _error(exc)
        return 1
    (parent / HOLD_FILE).write_text(
        json.dumps({"root_pid": frozen.workload.root_pid, "hold_pid": os.getpid(), "state": "frozen"})
    )
    _emit(
        "frozen",
        bundle=str(frozen.bundle_dir),
        freeze_seconds=frozen.freeze_seconds,
        started_ago=time.monotonic() - started,
        rss_bytes=frozen.manifest.rss_bytes,
    )
    if _command() != "commit":
        frozen.thaw()
        (parent / HOLD_FILE).unlink(missing_ok=True)
        _emit("thawed")
        return 0
    (parent / HOLD_FILE).write_text(json.dumps({"root_pid": frozen.workload.root_pid, "state": "committed"}))
    _emit("committed")
    waited = time.monotonic()
    frozen.commit(workloads.MIGRATED, moved_to=a.to)  # post-copy: returns when the last page is pulled
    _emit("done", pages_seconds=time.monotonic() - waited)
    return 0


def target(a: argparse.Namespace) -> int:
    page_server = None
    if a.page_server:
        host, port = a.page_server.rsplit(":", 1)
        page_server = (host, int(port))
    digests = json.loads(Path(a.digests).read_text()) if a.digests else None
    try:
        restored = checkpoint.restore_stopped(Path(a.bundle), a.name, page_server, digests)
    except CriuctlError as exc:
        _error(exc)
        return 1
    _emit("restored", pid=restored.workload.root_pid, criu_seconds=restored.criu_seconds)
    if _command() != "commit":
        restored.abort()
        _emit("aborted")
        return 0
    restored.start(supervisor_pid=os.getpid(), node=a.node)
    _emit("running", pid=restored.workload.root_pid)
    _detach()
    if restored.lazy_daemon is not None:  # the images are read until the last page is in
        threading.Thread(target=_collect, args=(restored.lazy_daemon, Path(a.bundle)), daemon=True).start()
    return supervisor.supervise(restored.workload, restored.stdio, echo=False)


def _collect(lazy: subprocess.Popen, bundle_dir: Path) -> None:
    lazy.wait()
    shutil.rmtree(bundle_dir, ignore_errors=True)


def _detach() -> None:
    """From here on this process is the workload's supervisor: it must outlive the agent."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m criuctl.agent.handoff")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("source")
    s.add_argument("--workload", required=True)
    s.add_argument("--parent", required=True, help="folder the bundle is sealed in")
    s.add_argument("--to", required=True, help="name of the target node, for the workload's record")
    s.add_argument("--lazy-port", type=int, help="post-copy: serve memory pages on this port")
    s.set_defaults(func=source)
    t = sub.add_parser("target")
    t.add_argument("--bundle", required=True)
    t.add_argument("--name")
    t.add_argument("--node", required=True, help="this node's name, for the workload's record")
    t.add_argument("--page-server", help="post-copy: HOST:PORT of the source's page server")
    t.add_argument("--digests", help="JSON file of the sha256s computed while the bundle arrived")
    t.set_defaults(func=target)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
