"""The migration controller on the local cluster (tests/conftest.py `local_cluster`): PodMigrations
carried out by the controller Deployment of manifests/ (two replicas, one leading through a Lease),
created with `criuctl migrate` or `kubectl apply` by a user who may touch podmigrations and nothing
else, from a network namespace that reaches the API server and no node; the leading controller
killed at each phase of a move (the other replica takes the Lease over and takes the move up from
its status: it completes or is undone, exactly once); a PodMigration deleted mid-move; the API
server refusing a user without the role and a spec its schema does not allow."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.kube import (
    JOB,
    Controller,
    Kubectl,
    LogFollower,
    combined_steps,
    criuctl,
    final,
    grant_migrator,
    steps,
    training_pod,
    wait_podmigration,
    wait_step,
)

pytestmark = [needs_criu, pytest.mark.timeout(900)]
STEPS = 500


@pytest.fixture
def ref(reference):
    return reference(os.path.basename(JOB), "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")


def _start(k: Kubectl, name: str, node: str = "a") -> LogFollower:
    """A training pod on `node`, past its 20th step, its log followed from the start."""
    # OnFailure, as a PyTorchJob's workers: a job that ends before its follower starts (the taking
    # over leader can be that slow) keeps its log, rather than a restarted placeholder's
    k.apply(training_pod(name, steps=STEPS, node=node, extra_spec={"restartPolicy": "OnFailure"}))
    k.wait_running(name)
    follow = LogFollower(k, name)
    follow.start()
    wait_step(k, name, 20)
    return follow


def _to_the_end(k: Kubectl, pods: list[str], follows: list[LogFollower], ref) -> None:
    """The job ran to its end in the last of `pods`, its steps over all of them the uninterrupted
    run's (each step once, or again with the same loss), and no other pod trains meanwhile."""
    last = pods[-1]
    deadline = time.monotonic() + 300
    while not final(k.logs(last)):
        assert time.monotonic() < deadline, k.logs(last)[-800:]
        time.sleep(1)
    for f in follows:
        f.join(60)
    parts = [steps(f.text) for f in follows]
    assert combined_steps(parts) == ref.steps
    assert final(k.logs(last)) == [ref.final], "final weights differ from the uninterrupted run"


# ------------------------------------------------------------------ the controller killed mid-move


@pytest.mark.parametrize(
    ("point", "ends"),
    [
        # Placing: the placeholder goes, nothing moved; the leader is paused past its Lease rather
        # than killed, and the fenced write that it tries once it wakes is refused (it stops)
        ("controller.placed", "Failed"),
        ("client.sent", "Failed"),  # Migrating, frozen, bundle sent: undone, target first
        ("client.target-committed", "Succeeded"),  # runs on the target: handed over
        ("client.source-committed", "Succeeded"),  # HandingOver recorded, the source pod deleted
    ],
)
def test_the_leader_killed_at_a_phase_ends_the_move_exactly_once(
    local_cluster, ref, point: str, ends: str
) -> None:
    lay, k = local_cluster
    name = "k-" + point.replace(".", "-")
    follows = [_start(k, name)]
    ctl = Controller(lay, k)
    ctl.arm(point)
    paused: list[int] = []
    try:
        r = criuctl(lay, "migrate", name, "b", "--detach", "--as", f"pm-{name}")
        assert r.returncode == 0, r.stderr
        ctl.reached(point)
        if point == "controller.placed":
            old = ctl.leader()
            paused = ctl.stop_replica(old)
        else:
            old = ctl.kill_leader()
    finally:
        ctl.disarm()
    try:
        new_leader = ctl.wait_leader(old)
        obj = wait_podmigration(k, f"pm-{name}")
    finally:
        ctl.go(point)
        ctl.cont_replica(paused)
    st = obj["status"]
    assert st["phase"] == ends, st
    assert st["controller"].startswith(new_leader), f"{st['controller']} ended it, not {new_leader}"
    if paused:  # awake, mid-move, it writes once more: refused (the object changed, the Lease is not
        # its own), and it stops; before, it wrote over its successor's status and moved on
        ctl.wait_restarted(old)
        assert k.get("podmigration", f"pm-{name}")["status"] == st
        said = k("-n", "criuctl-system", "logs", old, "--previous").stdout
        assert "deposed: stopping" in said, said[-2000:]  # its write refused, not its Lease thread
    if ends == "Succeeded":
        # the downtime as the source's agent measured it when the dead leader's commit reached it;
        # none where the source's lease committed (it knows only an upper bound): never a guess
        measured = point == "client.source-committed"
        assert ("downtimeSeconds" in st) == measured, st
        assert not measured or 0 < st["downtimeSeconds"] < 30, st
        moved = st["newPod"]
        assert k.get("pod", moved)["spec"]["nodeName"] == "b"
        follows.append(LogFollower(k, moved))
        follows[-1].start()
        k.wait_gone("pod", name)
        pods = [name, moved]
    else:
        assert "keeps running on a" in st.get("hint", "") + st.get("reason", ""), st
        k.wait_gone("pod", f"{name}-m1")  # the placeholder
        src = k.get("pod", name)
        assert src["status"]["containerStatuses"][0]["restartCount"] == 0
        pods = [name]
    _to_the_end(k, pods, follows, ref)
    if ends == "Succeeded":
        assert not steps(k.logs(name)) or k.get("pod", name) is None, "the source pod trained again"
    for p in pods:
        k("delete", "pod", p, "--grace-period=1", "--wait=false", check=False)


def test_a_podmigration_deleted_mid_move_is_settled_before_it_goes(local_cluster, ref) -> None:
    """Deleted while the job is frozen and its bundle sent: the finalizer holds the object until
    the move ended (here: completed); the job runs once, in the new pod."""
    lay, k = local_cluster
    name = "deleted"
    follows = [_start(k, name)]
    ctl = Controller(lay, k)
    ctl.arm("client.sent")
    try:
        r = criuctl(lay, "migrate", name, "b", "--detach", "--as", "pm-deleted")
        assert r.returncode == 0, r.stderr
        ctl.reached("client.sent")
        k("delete", "podmigration", "pm-deleted", "--wait=false")
        obj = k.get("podmigration", "pm-deleted")
        assert obj is not None and obj["metadata"].get("deletionTimestamp"), "deleted before the move ended"
    finally:
        ctl.disarm()
        ctl.go("client.sent")
    k.wait_gone("podmigration", "pm-deleted", timeout=180)
    moved = f"{name}-m1"
    assert k.get("pod", moved)["spec"]["nodeName"] == "b"
    follows.append(LogFollower(k, moved))
    follows[-1].start()
    _to_the_end(k, [name, moved], follows, ref)
    k("delete", "pod", moved, "--grace-period=1", "--wait=false", check=False)


def _silence(lay, node: str, up: bool) -> None:
    """Node `node`'s agent as a powered-off node's: nothing answers on its port (dropped in the
    node's namespace, so no refusal says the node is up); the kubelet and the API stay."""
    ns = ["ip", "netns", "exec", lay.node(node).ns, "nft"]
    if up:
        subprocess.run([*ns, "delete", "table", "inet", "criuctl-test-silence"], capture_output=True)
        return
    for rule in (
        ["add", "table", "inet", "criuctl-test-silence"],
        ["add", "chain", "inet", "criuctl-test-silence", "in", "{ type filter hook input priority -10 ; }"],
        ["add", "rule", "inet", "criuctl-test-silence", "in", "tcp", "dport", "7070", "drop"],
    ):
        subprocess.run([*ns, *rule], check=True, capture_output=True)


def test_a_cancelled_move_whose_target_is_lost_runs_on_its_source_again(local_cluster, ref) -> None:
    """Frozen on a, restored on b, when b goes silent, is tainted node.kubernetes.io/out-of-service
    (a person's word that it is off) and the move is cancelled, and the controller dies: the new
    leader has the source's agent ask b once more, which hears nothing and thaws: Failed,
    Cancelled, the placeholder gone, the job on a whole. (That a cancel without the taint leaves
    the job frozen: tests/test_kube_units.py, which runs in seconds.)"""
    lay, k = local_cluster
    name = "lost"
    follows = [_start(k, name)]
    ctl = Controller(lay, k)
    ctl.arm("client.restored")
    # NoSchedule, which Kubernetes' non-graceful shutdown takes as well as NoExecute: nothing is
    # evicted meanwhile (b's agent and the other tests' pods stay; the placeholder goes by the cancel)
    taint = "node.kubernetes.io/out-of-service=nodeshutdown:NoSchedule"
    try:
        r = criuctl(lay, "migrate", name, "b", "--detach", "--as", "pm-lost")
        assert r.returncode == 0, r.stderr
        ctl.reached("client.restored")
        _silence(lay, "b", up=False)
        k("taint", "node", "b", taint)
        r = criuctl(lay, "cancel", "pm-lost")
        assert r.returncode == 0 and "cancelled" in r.stderr, r.stderr
        ctl.wait_leader(ctl.kill_leader())
        obj = wait_podmigration(k, "pm-lost", timeout=300)
        st = obj["status"]
        assert st["phase"] == "Failed" and "keeps running on a" in st["hint"], st
        assert [c["reason"] for c in st["conditions"] if c["type"] == "Failed"] == ["Cancelled"], st
        assert "cancelled: node b is tainted" in st["reason"], st
        k.wait_gone("pod", f"{name}-m1")  # the placeholder
        assert k.get("pod", name)["status"]["containerStatuses"][0]["restartCount"] == 0
    finally:
        ctl.disarm()
        _silence(lay, "b", up=True)
        k("taint", "node", "b", f"{taint}-", check=False)
    _to_the_end(k, [name], follows, ref)
    k("delete", "pod", name, "--grace-period=1", "--wait=false", check=False)


# ------------------------------------------------------------- a user with podmigrations only


@contextlib.contextmanager
def _api_server_only(api_ip: str) -> Iterator[list[str]]:
    """A network namespace whose one route leads to the API server's address: the argv prefix that
    runs a command in it."""
    ns, tag = f"criuctl-user-{secrets.token_hex(3)}", secrets.randbelow(200) + 20
    host_end, inside = f"cu{tag}h", f"10.253.{tag}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        run = ["ip", "netns", "exec", ns]
        for argv in (
            ["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "addr", "add", f"{inside}.1/30", "dev", host_end],
            ["ip", "link", "set", host_end, "up"],
            [*run, "ip", "addr", "add", f"{inside}.2/30", "dev", "eth0"],
            [*run, "ip", "link", "set", "eth0", "up"],
            [*run, "ip", "route", "add", f"{api_ip}/32", "via", f"{inside}.1"],
        ):
            subprocess.run(argv, check=True, capture_output=True)
        yield run
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _as(lay, user: str, *args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["KUBECONFIG"] = str(lay.dir / f"{user}.kubeconfig")
    return subprocess.run([*(prefix or []), *args], capture_output=True, text=True, env=env, timeout=600)


def test_a_user_with_only_podmigrations_moves_a_pod_from_a_network_that_reaches_no_node(
    local_cluster, ref
) -> None:
    lay, k = local_cluster
    grant_migrator(k)
    name = "limited"
    follows = [_start(k, name)]
    api_ip = lay.host_ip
    nodes = [
        a["address"]
        for n in json.loads(k("get", "nodes", "-o", "json").stdout)["items"]
        for a in n["status"]["addresses"]
        if a["type"] == "InternalIP"
    ]
    try:
        with _api_server_only(api_ip) as netns:
            # the user's network: the API server answers, no node's agent can be reached
            for ip in nodes:
                probe = _as(
                    lay,
                    "migrator",
                    "python3",
                    "-c",
                    f"import socket; socket.create_connection(('{ip}', 7070), timeout=2)",
                    prefix=netns,
                )
                assert probe.returncode != 0, f"node {ip} reachable from the user's network"
            # and the user may not read nodes or secrets, nor change a pod (reading pods is
            # `criuctl ps --jobs`'s: the ranks the agents publish on them)
            for verb in (
                ("get", "nodes"),
                ("-n", "criuctl-system", "get", "secrets"),
                ("delete", "pod", name),
            ):
                denied = _as(lay, "migrator", "kubectl", *verb, prefix=netns)
                assert denied.returncode != 0 and "forbidden" in denied.stderr, (verb, denied.stderr)
            # `ps --jobs` as the user, no node reached: the ranks the agents publish (every 10 s)
            kubeconfig = str(lay.dir / "migrator.kubeconfig")
            deadline = time.monotonic() + 60
            while True:
                listed = _as(
                    lay, "migrator", *CRIUCTL, "ps", "--jobs", "--kubeconfig", kubeconfig, prefix=netns
                )
                assert listed.returncode == 0, listed.stderr
                if f" {name} " in f" {listed.stdout} " or time.monotonic() > deadline:
                    break
                time.sleep(2)
            assert f" {name} " in f" {listed.stdout} ", listed.stdout
            r = _as(lay, "migrator", *CRIUCTL, "migrate", name, "b", "-o", "json", prefix=netns)
            assert r.returncode == 0, r.stderr[-2000:]
            out = json.loads(r.stdout.strip().splitlines()[-1])
            moved = out["new_pod"]
            assert out["target"] == "b" and out["pod"] == name and out["downtime_seconds"] > 0, out
            follows.append(LogFollower(k, moved))
            follows[-1].start()
            wait_step(k, moved, max(steps(k.logs(name)) or [0]) + 10)
            # back with kubectl apply, as the same user
            pm = {
                "apiVersion": "criuctl.io/v1alpha1",
                "kind": "PodMigration",
                "metadata": {"name": "back", "namespace": "default"},
                # deleted by the controller 20 s after it ends (as a Job's TTL)
                "spec": {"pod": moved, "node": "a", "mode": "stop-and-copy", "ttlSecondsAfterFinished": 20},
            }
            applied = subprocess.run(
                [*netns, "kubectl", "--kubeconfig", str(lay.dir / "migrator.kubeconfig"), "apply", "-f", "-"],
                input=json.dumps(pm),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert applied.returncode == 0, applied.stderr
            listed = _as(lay, "migrator", "kubectl", "get", "podmigrations", prefix=netns)
            assert "back" in listed.stdout and "PHASE" in listed.stdout, listed
        ended = wait_podmigration(k, "back")
        st = ended["status"]
        assert st["phase"] == "Succeeded" and st["source"] == "b", st
        # Kubernetes' conditions: what `kubectl wait --for=condition=Succeeded` waits for
        done = {c["type"]: c for c in st["conditions"]}
        assert done["Succeeded"]["status"] == "True" and done["Succeeded"]["reason"] == "Moved", done
        generation = ended["metadata"]["generation"]
        assert st["observedGeneration"] == done["Succeeded"]["observedGeneration"] == generation, st
        waited = k("wait", "--for=condition=Succeeded", "podmigration/back", "--timeout=5s", check=False)
        assert waited.returncode == 0, waited.stderr
        back = st["newPod"]
        follows.append(LogFollower(k, back))
        follows[-1].start()
        _to_the_end(k, [name, moved, back], follows, ref)
        table = criuctl(lay, "get")
        assert table.returncode == 0 and f"{name}-to-b-" in table.stdout, table  # the first one: no TTL
        assert "Succeeded" in table.stdout, table
        reasons = k("get", "events", "--field-selector", "involvedObject.name=back", "-o", "json").stdout
        assert "MigrationPhase" in reasons and "Migrated" in reasons
        k.wait_gone("podmigration", "back", timeout=90)  # its TTL
    finally:
        k("delete", "rolebinding", "migrator", check=False)
        k(
            "delete",
            "pod",
            name,
            f"{name}-m1",
            f"{name}-m1-m1",
            "--grace-period=1",
            "--wait=false",
            check=False,
        )


def test_a_user_without_the_role_is_refused_by_the_api_server(local_cluster) -> None:
    lay, k = local_cluster
    before = k("get", "podmigrations", "-o", "name").stdout
    r = _as(lay, "outsider", *CRIUCTL, "migrate", "anything", "b")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "refused access" in lines[0] and "403" in lines[0], lines
    assert k("get", "podmigrations", "-o", "name").stdout == before, "a refused user created an object"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"pod": "p", "node": "B;rm -rf"}, "spec.node"),
        ({"pod": "../etc", "node": "b"}, "spec.pod"),
        ({"pod": "p", "node": "b", "mode": "pre-copy"}, "spec.mode"),
        ({"node": "b"}, "spec.pod"),
    ],
)
def test_the_schema_refuses_a_bad_spec(local_cluster, spec: dict, says: str) -> None:
    _, k = local_cluster
    pm = {
        "apiVersion": "criuctl.io/v1alpha1",
        "kind": "PodMigration",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    # --validate=false: the API server's schema refuses it, not kubectl's copy of it
    r = k("apply", "--validate=false", "-f", "-", input=json.dumps(pm), check=False)
    assert r.returncode != 0 and says in r.stderr and "is invalid" in r.stderr, r.stderr
    assert k.get("podmigration", "bad") is None


def test_a_podmigration_claiming_a_drain_that_never_happened_fails(local_cluster) -> None:
    """The preStop's annotation on an object anyone with the role can create: the controller finds
    no such move recorded and says so, rather than report one; the pod is left alone."""
    _, k = local_cluster
    k.apply(training_pod("claimed", steps=100000, node="a"))
    k.wait_running("claimed")
    pm = {
        "apiVersion": "criuctl.io/v1alpha1",
        "kind": "PodMigration",
        "metadata": {
            "name": "forged",
            "annotations": {
                "criuctl.io/origin": "prestop",
                "criuctl.io/source-node": "a",
                "criuctl.io/source-uid": "0000",
            },
        },
        "spec": {"pod": "claimed", "node": "b"},
    }
    try:
        k.apply(pm)
        st = wait_podmigration(k, "forged", timeout=60)["status"]
        assert st["phase"] == "Failed" and "not made by one" in st["reason"], st
        pod = k.get("pod", "claimed")
        assert pod["spec"]["nodeName"] == "a" and not pod["metadata"].get("deletionTimestamp")
    finally:
        k("delete", "pod", "claimed", "--grace-period=1", "--wait=false")


def test_the_standby_replica_waits_and_both_report_healthy(local_cluster) -> None:
    lay, k = local_cluster
    ctl = Controller(lay, k)
    leader = ctl.leader()
    pods = k.pods("criuctl-system", "app.kubernetes.io/name=criuctl-controller")
    assert len(pods) == 2 and leader in [p["metadata"]["name"] for p in pods]
    for p in pods:
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
        log = k.logs(p["metadata"]["name"], "criuctl-system")
        said = "leading" if p["metadata"]["name"] == leader else "waiting for the lease"
        assert said in log, log[-600:]
