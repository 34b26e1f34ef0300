"""`criuctl node` and `criuctl migrate`, the client's side of moving a workload: the node list, which
node a workload runs on, and the migration the two agents carry out."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from criuctl.core.errors import CriuctlError

if TYPE_CHECKING:
    from criuctl.agent.messages import NodeInfo
    from criuctl.core.workloads import WorkloadRow


def cmd_node(a: argparse.Namespace) -> int:
    from criuctl.cli import render
    from criuctl.client import agents

    if a.node_verb == "add":
        node = agents.Node(
            a.name, a.url, str(Path(a.token_file).absolute()), a.ca and str(Path(a.ca).absolute())
        )
        agents.add_node(node)
        print(f"criuctl: node {a.name} → {a.url}", file=sys.stderr)
        if not node.tls:
            print(
                f"criuctl: warning: node {a.name} is plain HTTP: its token and every bundle sent to it "
                "cross the network unencrypted (its agent runs --insecure); serve HTTPS and add it "
                "as https://",
                file=sys.stderr,
            )
    elif a.node_verb == "rm":
        agents.remove_node(a.name)
    else:
        nodes = list(agents.all_nodes().values())
        health = {}
        for n in nodes:
            try:
                info: NodeInfo = agents.AgentClient(n, timeout=5).get("/v1/info", timeout=5)
                health[n.name] = f"up ({info['node']}, CRIU {info.get('criu', 'missing')})"
            except agents.TokenRefused:
                health[n.name] = "refused: wrong token (the agent is up; see TOKEN FILE)"
            except agents.CertificateRefused as exc:
                health[n.name] = f"TLS refused: {exc.what.rpartition(': ')[2]} (see --ca)"
            except agents.NodeUnreachable as exc:
                health[n.name] = f"down: {exc.what}"
            except (CriuctlError, KeyError, TypeError, ValueError) as exc:
                what = exc.what if isinstance(exc, CriuctlError) else "an answer that is not criuctl's"
                health[n.name] = f"error: {what}"
        render.nodes_table(nodes, health)
    return 0


def _source_node(name: str, to: str, given: str | None):
    """The node workload `name` runs on, checked with every agent, or one line that says where it
    is instead: already on the target, not on --from, on several nodes, or nowhere that answers."""
    from criuctl.client import agents

    target = agents.get_node(to)
    if given is not None:
        source = agents.get_node(given)
        rows: list[WorkloadRow] = agents.AgentClient(source, timeout=10).get("/v1/workloads")
        if agents.running_here(rows, name):
            if source.name == target.name:
                raise CriuctlError(
                    f"workload {name!r} already runs on node {to}", "nothing to move: pick another --to"
                )
            return source, target
        others = agents.survey(name, [n for n in agents.all_nodes().values() if n.name != given])
        where = ", ".join(n.name for n in others.running_on)
        raise CriuctlError(
            f"workload {name!r} does not run on node {given}"
            + (f"; it runs on node {where}" if where else ""),
            f"pass --from {others.running_on[0].name}"
            if where
            else "see `criuctl ps --node NODE` for what runs where",
        )
    found = agents.survey(name)
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


def _target(a: argparse.Namespace) -> str:
    if len(a.node) > 1:
        raise CriuctlError(
            f"more than one node given: {' '.join(a.node)}",
            "criuctl migrate NAME NODE, or --job JOB RANK=NODE RANK=NODE",
        )
    a.node = a.node[0] if a.node else None
    if a.node and a.to and a.node != a.to:
        raise CriuctlError(f"two target nodes given: {a.node} and --to {a.to}", "give one")
    to = a.node or a.to
    if not to:
        raise CriuctlError("no target node given", "criuctl migrate NAME NODE")
    return to


def _print_json(obj: object) -> None:
    import dataclasses
    import json

    print(json.dumps(dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj))


def cmd_migrate(a: argparse.Namespace) -> int:
    from criuctl.cli import render
    from criuctl.client import agents, migrate
    from criuctl.container import containers
    from criuctl.core import workloads
    from criuctl.kube import cluster

    a.json = a.json or a.output == "json"
    if a.job:
        return _migrate_job(a, a.job, _pairs([a.name, *a.node]))
    to = _target(a)
    if _through_kube(a, to, cluster.wanted(a.kubeconfig, a.namespace), agents.all_nodes()):
        return _migrate_pod(a, to)
    if a.dry_run:
        raise CriuctlError(
            "--dry-run is for pods", "without Kubernetes, `criuctl ps --node NODE` shows what runs"
        )
    a.name = containers.normalize(a.name)
    workloads.validate_name(a.name)
    if a.into is not None:
        from criuctl.container import runtime

        a.into = runtime.check_id(a.into)
    if a.into is None and not a.break_connections:  # a rank of a job moves with its job, --from or not
        from criuctl.client import jobs

        job = jobs.job_of(jobs.survey(wanted=a.name), a.name)
        if job is not None and (len(job.ranks) > 1 or job.foreign):
            rank = job.rank(a.name)
            if a.source is not None and rank is not None and rank.node != a.source:
                raise CriuctlError(
                    f"workload {a.name!r} does not run on node {a.source}; it runs on node {rank.node}",
                    f"pass --from {rank.node}",
                )
            return _migrate_job(a, a.name, {a.name: to})
    source, target = _source_node(a.name, to, a.source)
    with render.migration_progress() as progress:
        result = migrate.migrate(a.name, source, target, a.mode, progress, into=a.into)
    render.migration_summary(result)
    if a.json:
        _print_json(result)
    return 0 if result.source_confirmed else 6


def _through_kube(a: argparse.Namespace, to: str, kube_there: bool, added: Collection[str]) -> bool:
    """Which of the two ways `migrate NAME NODE` goes: `--kube` or `--agents` when given; else a
    pod's when a kubeconfig is there and NODE is no node added with `criuctl node add`."""
    if a.kube and a.agents:
        raise CriuctlError("--kube and --agents are two ways to move it", "give one of them")
    if a.agents and (a.kubeconfig or a.namespace):
        raise CriuctlError("--kubeconfig and -n name a pod's cluster", "leave them out with --agents")
    if a.kube or a.agents:
        return bool(a.kube)
    return kube_there and to not in added


def _pairs(args: list[str]) -> dict[str, str]:
    """RANK=NODE arguments as a dict; one line for anything else."""
    from criuctl.core import workloads

    out: dict[str, str] = {}
    for arg in args:
        rank, sep, node = arg.partition("=")
        if not sep or not rank or not node:
            raise CriuctlError(f"{arg!r} is not RANK=NODE", "criuctl migrate --job JOB RANK=NODE ...")
        out[workloads.validate_name(rank)] = node
    return out


def _migrate_job(a: argparse.Namespace, name: str, wanted: dict[str, str]) -> int:
    """Ranks of a multi-node job move together, their connections re-pointed (criuctl.client.jobmove)."""
    from criuctl.cli import render
    from criuctl.client import jobmove, jobs
    from criuctl.core import workloads

    found = jobs.survey(wanted=name)
    job = jobs.job_of(found, name)
    if job is None:
        silent = f" (no answer from node {', '.join(found.silent)})" if found.silent else ""
        raise workloads.UnknownWorkload(
            f"no job or workload named {name!r} runs on any node{silent}",
            "see `criuctl ps --jobs` for the jobs and their ranks",
        )
    plan = jobmove.plan(job, wanted, found.silent)
    moved = ", ".join(f"{m.rank.label} → {m.target.name}" for m in plan.moves)
    print(f"criuctl: job {job.name} ({len(job.ranks)} ranks): moving {moved}", file=sys.stderr)
    result = jobmove.execute(plan, render.job_progress(), a.mode)
    render.job_summary(result)
    if a.json:
        _print_json(result)
    return 0 if all(r.source_confirmed for r in result.ranks) else 6


def _migrate_pod(a: argparse.Namespace, to: str) -> int:
    """`criuctl migrate POD NODE` as a client of the API server: a PodMigration, created (after the
    API server's own dry run: schema, RBAC) and followed until the controller ends it
    (criuctl.kube.controller). The user needs RBAC on podmigrations only."""
    from criuctl.cli import render
    from criuctl.client.migrate import MigrationResult
    from criuctl.kube import cluster, podmigrations, podplan

    named = (("pod", a.name), ("namespace", a.namespace), ("node", to), ("podmigration", a.object_name))
    for kind, value in named:  # before any name reaches a URL, and before the kubeconfig is read
        if value is not None:
            podplan.check_name(kind, value)
    c = cluster.connect(a.kubeconfig)
    namespace = a.namespace or c.namespace
    podplan.check_name("namespace", namespace)  # the kubeconfig context's, when none was given
    if a.ttl is not None and a.ttl < 0:
        raise CriuctlError(f"--ttl {a.ttl}: a number of seconds, 0 or more", "e.g. --ttl 3600")
    body = podmigrations.body(
        namespace, a.name, to, a.mode, a.dry_run, a.object_name, origin="criuctl migrate", ttl=a.ttl
    )
    podmigrations.create(c, body, server_dry_run=True)
    obj = podmigrations.create(c, body)
    name = obj["metadata"]["name"]
    if a.detach:
        print(
            f"criuctl: podmigration {namespace}/{name} created; follow it with `criuctl get {name} -w`",
            file=sys.stderr,
        )
        if a.json:
            _print_json({"podmigration": name, "namespace": namespace})
        return 0
    with render.migration_progress() as progress:
        obj = podmigrations.follow(c, namespace, name, progress)
    st = obj.get("status") or {}
    if a.dry_run:
        podmigrations.delete(c, namespace, name)
    if podmigrations.phase_of(obj) == podmigrations.Phase.FAILED:
        err = CriuctlError(st.get("reason") or "the move failed", st.get("hint") or f"`criuctl get {name}`")
        err.exit_code = int(st.get("exitCode") or 4)
        raise err
    if a.dry_run:
        print(f"criuctl: {st.get('reason')}", file=sys.stderr)
        if a.json:
            _print_json({"dry_run": True, **(st.get("plan") or {})})
        return 0
    result = MigrationResult(**st["result"]) if st.get("result") else None
    if result is not None:
        render.migration_summary(result)
    where = result.target if result is not None else st.get("target")
    print(
        f"criuctl: pod {namespace}/{a.name} is now pod {st.get('newPod')} on node {where} "
        f"(podmigration {name}); follow it with: kubectl -n {namespace} logs -f {st.get('newPod')}",
        file=sys.stderr,
    )
    if a.json:
        import dataclasses

        _print_json(
            {
                **(dataclasses.asdict(result) if result is not None else {"target": where}),
                "pod": a.name,
                "new_pod": st.get("newPod"),
                "namespace": namespace,
                "podmigration": name,
            }
        )
    return 0 if result is None or result.source_confirmed else 6


class NotDeclared(CriuctlError):
    """`settle` without the declaration it rests on: a bad argument (exit 2), nothing done."""

    exit_code = 2


def _who() -> str:
    """Who gives a person's word (a settle, a cancel), as records and statuses name them."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


def cmd_settle(a: argparse.Namespace) -> int:
    """`criuctl settle NAME --node N --target-down`: a person's word ends a move whose target is
    gone for good; the source thaws only if the target stays silent once more."""
    from criuctl.client import agents
    from criuctl.client import migrate as agent_migrate
    from criuctl.core import workloads

    name = workloads.validate_name(a.name)
    if not a.target_down:
        raise NotDeclared(
            f"settling the move of {name} thaws it on {a.node} without its target's word",
            "add --target-down once the target node is off for good (powered off, deleted): "
            "were it still running the job, the job would run twice",
        )
    source = agents.AgentClient(agents.get_node(a.node))
    declared = f"--target-down by {_who()}"
    state = agent_migrate.settle(source, name, declared)
    print(f"criuctl: {name} runs on {a.node} again ({state}: its target was declared down)", file=sys.stderr)
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    """`criuctl cancel PODMIGRATION`: the cancel annotation, which the controller acts on."""
    from criuctl.kube import cluster, podmigrations, podplan

    for kind, value in (("podmigration", a.name), ("namespace", a.namespace)):
        if value is not None:
            podplan.check_name(kind, value)
    c = cluster.connect(a.kubeconfig)
    namespace = a.namespace or c.namespace
    obj = podmigrations.read(c, namespace, a.name)
    phase = podmigrations.phase_of(obj)
    if phase.final:
        print(f"criuctl: podmigration {a.name} already ended ({phase}): nothing to cancel", file=sys.stderr)
        return 0
    podmigrations.cancel(c, namespace, a.name, _who())
    if phase in (podmigrations.Phase.PENDING, podmigrations.Phase.CHECKING):
        what = "the controller ends it before it begins"
    elif phase == podmigrations.Phase.IN_DOUBT:
        what = (
            "the controller settles it on the source once the target's Node is deleted or "
            "tainted out-of-service"
        )
    else:
        what = (
            "a move under way is not cut short: it ends by itself; should it end in doubt, "
            "the cancel acts then"
        )
    print(
        f"criuctl: podmigration {a.name} ({phase}) cancelled: {what} (`criuctl get {a.name} -w` follows it)",
        file=sys.stderr,
    )
    return 0


def cmd_get(a: argparse.Namespace) -> int:
    """`criuctl get [NAME]`: the PodMigrations, as `kubectl get podmigrations` shows them, plus why."""
    from criuctl.cli import render
    from criuctl.kube import cluster, podmigrations, podplan

    for kind, value in (("podmigration", a.name), ("namespace", a.namespace)):
        if value is not None:  # before any name reaches a URL
            podplan.check_name(kind, value)
    c = cluster.connect(a.kubeconfig)
    namespace = None if a.all_namespaces else (a.namespace or c.namespace)

    def fetch() -> list[dict]:
        if a.name:
            return [podmigrations.read(c, namespace or c.namespace, a.name)]
        return podmigrations.every(c, namespace)

    objs = fetch()
    if a.output == "json":
        import json

        print(json.dumps(objs))
    else:
        render.podmigrations_table(objs, wide=a.name is not None)
    if a.watch:
        _watch(fetch, objs, a.name, a.output == "json")
    return 0


WATCH_EVERY = 1.0  # s between looks of `get -w`


def _watch(fetch: Callable[[], list[dict]], objs: list[dict], name: str | None, as_json: bool) -> None:
    """`get -w`: a line (or a JSON object) for each PodMigration that appears or changes, as
    `kubectl get -w` prints them, until interrupted; watching one, until it ends or is gone."""
    import json
    import time

    from criuctl.cli import render
    from criuctl.kube import podmigrations
    from criuctl.kube.cluster import NotFound

    def key(o: dict) -> tuple[str, str]:
        return o["metadata"]["namespace"], o["metadata"]["name"]

    seen = {key(o): o.get("status") for o in objs}
    while not (name and objs and podmigrations.phase_of(objs[0]).final):
        time.sleep(WATCH_EVERY)
        try:
            objs = fetch()
        except NotFound:
            print(f"criuctl: podmigration {name} is gone", file=sys.stderr)
            return
        for o in objs:
            if seen.get(key(o), ...) != o.get("status"):
                seen[key(o)] = o.get("status")
                print(json.dumps(o) if as_json else render.podmigration_line(o), flush=True)
