"""`criuctl` command line: parse, call one workflow, render its result. No mechanism lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from criuctl.errors import CriuctlError, require_root


def _cmd_run(a: argparse.Namespace) -> int:
    require_root("run")
    from criuctl import supervisor

    w, stdio = supervisor.start(a.command, a.name, allow_io_uring=a.allow_io_uring)
    print(f"criuctl: started {w.name!r} (PID {w.root_pid})", file=sys.stderr, flush=True)
    return supervisor.supervise(w, stdio)


def _cmd_ps(a: argparse.Namespace) -> int:
    from criuctl import render

    if a.node:
        from criuctl.agent.client import AgentClient, get_node

        rows = AgentClient(get_node(a.node)).get("/v1/workloads")
        render.workloads_table(rows, all_states=a.all, where=f"node {a.node}")
    else:
        render.workloads_table(all_states=a.all)
    return 0


def _cmd_logs(a: argparse.Namespace) -> int:
    from criuctl import workloads

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
    require_root("agent")
    from criuctl.agent import server

    host, _, port = a.listen.rpartition(":")
    if (a.tls_cert is None) != (a.tls_key is None):
        raise CriuctlError("--tls-cert and --tls-key go together", "pass both, or neither for plain HTTP")
    opts = server.AgentOptions(
        host=host or "0.0.0.0",
        port=int(port),
        token_file=Path(a.token_file),
        tls_cert=a.tls_cert and Path(a.tls_cert),
        tls_key=a.tls_key and Path(a.tls_key),
        lease_seconds=a.lease,
    )
    if a.name:
        opts.name = a.name
    if a.spool_dir:
        import os

        from criuctl.workloads import ENV_SPOOL_DIR

        os.environ[ENV_SPOOL_DIR] = str(Path(a.spool_dir).absolute())  # handoff processes inherit it
    server.serve(opts)
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
            except CriuctlError as exc:
                health[n.name] = f"down: {exc.what}"
        render.nodes_table(nodes, health)
    return 0


def _cmd_migrate(a: argparse.Namespace) -> int:
    from criuctl import render
    from criuctl.agent import client, migrate

    target = client.get_node(a.to)
    source = client.get_node(a.source) if a.source else migrate.find_workload(a.name, exclude=a.to)
    with render.migration_progress() as progress:
        result = migrate.migrate(a.name, source, target, a.mode, progress)
    render.migration_summary(result)
    if a.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(result)))
    return 0


def _cmd_dump(a: argparse.Namespace) -> int:
    require_root("dump")
    from criuctl import checkpoint, render

    with render.phase_progress() as progress:
        outcome = checkpoint.dump(a.target, Path(a.output), leave_running=a.leave_running, progress=progress)
    render.dump_summary(outcome, a.leave_running)
    return 0


def _cmd_restore(a: argparse.Namespace) -> int:
    require_root("restore")
    from criuctl import checkpoint

    return checkpoint.restore(Path(a.bundle), a.name)


def _cmd_inspect(a: argparse.Namespace) -> int:
    from criuctl import render

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
    s.set_defaults(func=_cmd_agent)

    s = sub.add_parser("node", help="the nodes `migrate` can use: agent addresses and their tokens")
    nsub = s.add_subparsers(dest="node_verb", required=True)
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
    s.set_defaults(func=_cmd_restore)

    s = sub.add_parser("inspect", help="describe a bundle: processes, memory, files, checks")
    s.add_argument("bundle", metavar="DIR")
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
        import os

        from criuctl.workloads import ENV_STATE_DIR

        os.environ[ENV_STATE_DIR] = str(Path(a.state_dir).absolute())
    if a.verb == "run" and a.command and a.command[0] == "--":
        a.command = a.command[1:]
    try:
        return a.func(a)
    except CriuctlError as exc:
        print(f"criuctl: error: {exc.line()}", file=sys.stderr)
        if exc.detail and _verbose():
            print(exc.detail, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _verbose() -> bool:
    import os

    return os.environ.get("CRIUCTL_VERBOSE") == "1"


if __name__ == "__main__":
    sys.exit(main())
