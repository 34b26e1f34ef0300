"""`criuctl` command line: parse, call one workflow, render its result. No mechanism lives here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from criuctl.errors import CriuctlError, require_root


def _cmd_run(a: argparse.Namespace) -> int:
    require_root("run")
    from criuctl import supervisor, workloads

    if a.name is not None:
        workloads.validate_name(a.name)  # before anything runs: a name is a path in the state dir

    w, stdio = supervisor.start(a.command, a.name, allow_io_uring=a.allow_io_uring)
    print(f"criuctl: started {w.name!r} (PID {w.root_pid})", file=sys.stderr, flush=True)
    return supervisor.supervise(w, stdio)


def _cmd_ps(a: argparse.Namespace) -> int:
    from criuctl import render

    if a.node:
        from criuctl.agent.client import AgentClient, get_node

        rows = AgentClient(get_node(a.node)).get("/v1/workloads")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise CriuctlError(
                f"node {a.node} sent no workload list", "check that its agent is criuctl's, and its version"
            )
        render.workloads_table(rows, all_states=a.all, where=f"node {a.node}")
    else:
        render.workloads_table(all_states=a.all)
    return 0


def _cmd_logs(a: argparse.Namespace) -> int:
    from criuctl import workloads

    workloads.validate_name(a.name)  # it becomes a file name here, a URL path segment there
    if a.node:
        from criuctl.agent.client import AgentClient, get_node

        text = AgentClient(get_node(a.node)).text(f"/v1/workloads/{a.name}/logs?tail={a.tail}")
    else:
        path = workloads.log_path(a.name)
        if not path.exists():
            raise workloads.UnknownWorkload(
                f"no logs for {a.name!r} on this host", "see `criuctl ps -a`, or pass --node NODE"
            )
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        text = "".join(lines[-a.tail :] if a.tail else lines)
    sys.stdout.write(text)
    return 0


def _cmd_agent(a: argparse.Namespace) -> int:
    """Check every option the agent could fail on at start-up (one line each), then serve."""
    require_root("agent")
    from criuctl import preflight, tokens

    host, port = preflight.parse_listen(a.listen)
    if (a.tls_cert is None) != (a.tls_key is None):
        raise preflight.BadOption(
            "--tls-cert and --tls-key go together", "pass both, or neither for plain HTTP"
        )
    tokens.read_token(Path(a.token_file))
    if a.tls_cert:
        preflight.check_tls(Path(a.tls_cert), Path(a.tls_key))
    preflight.check_bind(host, port)
    from criuctl.agent import server

    opts = server.AgentOptions(
        host=host,
        port=port,
        token_file=Path(a.token_file),
        tls_cert=a.tls_cert and Path(a.tls_cert),
        tls_key=a.tls_key and Path(a.tls_key),
        lease_seconds=a.lease,
        runtime_endpoint=a.runtime_endpoint,
        inject_dir=a.inject_dir and Path(a.inject_dir),
    )
    if a.name:
        opts.name = a.name
    if a.spool_dir:
        from criuctl.workloads import ENV_SPOOL_DIR

        os.environ[ENV_SPOOL_DIR] = str(Path(a.spool_dir).absolute())  # handoff processes inherit it
    try:
        server.serve(opts)
    except OSError as exc:  # the port taken between our check and the server's bind, say
        raise CriuctlError(
            f"the agent could not serve on {a.listen}: {exc.strerror or exc}", "check --listen and retry"
        ) from exc
    return 0


def _cmd_node(a: argparse.Namespace) -> int:
    from criuctl import render
    from criuctl.agent import client

    if a.node_verb == "add":
        client.add_node(
            client.Node(
                a.name, a.url, str(Path(a.token_file).absolute()), a.ca and str(Path(a.ca).absolute())
            )
        )
        print(f"criuctl: node {a.name} → {a.url}", file=sys.stderr)
    elif a.node_verb == "rm":
        client.remove_node(a.name)
    else:
        nodes = list(client.all_nodes().values())
        health = {}
        for n in nodes:
            try:
                info = client.AgentClient(n, timeout=5).get("/v1/info", timeout=5)
                health[n.name] = f"up ({info['node']}, CRIU {info.get('criu', 'missing')})"
            except client.TokenRefused:
                health[n.name] = "refused: wrong token (the agent is up; see TOKEN FILE)"
            except client.NodeUnreachable as exc:
                health[n.name] = f"down: {exc.what}"
            except (CriuctlError, KeyError, TypeError, ValueError) as exc:
                what = exc.what if isinstance(exc, CriuctlError) else "an answer that is not criuctl's"
                health[n.name] = f"error: {what}"
        render.nodes_table(nodes, health)
    return 0


def _source_node(name: str, to: str, given: str | None):
    """The node workload `name` runs on, checked with every agent, or one line that says where it
    is instead: already on the target, not on --from, on several nodes, or nowhere that answers."""
    from criuctl.agent import client

    target = client.get_node(to)
    if given is not None:
        source = client.get_node(given)
        if client.running_here(client.AgentClient(source, timeout=10).get("/v1/workloads"), name):
            if source.name == target.name:
                raise CriuctlError(
                    f"workload {name!r} already runs on node {to}", "nothing to move: pick another --to"
                )
            return source, target
        others = client.survey(name, [n for n in client.all_nodes().values() if n.name != given])
        where = ", ".join(n.name for n in others.running_on)
        raise CriuctlError(
            f"workload {name!r} does not run on node {given}"
            + (f"; it runs on node {where}" if where else ""),
            f"pass --from {others.running_on[0].name}"
            if where
            else "see `criuctl ps --node NODE` for what runs where",
        )
    found = client.survey(name)
    if [n.name for n in found.running_on] == [target.name]:
        raise CriuctlError(
            f"workload {name!r} already runs on node {to}", "nothing to move: pick another --to"
        )
    sources = [n for n in found.running_on if n.name != target.name]
    if len(sources) > 1:
        raise CriuctlError(
            f"workload {name!r} runs on several nodes: {', '.join(n.name for n in sources)}",
            "say which one to move with --from NODE",
        )
    if not sources and found.refused:
        node, why = next(iter(found.refused.items()))
        raise CriuctlError(f"{why} (node {node})", "nothing was frozen; the container keeps running")
    if not sources:
        silent = f" (no answer from node {', '.join(found.silent)})" if found.silent else ""
        raise CriuctlError(
            f"no node runs a workload named {name!r}{silent}",
            "see `criuctl ps --node NODE`, or pass --from NODE",
        )
    return sources[0], target


def _cmd_migrate(a: argparse.Namespace) -> int:
    from criuctl import containers, render, workloads
    from criuctl.agent import migrate

    a.name = containers.normalize(a.name)
    workloads.validate_name(a.name)
    source, target = _source_node(a.name, a.to, a.source)
    with render.migration_progress() as progress:
        result = migrate.migrate(a.name, source, target, a.mode, progress, into=a.into)
    render.migration_summary(result)
    if a.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(result)))
    return 0 if result.source_confirmed else 6


def _check_writable(folder: Path) -> None:
    """Refuse a bundle folder we cannot create, before anything is frozen.

    A real probe (make and remove a folder) rather than os.access: root passes every mode check,
    but not a read-only mount.
    """
    if not folder.is_dir():
        return  # the dump itself says the parent is missing
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".criuctl-probe-", dir=folder))
    except OSError as exc:
        raise CriuctlError(
            f"cannot write a bundle into {folder}: {exc.strerror}",
            "pass -o a new folder on a writable file system; nothing was frozen",
        ) from exc


def _cmd_dump(a: argparse.Namespace) -> int:
    require_root("dump")
    from criuctl import checkpoint, containers, render, workloads

    a.target = containers.normalize(a.target)
    if not a.target.isdigit():  # a PID is digits; anything else must be a workload name
        workloads.validate_name(a.target)
    _check_writable(Path(a.output).absolute().parent)
    containers.resolve(a.target)  # a container is registered as a workload here

    with render.phase_progress() as progress:
        outcome = checkpoint.dump(a.target, Path(a.output), leave_running=a.leave_running, progress=progress)
    render.dump_summary(outcome, a.leave_running)
    return 0


def _cmd_restore(a: argparse.Namespace) -> int:
    require_root("restore")
    from criuctl import checkpoint, workloads

    if a.name is not None:
        workloads.validate_name(a.name)
    into = None
    if a.into:
        from criuctl import placeholder, runtime

        into = placeholder.find(runtime.connect(a.runtime_endpoint), a.into)
    from criuctl.runtime import archive

    path = Path(a.bundle)
    if not archive.is_archive(path):
        return checkpoint.restore(path, a.name, into=into)
    if into is None:
        raise CriuctlError(
            f"{path} is a kubelet/CRI checkpoint archive of a container: it restores only into a placeholder",
            "start a placeholder (docs/containers.md) and pass --into CONTAINER",
        )
    from criuctl import bundle

    key = bundle.load_key(workloads.key_path())  # the node that reads the archive signs it
    with archive.imported(path, key, workloads.state_dir() / "imports") as (root, _manifest):
        return checkpoint.restore(root, a.name, into=into)


def _cmd_inspect(a: argparse.Namespace) -> int:
    from criuctl import render
    from criuctl.runtime import archive

    if archive.is_archive(Path(a.bundle)):  # a kubelet/CRI checkpoint archive: imported, shown, removed
        return archive.inspect(Path(a.bundle), as_json=a.output == "json")
    return render.inspect(Path(a.bundle), as_json=a.output == "json")


def _cmd_doctor(a: argparse.Namespace) -> int:
    from criuctl import doctor, render

    checks = doctor.run_checks()
    render.doctor(checks)
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _cmd_demo(a: argparse.Namespace) -> int:
    from criuctl import demo

    require_root("demo")
    return demo.main(Path(a.out), steps=a.steps, freeze_at=a.freeze_at)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="criuctl",
        description="Freeze a running training job with CRIU "
        "and restore it, bit-identical, here or on another node.",
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        metavar="DIR",
        help="criuctl's state on this node: workloads, logs, keys, nodes (env CRIUCTL_STATE_DIR; "
        "default /var/lib/criuctl)",
    )
    _add = sub.add_parser

    def add_parser(*args, **kw):  # every verb takes --state-dir
        return _add(*args, parents=[common], **kw)

    sub.add_parser = add_parser

    s = sub.add_parser("run", help="start a command as a checkpointable workload")
    s.add_argument("--name", help="workload name (default: the command's name)")
    s.add_argument(
        "--allow-io-uring",
        action="store_true",
        help="do not block io_uring (CRIU cannot checkpoint a process that uses it)",
    )
    s.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser("ps", help="list the workloads on this host (or on a node's agent)")
    s.add_argument("-a", "--all", action="store_true", help="also show exited, moved and checkpointed ones")
    s.add_argument("--node", help="ask this node's agent instead of reading this host's registry")
    s.set_defaults(func=_cmd_ps)

    s = sub.add_parser("logs", help="a workload's stdout and stderr on this host (or on a node)")
    s.add_argument("name", metavar="NAME")
    s.add_argument("--node", help="ask this node's agent")
    s.add_argument("--tail", type=int, default=0, metavar="N", help="only the last N lines")
    s.set_defaults(func=_cmd_logs)

    s = sub.add_parser("agent", help="run the node agent (the DaemonSet's process)")
    s.add_argument("--listen", default="0.0.0.0:7070", metavar="HOST:PORT")
    s.add_argument("--token-file", required=True, metavar="FILE", help="bearer token, mode 0600")
    s.add_argument("--tls-cert", metavar="FILE")
    s.add_argument("--tls-key", metavar="FILE")
    s.add_argument("--name", help="this node's name (default: the host name)")
    s.add_argument(
        "--spool-dir", metavar="DIR",
        help="where bundles in flight go (default: the state dir); a tmpfs keeps the disk out of a "
        "migration's path, at the cost of RAM for one bundle per migration (env CRIUCTL_SPOOL_DIR)",
    )  # fmt: skip
    s.add_argument(
        "--lease", type=float, default=120.0, metavar="SECONDS",
        help="how long a frozen source waits for the client's commit before asking the target",
    )  # fmt: skip
    s.add_argument(
        "--runtime-endpoint", metavar="SOCKET",
        help="the container runtime's CRI socket (env CRIUCTL_RUNTIME_ENDPOINT; default: containerd's, "
        "then CRI-O's, whichever exists)",
    )  # fmt: skip
    s.add_argument(
        "--inject-dir", metavar="DIR",
        help="where the agent puts criuctl's init and hook for containers to mount read-only "
        "(default /var/lib/criuctl-inject)",
    )  # fmt: skip
    s.set_defaults(func=_cmd_agent)

    s = sub.add_parser("node", help="the nodes `migrate` can use: agent addresses and their tokens")
    nsub = s.add_subparsers(dest="node_verb", required=True)
    # `node ls --state-dir D` as well as `node --state-dir D ls`: SUPPRESS, or the sub-verb's
    # default (None) would overwrite a --state-dir given before it
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _nadd = nsub.add_parser

    def node_parser(*args, **kw):
        return _nadd(*args, parents=[after], **kw)

    nsub.add_parser = node_parser
    n = nsub.add_parser("add", help="add or replace a node")
    n.add_argument("name", metavar="NAME")
    n.add_argument("url", metavar="URL", help="the agent's address, e.g. https://10.0.0.2:7070")
    n.add_argument("--token-file", required=True, metavar="FILE")
    n.add_argument("--ca", metavar="FILE", help="CA certificate that signed the agent's TLS certificate")
    n = nsub.add_parser("rm", help="forget a node")
    n.add_argument("name", metavar="NAME")
    nsub.add_parser("ls", help="list nodes and whether their agents answer")
    s.set_defaults(func=_cmd_node)

    s = sub.add_parser("migrate", help="move a running workload to another node")
    s.add_argument("name", metavar="NAME")
    s.add_argument("--to", required=True, metavar="NODE")
    s.add_argument(
        "--from", dest="source", metavar="NODE", help="the node it runs on (default: ask them all)"
    )
    s.add_argument(
        "--mode", choices=["stop-and-copy", "post-copy", "pre-copy"],
        help="default: post-copy where both kernels have userfaultfd, else stop-and-copy",
    )  # fmt: skip
    s.add_argument(
        "--into", metavar="CONTAINER",
        help="a container's job: the placeholder container (ID) on the target to restore it into "
        "(default: the target's one empty placeholder for the same pod and container)",
    )  # fmt: skip
    s.add_argument("--json", action="store_true", help="also print the result as JSON on stdout")
    s.set_defaults(func=_cmd_migrate)

    s = sub.add_parser("dump", help="checkpoint a workload into a bundle directory")
    s.add_argument("target", metavar="NAME|PID")
    s.add_argument("-o", "--output", required=True, metavar="DIR", help="new bundle directory")
    s.add_argument("--leave-running", action="store_true", help="snapshot only: the workload keeps running")
    s.set_defaults(func=_cmd_dump)

    s = sub.add_parser("restore", help="restore a bundle and supervise it in the foreground")
    s.add_argument("bundle", metavar="DIR")
    s.add_argument("--name", help="name of the restored workload (default: the checkpointed one's)")
    s.add_argument(
        "--into",
        metavar="CONTAINER",
        help="a container's bundle: the placeholder container (ID) to restore into",
    )
    s.add_argument(
        "--runtime-endpoint", metavar="SOCKET", help="the CRI socket (env CRIUCTL_RUNTIME_ENDPOINT)"
    )
    s.set_defaults(func=_cmd_restore)

    s = sub.add_parser("inspect", help="describe a bundle: processes, memory, files, checks")
    s.add_argument("bundle", metavar="DIR|ARCHIVE", help="a bundle, or a kubelet/CRI checkpoint archive")
    s.add_argument("--output", choices=["text", "json"], default="text")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("doctor", help="check CRIU and the kernel features criuctl needs")
    s.set_defaults(func=_cmd_doctor)

    s = sub.add_parser("demo", help="train, freeze, restore, and compare against an uninterrupted run")
    s.add_argument("--out", default="criuctl-demo", help="directory for the bundle and plot")
    s.add_argument("--steps", type=int, default=80)
    s.add_argument("--freeze-at", type=int, default=30, help="freeze once this step has been printed")
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.state_dir:
        from criuctl.statedir import ENV_STATE_DIR

        os.environ[ENV_STATE_DIR] = str(Path(a.state_dir).absolute())
    if a.verb == "run" and a.command and a.command[0] == "--":
        a.command = a.command[1:]
    try:
        from criuctl import statedir

        statedir.check_state_dir()
        return a.func(a)
    except CriuctlError as exc:
        print(f"criuctl: error: {exc.line()}", file=sys.stderr)
        if exc.detail and _verbose():
            print(exc.detail, file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        # A failure no check foresaw: still one line (the traceback with CRIUCTL_VERBOSE=1).
        where = f" ({exc.filename})" if exc.filename else ""
        print(
            f"criuctl: error: {exc.strerror or exc}{where}: "
            "unexpected; run again with CRIUCTL_VERBOSE=1 for where it happened",
            file=sys.stderr,
        )
        if _verbose():
            import traceback

            traceback.print_exc()
        return 1
    except KeyboardInterrupt:
        return 130


def _verbose() -> bool:
    return os.environ.get("CRIUCTL_VERBOSE") == "1"


if __name__ == "__main__":
    sys.exit(main())
