"""`criuctl` command line: parse, call one workflow, render its result. No mechanism lives here.

The verbs' options and help are data in `cliargs`; `node` and `migrate` live in `climigrate`."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from criuctl.cli import climigrate
from criuctl.cli.cliargs import parser
from criuctl.core import env, statedir
from criuctl.core.errors import CriuctlError, require_root

if TYPE_CHECKING:
    from criuctl.core.workloads import WorkloadRow
    from criuctl.core.worklogs import Chunk

__all__ = ["main", "parser"]


def _cmd_run(a: argparse.Namespace) -> int:
    require_root("run")
    from criuctl.core import workloads
    from criuctl.local import supervisor

    if a.name is not None:
        workloads.validate_name(a.name)  # before anything runs: a name is a path in the state dir

    w, stdio = supervisor.start(a.command, a.name, allow_io_uring=a.allow_io_uring)
    print(f"criuctl: started {w.name!r} (PID {w.root_pid})", file=sys.stderr, flush=True)
    return supervisor.supervise(w, stdio)


def _cmd_ps(a: argparse.Namespace) -> int:
    from criuctl.cli import render
    from criuctl.core import workloads

    if a.kubeconfig and not a.jobs:
        raise CriuctlError("--kubeconfig is for `criuctl ps --jobs`", "add --jobs")
    if a.jobs and a.output == "json":
        raise CriuctlError("`ps --jobs` prints a table only", "leave out -o json, or drop --jobs")
    if a.jobs:
        from criuctl.client import agents, jobs
        from criuctl.kube import cluster

        if a.kubeconfig or (cluster.wanted(None, None) and not agents.all_nodes()):
            from criuctl.kube.jobs import cluster_survey

            found = cluster_survey(cluster.connect(a.kubeconfig))
        else:
            found = jobs.survey()
        render.jobs_table(found.jobs)
        if found.silent:
            print(f"criuctl: no answer from node {', '.join(found.silent)}", file=sys.stderr)
        return 0
    if a.node:
        from criuctl.client.agents import AgentClient, get_node

        rows: list[WorkloadRow] = AgentClient(get_node(a.node)).get("/v1/workloads")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise CriuctlError(
                f"node {a.node} sent no workload list", "check that its agent is criuctl's, and its version"
            )
    else:
        rows = workloads.rows()
    if a.output == "json":
        import json

        # as the table: what runs, and what runs but cannot be checkpointed; with -a every row
        live = [r for r in rows if (r["state"] == workloads.RUNNING and r["alive"]) or r.get("why_not")]
        shown = rows if a.all else live
        print(json.dumps(shown, sort_keys=True))
    else:
        render.workloads_table(rows, all_states=a.all, where=f"node {a.node}" if a.node else None)
    return 0


def _cmd_logs(a: argparse.Namespace) -> int:
    from criuctl.core import workloads, worklogs

    workloads.validate_name(a.name)  # it becomes a file name here, a URL path segment there
    read: Callable[[int | None], worklogs.Chunk]
    if a.node:
        from criuctl.client.agents import AgentClient, get_node

        client = AgentClient(get_node(a.node))
        if not a.follow:  # the agent streams the file (a log may be gigabytes)
            sys.stdout.write(client.text(f"/v1/workloads/{a.name}/logs?tail={a.tail}"))
            return 0
        read = lambda offset: client.log_chunk(a.name, offset, a.tail)  # noqa: E731
    else:
        if not workloads.log_path(a.name).exists():
            raise workloads.UnknownWorkload(
                f"no logs for {a.name!r} on this host", "see `criuctl ps -a`, or pass --node NODE"
            )
        read = lambda offset: worklogs.read(a.name, offset, a.tail)  # noqa: E731
    # following: the last lines, or the whole log a chunk at a time from its start
    chunk = read(None if a.tail or not a.follow else 0)
    _write(chunk.text)
    if a.follow:
        chunk = _follow(read, chunk)
        print(f"criuctl: {_ending(a.name, a.node, chunk)}", file=sys.stderr)
    return 0


FOLLOW_POLL = 0.5  # s between reads of a log that has nothing new


def _write(text: bytes) -> None:
    sys.stdout.buffer.write(text)
    sys.stdout.flush()


def _follow(read: Callable[[int | None], Chunk], chunk: Chunk) -> Chunk:
    """`logs -f`: read on from the end until the workload no longer runs on that node, then once
    more after a pause (its last lines may still be on their way into the log) and to the end."""
    import time

    from criuctl.core import worklogs

    while True:
        ended = chunk.ended
        if len(chunk.text) < worklogs.CHUNK:
            time.sleep(FOLLOW_POLL)
        chunk = read(chunk.end)
        _write(chunk.text)
        if ended and len(chunk.text) < worklogs.CHUNK:
            return chunk


def _ending(name: str, node: str | None, chunk: Chunk) -> str:
    """Why following stopped, and where to follow on."""
    from criuctl.core import workloads

    if chunk.state == workloads.MIGRATED and chunk.moved_to:
        return (
            f"{name} moved to node {chunk.moved_to}: follow it there with "
            f"`criuctl logs {name} --node {chunk.moved_to} -f`"
        )
    if chunk.state == workloads.CHECKPOINTED:
        return f"{name} was checkpointed and ended here (`criuctl ps -a`)"
    code = f" with code {chunk.exit_code}" if chunk.exit_code is not None else ""
    return f"{name} exited{code}" + (f" on node {node}" if node else "")


def _cmd_agent(a: argparse.Namespace) -> int:
    """Check every option the agent could fail on at start-up (one line each), then serve."""
    require_root("agent")
    from criuctl.agent import preflight, protocol
    from criuctl.core import tokens

    protocol.timeouts()  # a name in $CRIUCTL_TIMEOUTS that is no wait fails the start, not a migration
    host, port = preflight.parse_listen(a.listen)
    if a.tls_from_cluster:
        if a.tls_cert or a.insecure:
            raise preflight.BadOption(
                "--tls-from-cluster replaces --tls-cert/--tls-key and --insecure", "pass one of them"
            )
        from criuctl.kube import identity

        ident = identity.obtain(a.kubeconfig, a.name or socket.gethostname(), statedir.IDENTITY.path())
        a.tls_cert = a.tls_key = str(ident.path)
    preflight.check_transport(a.tls_cert, a.tls_key, a.insecure)
    if a.token_file:
        tokens.read_token(Path(a.token_file))
    elif not a.peer_ca:
        raise preflight.BadOption(
            "the agent needs --token-file, or --peer-ca for callers that show a certificate instead",
            "pass --token-file FILE (outside Kubernetes: scripts/agent-cert.sh, docs/deploy.md)",
        )
    if a.metrics_token_file:
        tokens.read_token(Path(a.metrics_token_file))
    if a.runtime_endpoint and a.runtime_endpoint != "procfs":
        from criuctl.container import runtime

        runtime.connect(a.runtime_endpoint)  # its form checked now; the runtime may start later
    if a.tls_cert:
        preflight.check_tls(Path(a.tls_cert), Path(a.tls_key))
    if a.peer_ca:
        preflight.check_peer_ca(Path(a.peer_ca), served=bool(a.tls_cert))
    preflight.check_bind(host, port)
    from criuctl.agent import server

    opts = server.AgentOptions(
        host=host,
        port=port,
        token_file=a.token_file and Path(a.token_file),
        metrics_token_file=a.metrics_token_file and Path(a.metrics_token_file),
        tls_cert=a.tls_cert and Path(a.tls_cert),
        tls_key=a.tls_key and Path(a.tls_key),
        peer_ca=a.peer_ca and Path(a.peer_ca),
        lease_seconds=a.lease,
        runtime_endpoint=a.runtime_endpoint,
        inject_dir=a.inject_dir and Path(a.inject_dir),
    )
    if a.name:
        opts.name = a.name
    # said once the agent's log is set up, as its first lines
    opts.warnings = (
        preflight.cert_warnings(Path(a.tls_cert), host, opts.name)
        if a.tls_cert
        else [preflight.INSECURE_WARNING]
    )
    if a.tls_from_cluster:
        opts.extensions.append(identity.renewal(ident, a.kubeconfig))
    if a.prestop_port:
        from criuctl.kube import nodeside

        opts.extensions.append(nodeside.extension(a.prestop_port, a.kubeconfig))
    if a.spool_dir:
        env.SPOOL_DIR.export(str(Path(a.spool_dir).absolute()))  # handoff processes inherit it
    if a.tls_cert:  # what it and its handoffs present to the agents they call (criuctl.agent.conn)
        env.AGENT_IDENTITY.export(f"{Path(a.tls_cert).absolute()}:{Path(a.tls_key).absolute()}")
    try:
        server.serve(opts)
    except OSError as exc:  # the port taken between our check and the server's bind, say
        raise CriuctlError(
            f"the agent could not serve on {a.listen}: {exc.strerror or exc}", "check --listen and retry"
        ) from exc
    return 0


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
    from criuctl.cli import render
    from criuctl.container import containers
    from criuctl.core import workloads
    from criuctl.local import checkpoint

    a.target = containers.normalize(a.target)
    if not a.target.isdigit():  # a PID is digits; anything else must be a workload name
        workloads.validate_name(a.target)
    _check_writable(Path(a.bundle).absolute().parent)
    if a.via_runtime:
        return _dump_via_runtime(a)
    containers.resolve(a.target)  # a container is registered as a workload here

    freezer = None
    if a.state:
        from criuctl.local import statesnapshot

        freezer = statesnapshot.freeze_state
    with render.phase_progress() as progress:
        outcome = checkpoint.dump(
            a.target, Path(a.bundle), leave_running=a.leave_running, progress=progress, freezer=freezer
        )
    if outcome.thaw is not None and not outcome.thaw.complete:  # the bundle is good; the job is not whole
        name = outcome.manifest.workload
        raise CriuctlError(
            f"checkpointed {name!r} to {outcome.bundle}, and it runs again, but its thaw did not complete: "
            f"{outcome.thaw.line()}",
            f"`criuctl ps` shows it until `criuctl thaw {name}` completes it",
        )
    render.dump_summary(outcome, a.leave_running, as_json=a.output == "json")
    return 0


def _cmd_thaw(a: argparse.Namespace) -> int:
    require_root("thaw")
    from criuctl.core import workloads
    from criuctl.local import checkpoint

    w = workloads.resolve(a.name)
    if not w.thaw_incomplete:
        raise CriuctlError(f"workload {w.name!r} has no thaw to finish", "`criuctl ps` shows which do")
    thaw = checkpoint.thaw_tree(w.root_pid, None, None, w.name)
    if not thaw.complete:
        raise CriuctlError(f"the thaw of {w.name!r} is still not complete: {thaw.line()}", "try again")
    print(f"criuctl: the thaw of {w.name!r} is complete", file=sys.stderr)
    return 0


def _dump_via_runtime(a: argparse.Namespace) -> int:
    """`dump --via-runtime`: the kubelet's checkpoint call, then the archive imported as a bundle."""
    import time

    from criuctl.container import containers, runtime
    from criuctl.container.runtime import archive
    from criuctl.format import bundle

    if not a.target.startswith(containers.NAME_PREFIX):
        raise CriuctlError(
            f"--via-runtime checkpoints containers, and {a.target!r} is not a container ID",
            "pass the container's ID (see `criuctl ps --node NODE`)",
        )
    started = time.monotonic()
    key = bundle.load_key(statedir.key_path())
    ident = a.target.removeprefix(containers.NAME_PREFIX)
    manifest = archive.checkpoint_via_runtime(runtime.connect(), ident, Path(a.bundle), key)
    took = time.monotonic() - started
    print(
        f"criuctl: container {ident} checkpointed by its runtime and imported into {a.bundle} "
        f"in {took:.2f} s ({len(manifest.processes)} processes); it keeps running",
        file=sys.stderr,
    )
    if a.output == "json":
        import json

        out = {"workload": manifest.workload, "bundle": a.bundle, "total_seconds": took}
        print(json.dumps({**out, "leave_running": True}, sort_keys=True))
    return 0


def _cmd_restore(a: argparse.Namespace) -> int:
    require_root("restore")
    from criuctl.core import workloads
    from criuctl.local import restoring

    if a.name is not None:
        workloads.validate_name(a.name)
    into = None
    if a.into:
        from criuctl.container import placeholder, runtime

        into = placeholder.find(runtime.connect(a.runtime_endpoint), runtime.check_id(a.into))
    from criuctl.container.runtime import archive

    path = Path(a.bundle)
    if not archive.is_archive(path):
        from criuctl.format import bundle

        if path.is_dir() and (m := bundle.read_manifest(path)).state is not None:
            from criuctl.local import statesnapshot

            m = bundle.verify(path, bundle.load_key(statedir.key_path(), create=False))
            return statesnapshot.restart(path.absolute(), m, a.name)
        return restoring.restore(path, a.name, into=into)
    if into is None:
        raise CriuctlError(
            f"{path} is a kubelet/CRI checkpoint archive of a container: it restores only into a placeholder",
            "start a placeholder (docs/containers.md) and pass --into CONTAINER",
        )
    from criuctl.format import bundle

    key = bundle.load_key(statedir.key_path())  # the node that reads the archive signs it
    with archive.imported(path, key, statedir.IMPORTS.path()) as (root, _manifest):
        return restoring.restore(root, a.name, into=into)


def _cmd_inspect(a: argparse.Namespace) -> int:
    from criuctl.cli import render
    from criuctl.container.runtime import archive

    if archive.is_archive(Path(a.bundle)):  # a kubelet/CRI checkpoint archive: imported, shown, removed
        return render.inspect_archive(Path(a.bundle), as_json=a.output == "json")
    return render.inspect(Path(a.bundle), as_json=a.output == "json")


def _cmd_doctor(a: argparse.Namespace) -> int:
    from criuctl.cli import doctor, render

    checks = doctor.run_checks()
    render.doctor(checks)
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _cmd_prestop(a: argparse.Namespace) -> int:
    from criuctl.core import migsignal

    return migsignal.prestop(a.signal, a.timeout)


def _cmd_demo(a: argparse.Namespace) -> int:
    from criuctl.cli import demo

    demo.check_installed()
    require_root("demo")
    return demo.main(Path(a.out), steps=a.steps, freeze_at=a.freeze_at)


def _cmd_webhook(a: argparse.Namespace) -> int:
    from criuctl.kube import webhook

    opts = webhook.Options(
        prestop_port=a.prestop_port, prestop_on_host=a.prestop_on_host, image=a.inject_image
    )
    if a.kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST"):
        opts.pending = webhook.pending_moves(a.kubeconfig)
        opts.leaving = webhook.leaving_pods(a.kubeconfig)
        opts.untrack = webhook.untracker(a.kubeconfig)
        opts.record_write = webhook.record_judge(a.kubeconfig)
        opts.image = opts.image or webhook.own_image(a.kubeconfig)
    webhook.serve(a.listen, a.tls_cert, a.tls_key, opts)  # runs as the webhook's own user, not root
    return 0


def _cmd_inject(a: argparse.Namespace) -> int:
    from criuctl.container import containers

    containers.write_inject_dir(Path(a.dir))
    return 0


def _cmd_controller(a: argparse.Namespace) -> int:
    from criuctl.core import jsonlog
    from criuctl.kube import controller

    jsonlog.to_stderr()
    o = controller.Options(
        kubeconfig=a.kubeconfig,
        lease=a.lease,
        lease_namespace=a.lease_namespace,
        lease_seconds=a.lease_seconds,
        renew_seconds=a.renew_seconds,
        retry_seconds=a.retry_seconds,
        health=a.health,
        metrics_token_file=a.metrics_token_file and Path(a.metrics_token_file),
        tls_from_cluster=a.tls_from_cluster,
    )
    controller.check(o)
    controller.run(o)
    return 0


def _cmd_signer(a: argparse.Namespace) -> int:
    from criuctl.core import jsonlog
    from criuctl.kube import signer

    jsonlog.to_stderr()
    if a.cert_seconds < 900:  # renewed at two thirds: a third must outlast a grant (grants.SECONDS)
        raise CriuctlError(f"--cert-seconds {a.cert_seconds} is too short", "at least 900 (15 minutes)")
    signer.run(a.kubeconfig, signer.CA.load(Path(a.ca_cert), Path(a.ca_key)), a.cert_seconds)
    return 0


# verb → the function that carries it out; `cliargs.VERBS` has the same keys
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run,
    "ps": _cmd_ps,
    "logs": _cmd_logs,
    "agent": _cmd_agent,
    "node": climigrate.cmd_node,
    "migrate": climigrate.cmd_migrate,
    "thaw": _cmd_thaw,
    "dump": _cmd_dump,
    "restore": _cmd_restore,
    "inspect": _cmd_inspect,
    "doctor": _cmd_doctor,
    "prestop": _cmd_prestop,
    "webhook": _cmd_webhook,
    "inject": _cmd_inject,
    "controller": _cmd_controller,
    "signer": _cmd_signer,
    "settle": climigrate.cmd_settle,
    "cancel": climigrate.cmd_cancel,
    "get": climigrate.cmd_get,
    "demo": _cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.state_dir:
        env.STATE_DIR.export(str(Path(a.state_dir).absolute()))
    if a.verb == "run" and a.command and a.command[0] == "--":
        a.command = a.command[1:]
    try:
        env.check()  # a malformed variable: one line now, not a traceback (or a failure) later
        statedir.check_state_dir()
        return COMMANDS[a.verb](a)
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
            f"unexpected; run again with {env.VERBOSE}=1 for where it happened",
            file=sys.stderr,
        )
        if _verbose():
            import traceback

            traceback.print_exc()
        return 1
    except KeyboardInterrupt:
        return 130


def _verbose() -> bool:
    try:
        return env.VERBOSE.get()
    except env.BadVariable:
        return False  # said already, by `env.check`


if __name__ == "__main__":
    sys.exit(main())
