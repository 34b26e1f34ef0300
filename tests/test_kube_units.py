"""`criuctl migrate POD NODE`'s and the controller's pure parts: names they give and accept, when
NAME means a pod, the PodMigration's body and conditions, the controller's options and progress."""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criuctl.core.errors import CriuctlError
from criuctl.kube import cluster
from criuctl.kube.podplan import check_name, next_name
from tests.jobs import CRIUCTL


@pytest.mark.parametrize(
    "name, new",
    [
        ("train", "train-m1"),
        ("train-m1", "train-m2"),
        ("train-m9", "train-m10"),
        ("m1", "m1-m1"),
        ("x" * 63, "x" * 60 + "-m1"),
        ("job-m-1", "job-m-1-m1"),
    ],
)
def test_placeholder_names_keep_the_lineage_and_fit(name: str, new: str) -> None:
    assert next_name(name) == new
    assert len(next_name(name)) <= 63


@pytest.mark.parametrize("name", ["train", "train-m1", "a.b-c", "0abc"])
def test_kubernetes_names_pass(name: str) -> None:
    check_name("pod", name)


@pytest.mark.parametrize("name", ["", "Train", "../etc", "a/b", "b;rm", "-a", "a-", "a" * 254, "a b", "ä"])
def test_hostile_names_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(CriuctlError) as e:
        check_name("node", name)
    assert "not a valid node name" in e.value.line()
    assert "\n" not in e.value.line()


def test_a_name_is_a_pod_only_with_a_kubernetes_configuration(monkeypatch, tmp_path) -> None:
    for var in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not cluster.wanted(None, None)
    assert cluster.wanted(None, "default") and cluster.wanted("/x/kubeconfig", None)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "k"))
    assert cluster.wanted(None, None)


def test_migrate_goes_the_way_named_or_else_guesses() -> None:
    """`--kube` and `--agents` choose; without them a kubeconfig there makes NAME a pod unless
    NODE is a node added with `criuctl node add`; both, or `--agents` with a cluster's options,
    is one line."""
    from criuctl.cli import climigrate
    from criuctl.cli.cliargs import parser

    def way(*argv: str, kube_there: bool = True, added: tuple[str, ...] = ()) -> bool:
        a = parser().parse_args(["migrate", "x", "b", *argv])
        return climigrate._through_kube(a, "b", kube_there, added)

    assert way() and not way(added=("b",)) and not way(kube_there=False)
    assert way("--kube", kube_there=False, added=("b",))
    assert not way("--agents") and not way("--agents", added=("b",))
    for bad, says in ((("--kube", "--agents"), "two ways"), (("--agents", "-n", "ml"), "a pod's cluster")):
        with pytest.raises(CriuctlError) as e:
            way(*bad)
        assert says in e.value.line() and "\n" not in e.value.line()


# ---------------------------------------------------------------- PodMigration and the controller


def test_a_podmigration_body_is_what_the_schema_takes() -> None:
    """Generated names fit (253 with the API server's 5 characters); the spec has only its fields;
    a drain's record is named after the pod and its UID, annotated as the preStop's."""
    import re

    from criuctl.kube import podmigrations as pm

    long_pod, long_node = "p" * 253, "n" * 253
    obj = pm.body("ml", long_pod, long_node, "stop-and-copy", dry_run=True)
    assert len(obj["metadata"]["generateName"]) + 5 <= 253
    assert obj["spec"] == {"pod": long_pod, "node": long_node, "mode": "stop-and-copy", "dryRun": True}
    assert pm.body("ml", "t", "b")["spec"] == {"pod": "t", "node": "b"}
    assert pm.body("ml", "t", "b", ttl=600)["spec"] == {
        "pod": "t",
        "node": "b",
        "ttlSecondsAfterFinished": 600,
    }
    named = pm.body("ml", "t", "b", name="move-t", origin="criuctl migrate")
    assert named["metadata"] == {
        "namespace": "ml",
        "name": "move-t",
        "annotations": {pm.ORIGIN: "criuctl migrate"},
    }
    crd = (Path(__file__).resolve().parent.parent / "manifests" / "podmigration-crd.yaml").read_text()
    phases = re.search(r'enum: \[("Pending".*)\]', crd)
    assert phases and [p.strip(' "') for p in phases[1].split(",")] == [str(p) for p in pm.Phase]


def test_a_finished_move_expires_after_its_ttl_and_only_then() -> None:
    from criuctl.kube import podmigrations as pm

    def move(phase: str, ttl: int | None, finished: str | None = "2026-12-06T10:00:00Z") -> dict:
        spec = {"pod": "t", "node": "b", **({} if ttl is None else {"ttlSecondsAfterFinished": ttl})}
        return {"spec": spec, "status": {"phase": phase, **({"finishedAt": finished} if finished else {})}}

    ended = datetime.datetime(2026, 12, 6, 10, 0, tzinfo=datetime.UTC).timestamp()
    assert pm.expired(move("Succeeded", 60), ended + 60) and pm.expired(move("Failed", 0), ended)
    assert not pm.expired(move("Succeeded", 60), ended + 59)
    assert not pm.expired(move("Succeeded", None), ended + 1e6)  # no TTL: kept
    assert not pm.expired(move("Migrating", 0, None), ended + 1e6)  # never while it runs
    assert not pm.expired(move("InDoubt", 0, None), ended + 1e6)


def test_an_ended_move_has_kubernetes_style_conditions_with_the_generation(monkeypatch) -> None:
    """Succeeded or Failed True (as a Job's Complete or Failed), the reason a CamelCase word, and the
    generation each is about; the status says which generation it observed."""
    from criuctl.kube import controller, podmigrations
    from criuctl.kube.podmigrations import Phase

    writes: list[dict] = []

    def stored(c, ns, name, status, version=None):
        writes.append(status)
        old = writes[-2] if len(writes) > 1 else {}
        return {"metadata": {"namespace": ns, "name": name, "generation": 1}, "status": {**old, **status}}

    monkeypatch.setattr(podmigrations, "patch_status", stored)
    monkeypatch.setattr(controller.events, "record", lambda *a, **k: None)
    obj = {"metadata": {"namespace": "ml", "name": "m1", "generation": 1}}
    j = controller.Journal(None, obj, controller.Fence("me"))  # type: ignore[arg-type]
    j(Phase.CHECKING)
    assert writes[-1]["observedGeneration"] == 1
    j.ended(Phase.FAILED, "node b is cordoned", "pick another", code=2)
    (failed,) = [c for c in writes[-1]["conditions"] if c["type"] == "Failed"]
    assert failed["status"] == "True" and failed["reason"] == "NotMigratable"
    assert failed["observedGeneration"] == 1 and failed["message"] == "node b is cordoned"
    assert writes[-1]["observedGeneration"] == 1 and writes[-1]["phase"] == "Failed"
    j2 = controller.Journal(None, dict(obj), controller.Fence("me"))  # type: ignore[arg-type]
    j2.succeeded(None, "moved", downtime=0.5)
    assert [c["reason"] for c in writes[-1]["conditions"] if c["type"] == "Succeeded"] == ["Moved"]


def test_a_status_write_is_fenced_by_the_version_it_read_and_a_deposed_leader_stops(monkeypatch) -> None:
    """Issue 42: a leader paused past its Lease ran on and wrote a phase over its successor's.
    Every write is conditional on the resourceVersion read; a conflict is retried on a fresh read
    only while this replica holds an unexpired Lease, and is otherwise `Deposed`, nothing written."""
    import copy
    import datetime
    from types import SimpleNamespace

    from criuctl.kube import controller, podmigrations
    from criuctl.kube.cluster import Conflict
    from criuctl.kube.podmigrations import Phase

    server = {"metadata": {"namespace": "ml", "name": "m1", "resourceVersion": "1"}, "status": {}}
    landed: list[dict] = []

    def patch(c, ns, name, status, version=None):
        if version != server["metadata"]["resourceVersion"]:
            raise Conflict("changed meanwhile (HTTP 409)", "try again")
        server["status"] = {**server["status"], **status}
        server["metadata"]["resourceVersion"] = str(int(version) + 1)
        landed.append(status)
        return copy.deepcopy(server)

    def someone_else_writes(**status: str) -> None:
        server["status"] = {**server["status"], **status}
        server["metadata"]["resourceVersion"] = str(int(server["metadata"]["resourceVersion"]) + 1)

    lease = SimpleNamespace(holder_identity="me", renew_time=None, lease_duration_seconds=6)
    c = SimpleNamespace(
        coordination=SimpleNamespace(read_namespaced_lease=lambda n, ns: SimpleNamespace(spec=lease))
    )
    monkeypatch.setattr(podmigrations, "patch_status", patch)
    monkeypatch.setattr(podmigrations, "read", lambda c, ns, name: copy.deepcopy(server))
    monkeypatch.setattr(controller.events, "record", lambda *a, **k: None)
    j = controller.Journal(c, copy.deepcopy(server), controller.Fence("me", "lease", "sys", 6))  # type: ignore[arg-type]
    lease.renew_time = datetime.datetime.now(datetime.UTC)
    j(Phase.CHECKING)
    assert landed[-1]["phase"] == "Checking"
    # a cancel's annotation meanwhile, the Lease still ours: written on a fresh read
    someone_else_writes()
    j.latest.write({"step": "dump"})  # the progress thread's write: the same fenced path
    assert landed[-1].get("step") == "dump", landed
    # paused past the Lease: another replica took it over and ended the move
    lease.holder_identity = "other"
    someone_else_writes(phase="Failed", controller="other")
    with pytest.raises(controller.Deposed):
        j(Phase.MIGRATING)
    assert server["status"]["phase"] == "Failed" and server["status"]["controller"] == "other"
    # ... or nobody renewed it: ours, but run out, is not leading either
    lease.holder_identity, lease.renew_time = (
        "me",
        datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=7),
    )
    with pytest.raises(controller.Deposed):
        j(Phase.MIGRATING)
    assert server["status"]["phase"] == "Failed"


def test_get_watch_prints_each_change_and_ends_with_the_one_it_watches(capsys, monkeypatch) -> None:
    from criuctl.cli import climigrate

    def obj(phase: str, progress: str = "") -> dict:
        status = {"phase": phase, "source": "a", "target": "b", "progress": progress}
        return {
            "metadata": {"namespace": "ml", "name": "m1"},
            "spec": {"pod": "t", "node": "b"},
            "status": status,
        }

    seen = [
        obj("Checking"),
        obj("Migrating", "transfer 0.1/0.3 GiB (33%)"),
        obj("Migrating", "transfer 0.1/0.3 GiB (33%)"),
    ]
    seen.append(obj("Succeeded"))
    feed = iter(seen[1:])
    monkeypatch.setattr(climigrate, "WATCH_EVERY", 0.0)
    climigrate._watch(lambda: [next(feed)], [seen[0]], "m1", as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["ml/m1  t  a → b  Migrating  transfer 0.1/0.3 GiB (33%)", "ml/m1  t  a → b  Succeeded"]


def test_a_condition_keeps_when_it_became_true() -> None:
    from criuctl.kube import podmigrations as pm

    obj = {"status": {"conditions": [{"type": "Checked", "status": "True", "lastTransitionTime": "T0"}]}}
    (again,) = pm.condition(obj, "Checked", "ChecksPassed", "m")
    assert again["lastTransitionTime"] == "T0" and again["reason"] == "ChecksPassed"
    assert {c["type"] for c in pm.condition(obj, "Committed", "TargetRunning", "m")} == {
        "Checked",
        "Committed",
    }


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lease-seconds", "5", "--renew-seconds", "10"], "do not fit"),
        (["--retry-seconds", "0"], "do not fit"),
        (["--lease", "Bad_Name"], "not a valid lease name"),
        (["--health", "nowhere"], "is not HOST:PORT"),
        (["signer", "--ca-cert", "/nonexistent/tls.crt", "--ca-key", "/nonexistent/tls.key"], "agents' CA"),
        (["signer", "--ca-cert", "c", "--ca-key", "k", "--cert-seconds", "5"], "too short"),
    ],
)
def test_bad_controller_options_are_one_line(args: list[str], says: str, tmp_path: Path) -> None:
    """Refused before anything starts (the client's election would sys.exit with its own words);
    the signer's likewise."""
    verb, args = (args[:1], args[1:]) if args[0] == "signer" else (["controller"], args)
    r = subprocess.run(
        [*CRIUCTL, *verb, "--state-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and says in lines[0], r.stderr


def test_progress_is_written_newest_only_and_never_after_close() -> None:
    """The migration hands its progress over and goes on; the writer sends the newest and, once
    closed (the final status is next), nothing more."""
    import threading

    from criuctl.kube import controller

    written: list[dict] = []
    gate = threading.Event()

    def write(facts: dict) -> None:
        gate.wait(5)
        written.append(facts)

    latest = controller._Latest(write)
    latest.start()
    latest.put({"step": "freeze"})
    time.sleep(0.1)  # the writer took "freeze" and waits on the gate
    for n in range(5):
        latest.put({"step": "transfer", "stepDone": n})
    gate.set()
    time.sleep(controller.PROGRESS_EVERY + 0.3)
    latest.close()
    latest.put({"step": "late"})
    time.sleep(0.2)
    assert written == [{"step": "freeze"}, {"step": "transfer", "stepDone": 4}]


@pytest.mark.parametrize(
    "args",
    [
        ["get", "../etc"],
        ["get", "-n", "a/b"],
        ["migrate", "train", "b", "--as", "../x"],
        ["migrate", "train", "b", "-n", "ns/../kube-system"],
    ],
)
def test_hostile_names_are_refused_before_any_request(args: list[str], tmp_path: Path) -> None:
    """A name that is not a Kubernetes name never reaches a URL: refused in one line, before the
    kubeconfig is even read (this one does not exist)."""
    cfg = tmp_path / "no-such-kubeconfig"
    r = subprocess.run(
        [*CRIUCTL, *args, "--kubeconfig", str(cfg), "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "is not a valid" in lines[0], r.stderr


class _Objects:
    """The custom-objects API over a dict of (group, plural, name) → object: what owners reads."""

    def __init__(self, objs: dict[tuple[str, str, str], dict]) -> None:
        self.objs = objs

    def get_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str, name: str) -> dict:
        from kubernetes.client.exceptions import ApiException

        if (group, plural, name) not in self.objs:
            raise ApiException(status=404, reason="Not Found")
        return self.objs[(group, plural, name)]


def _obj(name: str, uid: str, owner: dict | None = None, **rest: Any) -> dict:
    meta = {"name": name, "uid": uid, "ownerReferences": [owner] if owner else []}
    return {"metadata": meta, **rest}


def test_a_jobset_pod_belongs_to_its_jobset_through_its_indexed_job() -> None:
    """A TrainJob's pod is owned by an Indexed Job, which a JobSet owns (on a real cluster and the
    stand-ins'); a JobSet that owns its pods itself is read the same. The JobSet decides whether
    it wants the pod back; an Indexed Job of no JobSet decides itself (finished or failing: no)."""
    from types import SimpleNamespace

    from criuctl.kube import owners

    js_ref = {"kind": "JobSet", "name": "trn", "uid": "js", "controller": True}
    job_ref = {"kind": "Job", "name": "trn-node-0", "uid": "job", "controller": True}
    jobset = _obj(
        "trn", "js", spec={"replicatedJobs": [{"replicas": 1, "template": {"spec": {"parallelism": 3}}}]}
    )
    objs = {
        ("batch", "jobs", "trn-node-0"): _obj("trn-node-0", "job", js_ref),
        ("jobset.x-k8s.io", "jobsets", "trn"): jobset,
    }
    c = SimpleNamespace(custom=_Objects(objs))
    pod = _obj("trn-node-0-1-x7k2q", "p", job_ref, spec={"hostname": "trn-node-0-1", "subdomain": "trn"})
    pod["metadata"].update(namespace="ml", labels={"jobset.sigs.k8s.io/jobset-name": "trn"})
    o = owners.owner(c, pod)
    assert o is not None and (o.kind, o.name, o.replicas, o.wants_back) == ("JobSet", "trn", 3, True)
    standin = copy.deepcopy(pod)
    standin["metadata"]["ownerReferences"] = [js_ref]
    assert owners.owner(c, standin) == o
    jobset["status"] = {"conditions": [{"type": "Completed", "status": "True"}]}
    o = owners.owner(c, pod)
    assert o is not None and not o.wants_back and o.why == "the JobSet has finished"
    del jobset["status"]
    job = objs[("batch", "jobs", "trn-node-0")]
    job["metadata"]["ownerReferences"] = []
    job["spec"] = {"parallelism": 2, "completions": 2}
    o = owners.owner(c, pod)  # an Indexed Job of its own: the Job decides
    assert o is not None and (o.kind, o.name, o.replicas, o.wants_back) == ("Job", "trn-node-0", 2, True)
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    o = owners.owner(c, pod)
    assert o is not None and not o.wants_back and o.why == "the Job has finished"
    job["status"] = {"conditions": [{"type": "FailureTarget", "status": "True"}]}
    o = owners.owner(c, pod)
    assert o is not None and not o.wants_back and "has failed" in o.why
    plain = copy.deepcopy(pod)
    del plain["spec"]["subdomain"]
    assert owners.owner(c, plain) is None, "no stable DNS name: nothing its successor shares"
    del objs[("jobset.x-k8s.io", "jobsets", "trn")]
    o = owners.owner(c, standin)
    assert o is not None and not o.wants_back and o.why == "its JobSet is gone"


def test_a_pytorchjob_pod_that_never_restarts_is_not_moved() -> None:
    """training-operator's UpdateJobStatus fails the whole PyTorchJob once a pod of a replica type
    with restartPolicy Never is counted failed, and UpdateJobReplicaStatuses counts a Running pod
    being deleted as failed: a move (which deletes the pod) would end every rank. Such a pod is not
    wanted back, said in one line that names the policy; OnFailure and ExitCode move."""
    from types import SimpleNamespace

    from criuctl.kube import owners

    ref = {"kind": "PyTorchJob", "name": "ddp", "uid": "pj", "controller": True}
    specs = {"Master": {"replicas": 1}, "Worker": {"replicas": 2, "restartPolicy": "Never"}}
    objs = {("kubeflow.org", "pytorchjobs", "ddp"): _obj("ddp", "pj", spec={"pytorchReplicaSpecs": specs})}
    c = SimpleNamespace(custom=_Objects(objs))

    def pod(rtype: str) -> dict:
        p = _obj(f"ddp-{rtype}-0", "p", ref)
        p["metadata"].update(namespace="ml", labels={owners.REPLICA_TYPE: rtype})
        return p

    o = owners.owner(c, pod("worker"))
    assert o is not None and not o.wants_back and "restartPolicy Never" in o.why and "\n" not in o.why
    o = owners.owner(c, pod("master"))
    assert o is not None and o.wants_back and o.replicas == 3, "the master's replica type restarts"
    for policy in ("OnFailure", "ExitCode"):
        specs["Worker"]["restartPolicy"] = policy
        o = owners.owner(c, pod("worker"))
        assert o is not None and o.wants_back, policy


def test_a_moves_breakdown_is_the_time_between_its_stamped_steps_in_order(monkeypatch) -> None:
    """What the MIGRATED Event says the stall was made of: each step's seconds since the step
    stamped before it, in the path's order; a step never stamped (a restore a restarted agent
    found done) is left out, not counted as zero."""
    from criuctl.kube import moves

    m = moves.Move("default", "w-0", "uid", "b", "pytorch", moves.Phase.DUMPING)
    now = iter([100.0, 101.5, 101.6, 103.0, 104.25])
    monkeypatch.setattr(moves.time, "time", lambda: next(now))
    for step in ("prestop", "checkpoint", "deleted", "kept", "running"):
        m.stamp(step)
    assert m.breakdown() == [
        ("checkpoint", 1.5),
        ("deleted", pytest.approx(0.1)),
        ("kept", pytest.approx(1.4)),
        ("running", 1.25),
    ]
    assert moves.Move("default", "w-0", "uid", "b", "pytorch", moves.Phase.KEPT).breakdown() == []


def test_a_pods_device_plugin_resources_are_counted_against_the_target_nodes() -> None:
    """A GPU pod's placeholder asks the target for the same nvidia.com/gpu: what the node's allocatable
    less its pods' requests leaves is what it can give (a limit alone counts as the request)."""
    from criuctl.kube import podplan

    def pod(**resources: str) -> dict:
        return {"spec": {"containers": [{"resources": {"limits": resources}}, {"resources": {}}]}}

    gpu_pod = pod(**{"nvidia.com/gpu": "2", "memory": "1Gi"})
    assert podplan.devices(gpu_pod) == ["nvidia.com/gpu"]
    assert podplan.devices(pod(memory="1Gi")) == [] and podplan.devices(pod(**{"nvidia.com/gpu": "0"})) == []
    node = {"status": {"allocatable": {"nvidia.com/gpu": "8", "memory": "64Gi"}}}
    others = [pod(**{"nvidia.com/gpu": "4"}), pod(**{"nvidia.com/gpu": "3", "memory": "2Gi"})]
    assert podplan.free_allocatable(node, others, ["nvidia.com/gpu", "memory"]) == {
        "nvidia.com/gpu": 1,
        "memory": 62 * 2**30,
    }
    assert podplan.free_allocatable({"status": {"allocatable": {}}}, [], ["nvidia.com/gpu"]) == {
        "nvidia.com/gpu": 0
    }


def _interleavings(left: tuple[int, ...]) -> Iterator[list[int]]:
    """Every order of the ranks' steps, `left[r]` of rank r's still to take: each rank's own in order."""
    if not any(left):
        yield []
        return
    for r, n in enumerate(left):
        if n:
            for rest in _interleavings((*left[:r], n - 1, *left[r + 1 :])):
                yield [r, *rest]


def _ranks_going_first(order: str, ranks: int) -> tuple[int, int]:
    """Every interleaving of `ranks` peers' preStops (each a program of API calls against one
    store of move records, `criuctl.kube.prestop`), `order` "turn" (the bakery, as written) or
    "clock" (the order by a time taken before the record's write, as it was): (the interleavings
    where two ranks passed their first check, those where no rank would pass it again at the end)."""
    import dataclasses

    from criuctl.kube import moves, prestop

    addr = [f"10.0.0.{i}" for i in range(ranks)]
    remotes = [set(addr) - {a} for a in addr]  # each rank is connected to every other
    both, stuck = 0, 0
    for seq in _interleavings((4,) * ranks):
        store: dict[str, moves.Move] = {}
        mine = [
            moves.Move("ml", f"w-{r}", f"u{r}", "a", "t", moves.Phase.DUMPING, bundle=str(r), address=a)
            for r, a in enumerate(addr)
        ]
        pc, went, clock = [0] * ranks, [], 0
        for r in seq:
            m, step = mine[r], pc[r]
            pc[r] += 1
            if order == "clock" and step == 0:  # `since` taken, then _lazy, then the record written
                clock += 1
                m.turn = clock
            elif step == 0 or (order == "turn" and step == 2) or (order == "clock" and step == 1):
                store[m.key] = dataclasses.replace(m)
            elif order == "turn" and step == 1:
                m.turn = prestop.take_turn(m, list(store.values()))
            elif step == 3 and not prestop.ahead(m, list(store.values()), remotes[r]):
                went.append(r)
        both += len(went) > 1
        stuck += not any(not prestop.ahead(m, list(store.values()), remotes[i]) for i, m in enumerate(mine))
    return both, stuck


def test_two_ranks_moving_at_once_never_dump_together() -> None:
    """A drain evicts a node's ranks at once; two peers dumped together each re-point the other's
    old address and their connection breaks (the CI of 2026-12-05: `criuctl ps --jobs` showed two
    moved ranks' connection to each other as not criuctl's). In every interleaving of two and of
    three peers' preStops, at most one passes its check before the other has dumped, and one
    always can. The order as it was (by a clock taken before the record's write, which post-copy's
    certificate call made a window of its own) lets two go at once: the model finds that too."""
    assert _ranks_going_first("turn", 2) == (0, 0)
    assert _ranks_going_first("turn", 3) == (0, 0)
    assert _ranks_going_first("clock", 2)[0] > 0


def test_a_move_that_would_fail_its_job_is_refused_and_one_it_ignores_is_not() -> None:
    """`jobfailures.refusal`: the pod a move ends fails, marked DisruptionTarget, exit 137. Its
    Job's podFailurePolicy decides first (rules in order: Ignore frees it, FailJob/FailIndex refuse
    it); else it counts: refused when it is the failure past backoffLimit (those not yet counted
    too), or when a per-index limit would fail its index."""
    from criuctl.kube import jobfailures as jf

    def job(status: dict | None = None, **spec: Any) -> dict:
        return {"metadata": {"name": "j"}, "spec": spec, "status": status or {}}

    ignore = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert jf.refusal(job(backoffLimit=0, podFailurePolicy={"rules": [ignore]})) is None
    said = jf.refusal(job(backoffLimit=0))
    assert said is not None and "backoffLimit 0" in said and "0 failed so far" in said
    assert jf.refusal(job()) is None, "the default limit, 6"
    assert jf.refusal(job({"failed": 5}, backoffLimit=6)) is None
    assert jf.refusal(job({"failed": 5, "uncountedTerminatedPods": {"failed": ["u"]}}, backoffLimit=6))
    fail_137 = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [137]}}
    said = jf.refusal(job(backoffLimit=6, podFailurePolicy={"rules": [fail_137, ignore]}))
    assert said is not None and "FailJob" in said, "the exit-code rule comes first"
    other = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1]}}
    assert jf.refusal(job(backoffLimit=0, podFailurePolicy={"rules": [other, ignore]})) is None
    not_in = {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0, 1]}}
    assert jf.action_on_move({"podFailurePolicy": {"rules": [not_in, ignore]}}) == "Count"
    fail_index = {"action": "FailIndex", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert "FailIndex" in (jf.refusal(job(podFailurePolicy={"rules": [fail_index]})) or "")
    assert "backoffLimitPerIndex 1" in (jf.refusal(job(backoffLimitPerIndex=1)) or "")


def test_an_indexed_job_pods_lookup_lists_its_index_not_every_pod_of_the_namespace() -> None:
    """`owners.pods_of` for `HOST.SUBDOMAIN`: the record's selector alone when it has one; else the
    Job and index the hostname names, and every pod of that Job only where that finds none (a
    cluster that writes no completion-index label)."""
    from types import SimpleNamespace

    from criuctl.kube import owners

    def pod(host: str, labelled: bool) -> dict:
        labels = {"jobset.sigs.k8s.io/jobset-name": "trn", "job-name": "trn-node-0"}
        if labelled:
            labels["batch.kubernetes.io/job-completion-index"] = host[-1]
        return {"metadata": {"labels": labels}, "spec": {"hostname": host, "subdomain": "trn"}}

    def cluster(pods: list[dict]) -> tuple[Any, list[str]]:
        asked: list[str] = []

        def list_pods(ns: str, label_selector: str) -> Any:
            asked.append(label_selector)
            want = dict(kv.split("=") if "=" in kv else (kv, None) for kv in label_selector.split(","))
            keep = [
                p
                for p in pods
                if all(
                    k in p["metadata"]["labels"] and v in (None, p["metadata"]["labels"][k])
                    for k, v in want.items()
                )
            ]
            return SimpleNamespace(items=keep)

        return SimpleNamespace(
            core=SimpleNamespace(list_namespaced_pod=list_pods), serialize=lambda p: p
        ), asked

    c, asked = cluster([pod("trn-node-0-1", True), pod("trn-node-0-2", True)])
    assert len(owners.pods_of(c, "ml", "trn-node-0-1.trn")) == 1
    assert asked == ["job-name=trn-node-0,batch.kubernetes.io/job-completion-index=1"]
    c, asked = cluster([pod("trn-node-0-1", False), pod("trn-node-0-2", False)])
    assert len(owners.pods_of(c, "ml", "trn-node-0-1.trn")) == 1 and asked[-1] == "job-name=trn-node-0"
    c, asked = cluster([pod("trn-node-0-1", False)])
    assert owners.pods_of(c, "ml", "trn-node-0-1.trn", "jobset.sigs.k8s.io/jobset-name=x") == []
    assert asked == ["jobset.sigs.k8s.io/jobset-name=x"], "the record's selector alone"


def test_a_jobs_pod_leaves_its_count_before_its_delete_and_comes_back_if_none_came() -> None:
    """`jobfailures.untrack`/`retrack`, applied as the API server applies their JSON patches: the
    tracking finalizer goes (and only it), the pod is labelled with when; a pod untracked and not
    deleted within STALE gets it back, unless a newer untrack relabelled it meanwhile (the test op
    refuses); a pod not a Job's, or already untracked, is left alone; a patch the API server
    refuses says False, not an exception."""
    from types import SimpleNamespace

    import jsonpatch
    from kubernetes.client.exceptions import ApiException

    from criuctl.kube import jobfailures as jf

    def store(pod: dict, refuse: bool = False) -> tuple[Any, list]:
        calls: list = []

        def patch(name: str, ns: str, body: list) -> dict:
            calls.append(body)
            if refuse:
                raise ApiException(status=403, reason="Forbidden")
            try:
                pod.update(jsonpatch.apply_patch(pod, body))
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiException(status=422, reason="Invalid") from exc
            return pod

        return SimpleNamespace(core=SimpleNamespace(patch_namespaced_pod=patch)), calls

    def job_pod() -> dict:
        return {
            "metadata": {
                "name": "trn-node-0-0-x",
                "namespace": "ml",
                "labels": {"job-name": "trn-node-0"},
                "finalizers": ["example.com/keep", jf.TRACKING],
                "ownerReferences": [{"kind": "Job", "name": "trn-node-0", "controller": True}],
            }
        }

    pod = job_pod()
    c, calls = store(pod)
    assert jf.untrack(c, pod)
    assert pod["metadata"]["finalizers"] == ["example.com/keep"]
    when = float(pod["metadata"]["labels"][jf.UNTRACKED])
    assert not jf.stale(pod, when + jf.STALE - 1) and jf.stale(pod, when + jf.STALE + 1)
    assert jf.untrack(c, pod) and len(calls) == 1, "already untracked: no second patch"
    assert not jf.stale({**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "x"}}, when + 99)

    seen = copy.deepcopy(pod)  # what the agents' loop read; then a newer untrack relabels it
    pod["metadata"]["labels"][jf.UNTRACKED] = str(int(when) + 50)
    with pytest.raises(CriuctlError):
        jf.retrack(c, seen)
    assert jf.TRACKING not in pod["metadata"]["finalizers"]
    jf.retrack(c, pod)
    assert pod["metadata"]["finalizers"] == ["example.com/keep", jf.TRACKING]
    assert jf.UNTRACKED not in pod["metadata"]["labels"]

    bare = {"metadata": {"name": "p", "namespace": "ml", "finalizers": [jf.TRACKING]}}
    c, calls = store(bare)
    assert jf.untrack(c, bare) and not calls, "not a Job's pod: left alone"
    pod = job_pod()
    c, calls = store(pod, refuse=True)
    assert not jf.untrack(c, pod) and jf.TRACKING in pod["metadata"]["finalizers"]


def test_the_webhook_untracks_an_evicted_pod_and_never_refuses_an_eviction() -> None:
    """`webhook.review_eviction`: every eviction is allowed, a malformed review too (the webhook
    never stands between a drain and its pods); the untrack is asked for a real eviction only,
    never for a dry run or another request."""
    from criuctl.kube import webhook

    asked: list[tuple[str, str]] = []
    opts = webhook.Options(untrack=lambda ns, name: asked.append((ns, name)) or "untracked")

    def eviction(**over: Any) -> dict:
        req = {
            "uid": "u1",
            "operation": "CREATE",
            "kind": {"group": "policy", "version": "v1beta1", "kind": "Eviction"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "eviction",
            "namespace": "ml",
            "name": "trn-node-0-0-x",
            **over,
        }
        return {"apiVersion": webhook.API_VERSION, "kind": "AdmissionReview", "request": req}

    for review, untracked in (
        (eviction(), True),
        (eviction(dryRun=True), False),
        (eviction(subResource="status"), False),
        ({"apiVersion": "v1", "kind": "x"}, False),
    ):
        asked.clear()
        answer = webhook.review_eviction(review, opts)["response"]
        assert answer["allowed"] is True and "patch" not in answer, answer
        assert asked == ([("ml", "trn-node-0-0-x")] if untracked else []), review


def test_a_pod_of_an_owner_that_renames_its_replacement_is_refused_in_one_line() -> None:
    """The owners that replace a pod under another name: a ReplicaSet's pod (nothing tells its
    successor apart), a Job's that is not Indexed, and an Indexed one's without a subdomain (no
    stable DNS name) are refused by
    `podplan._owned` before anything is read or changed, each in one line that names the owner
    and says what moves."""
    from criuctl.kube import podplan

    def pod(kind: str, labels: dict | None = None, **spec: str) -> dict:
        meta = {
            "name": "w-x7k",
            "namespace": "ml",
            "labels": labels or {},
            "ownerReferences": [{"kind": kind, "name": "w", "controller": True}],
        }
        return {"metadata": meta, "spec": spec}

    for p, says in (
        (pod("ReplicaSet"), "pod of another name"),
        (pod("Job", {"job-name": "w"}, hostname="w-0"), "not by an Indexed Job"),
        (
            pod("Job", {"job-name": "w", "batch.kubernetes.io/job-completion-index": "0"}, hostname="w-0"),
            "DNS name",
        ),
        (pod("DaemonSet"), "pod of another name"),
    ):
        with pytest.raises(podplan.NotMigratable) as err:
            podplan._owned(None, p, {"name": "c"})  # type: ignore[arg-type]
        assert says in err.value.what and "nothing was changed" in err.value.hint, err.value
        assert "\n" not in err.value.line()


def test_the_controller_counts_moves_and_serves_them_behind_its_scrape_token(monkeypatch) -> None:
    """A PodMigration's phases, its end and its downtime reach the controller's /metrics (its
    health port), which asks for the scrape token when one is set, and never the agents' token."""
    import requests

    from criuctl.kube import controller, movemetrics, podmigrations
    from criuctl.kube.podmigrations import Phase

    def stored(c, ns, name, status, version=None):
        return {"metadata": {"namespace": ns, "name": name}, "status": status}

    monkeypatch.setattr(podmigrations, "patch_status", stored)
    monkeypatch.setattr(controller.events, "record", lambda *a, **k: None)
    fresh = movemetrics.MoveMetrics()
    monkeypatch.setattr(controller, "METRICS", fresh)
    j = controller.Journal(None, {"metadata": {"namespace": "ml", "name": "m1"}}, controller.Fence("me"))  # type: ignore[arg-type]
    j(Phase.CHECKING)
    j(Phase.CHECKING, target="b")  # the same phase again: entered once
    j.succeeded(None, "moved", downtime=1.5)
    srv = controller._serve_health("127.0.0.1:0", "s" * 32)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"

        def scrape(bearer: str) -> requests.Response:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
            return requests.get(url, headers=headers, timeout=5)

        assert scrape("").status_code == 401 and scrape("t" * 32).status_code == 401
        page = scrape("s" * 32)
        assert page.status_code == 200, page.text
        lines = page.text.splitlines()
        assert 'criuctl_podmigration_phases_total{phase="Checking"} 1.0' in lines
        assert 'criuctl_podmigrations_ended_total{phase="Succeeded"} 1.0' in lines
        assert "criuctl_podmigration_downtime_seconds_count 1.0" in lines
        assert requests.get(url.replace("/metrics", "/healthz"), timeout=5).text == "standby\n"
        # a replica that has no certificate yet says why it cannot lead (controller._identity)
        controller._Health.waiting = "no certificate from criuctl's signer yet (x)"
        said = requests.get(url.replace("/metrics", "/healthz"), timeout=5)
        assert (
            said.status_code == 200 and said.text == "standby: no certificate from criuctl's signer yet (x)\n"
        )
    finally:
        srv.shutdown()
        controller._Health.metrics_token = None
        controller._Health.waiting = ""


class _FakeCore:
    """The Node reads of a cluster where `nodes` exist (others: deleted)."""

    def __init__(self, nodes: dict[str, dict]) -> None:
        self.nodes = nodes

    def read_node(self, name: str) -> dict:
        if name not in self.nodes:
            raise cluster.NotFound(f"node {name} not found")
        return self.nodes[name]


class _FakeCluster:
    def __init__(self, nodes: dict[str, dict]) -> None:
        self.core = _FakeCore(nodes)

    def serialize(self, obj: dict) -> dict:
        return obj


def _in_doubt(monkeypatch, nodes: dict[str, dict], cancelled: str | None, answers: str | None):
    """A placeholder move in doubt (b silent), carried once by the controller: what it wrote, and
    the settle orders it sent to the source's agent."""
    from criuctl.kube import controller, podmigrate, podmigrations

    writes: list[dict] = []
    orders: list[tuple[str, str]] = []
    undone: list[str] = []
    status = {
        "phase": "InDoubt",
        "pod": "train",
        "newPod": "train-m1",
        "source": "a",
        "target": "b",
        "workload": "k8s-train",
        "incomingId": "i" * 32,
        "outgoingId": "o" * 32,
    }
    notes = {podmigrations.CANCEL: cancelled} if cancelled else {}
    obj = {
        "metadata": {"namespace": "ml", "name": "m1", "generation": 1, "annotations": notes},
        "status": status,
    }

    def stored(c, ns, name, st, version=None):
        writes.append(st)
        return {**obj, "status": {**obj["status"], **st}}

    def settle(src, workload, declared):
        orders.append((workload, declared))
        return answers

    monkeypatch.setattr(podmigrations, "read", lambda c, ns, name: obj)
    monkeypatch.setattr(podmigrations, "patch_status", stored)
    monkeypatch.setattr(controller.events, "record", lambda *a, **k: None)
    monkeypatch.setattr(controller, "agent_of", lambda c, n: podmigrate.Node(n, f"https://{n}:7070", "/t"))
    monkeypatch.setattr(controller, "agent_for", lambda c, node: podmigrate.Node("b", "https://b:7070", "/t"))
    monkeypatch.setattr(podmigrate, "take_up", lambda *a: None)  # b never answers
    monkeypatch.setattr(podmigrate, "source_settled", lambda src, og: None)  # a holds the job frozen
    monkeypatch.setattr(podmigrate, "settle_fenced", lambda src, w, d: settle(src, w, d) and src.name)
    monkeypatch.setattr(podmigrate, "undo_placing", lambda c, ns, pod, new, source, why: undone.append(new))
    c = _FakeCluster(nodes)
    with contextlib.suppress(controller.Retry):
        controller.carry(c, obj, controller.Fence("me"))  # type: ignore[arg-type]
    return writes, orders, undone


def test_a_cancelled_move_in_doubt_settles_only_once_its_target_is_fenced(monkeypatch) -> None:
    """Cancelled, b silent: nothing is settled while b's Node is there untainted (it may run the
    job); once it is deleted or tainted out-of-service, the source's agent is told to settle (it
    asks b once more), the placeholder goes, and the move ends Failed, Cancelled."""
    from criuctl.kube import podmigrate

    a = {"metadata": {"name": "a"}, "spec": {}}
    b = {"metadata": {"name": "b"}, "spec": {}}
    # not cancelled: in doubt, even with b deleted
    writes, orders, _ = _in_doubt(monkeypatch, {"a": a}, None, "thawed")
    assert not orders and writes[-1]["phase"] == "InDoubt"
    # cancelled, b there: waits, and says what would end it
    writes, orders, undone = _in_doubt(monkeypatch, {"a": a, "b": b}, "ann@laptop", "thawed")
    assert not orders and not undone and writes[-1]["phase"] == "InDoubt"
    assert podmigrate.OUT_OF_SERVICE in writes[-1]["reason"]
    # cancelled, b tainted out-of-service: settled
    tainted = {**b, "spec": {"taints": [{"key": podmigrate.OUT_OF_SERVICE, "effect": "NoExecute"}]}}
    writes, orders, undone = _in_doubt(monkeypatch, {"a": a, "b": tainted}, "ann@laptop", "thawed")
    assert orders == [
        (
            "k8s-train",
            f"node b is tainted {podmigrate.OUT_OF_SERVICE}; podmigration ml/m1 cancelled by ann@laptop",
        )
    ]
    assert undone == ["train-m1"] and writes[-1]["phase"] == "Failed"
    (failed,) = [c for c in writes[-1]["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "Cancelled" and "keeps running on a" in writes[-1]["hint"]
    # cancelled, b deleted, but b answered the source's last question: still in doubt, nothing undone
    writes, orders, undone = _in_doubt(monkeypatch, {"a": a}, "ann@laptop", None)
    assert orders and orders[0][1].startswith("node b is deleted") and not undone
    assert writes[-1]["phase"] == "InDoubt"


def test_a_cancel_before_the_move_began_ends_it_with_nothing_changed(monkeypatch) -> None:
    from criuctl.kube import controller, podmigrations

    writes: list[dict] = []
    obj = {
        "metadata": {"namespace": "ml", "name": "m2", "annotations": {podmigrations.CANCEL: "ann"}},
        "spec": {"pod": "train", "node": "b"},
    }
    monkeypatch.setattr(podmigrations, "read", lambda c, ns, name: obj)
    monkeypatch.setattr(
        podmigrations, "patch_status", lambda c, ns, n, st, version=None: (writes.append(st), obj)[1]
    )
    monkeypatch.setattr(controller.events, "record", lambda *a, **k: None)
    controller.carry(None, obj, controller.Fence("me"))  # type: ignore[arg-type]
    assert writes[-1]["phase"] == "Failed" and "nothing was changed" in writes[-1]["reason"]
    assert [c["reason"] for c in writes[-1]["conditions"]] == ["Cancelled"]


def _certificate(
    path: Path, node: str, ips: list[str], life: datetime.timedelta, age: datetime.timedelta
) -> None:
    """A key and a certificate for `node` in one PEM, as the agent keeps its identity."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)])
    start = datetime.datetime.now(datetime.UTC) - age
    san = [x509.DNSName(node), *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + life)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .sign(key, hashes.SHA256())
    )
    secret = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + secret)


def test_an_agents_identity_is_renewed_after_two_thirds_and_only_for_its_own_names(tmp_path: Path) -> None:
    """What the agent keeps across restarts: its certificate while it names this node as the API
    server has it and less than two thirds of its life are gone; else it asks for another."""
    from criuctl.kube import identity

    pem = tmp_path / "identity.pem"
    hour = datetime.timedelta(hours=1)
    _certificate(pem, "a", ["10.0.0.2"], life=3 * hour, age=hour)
    ident = identity.Identity(pem)
    assert not ident.due() and ident.names("a", ["10.0.0.2"])
    assert not ident.names("b", ["10.0.0.2"]) and not ident.names("a", ["10.0.0.3"])
    assert not ident.names("a", ["10.0.0.2", "10.0.0.3"])  # the node has an address it does not name
    _certificate(pem, "a", ["10.0.0.2"], life=3 * hour, age=2 * hour + datetime.timedelta(minutes=1))
    assert ident.due()
    pem.write_text("garbage")
    assert ident.due() and not ident.names("a", ["10.0.0.2"])


def test_a_nodes_certificate_opens_on_another_what_a_pending_move_names(tmp_path: Path, monkeypatch) -> None:
    """criuctl.kube.peerrules: on node b, a's certificate opens what runs there, and the bundle
    routes of a move whose record names both a and b; nothing the controller or b alone does."""
    import asyncio

    from criuctl.agent import records as agent_records
    from criuctl.agent import redirects
    from criuctl.kube import moves, peerrules

    monkeypatch.setenv("CRIUCTL_STATE_DIR", str(tmp_path / "state"))
    bid, other = "1" * 32, "2" * 32
    # b's redirects: one made for a's move (bundle bid), one for another move, one of a host job
    ours, theirs, hosts = "a" * 32, "b" * 32, "c" * 32
    for rid, move in ((ours, bid), (theirs, other), (hosts, None)):
        rec = redirects.RedirectRecord(
            rid, [["10.1.0.9", 1, "10.1.0.5", 2, "10.1.0.7"]], None, "t", move=move
        )
        agent_records.write(redirects._path(rid), rec.to_json())
    m = moves.Move(
        "ns", "p", "u", "a", "c", moves.Phase.KEPT, target="b", holder="b", bundle=bid, address="10.1.0.5"
    )
    far = moves.Move("ns", "q", "v", "c", "c", moves.Phase.KEPT, target="d", holder="d", bundle=other)
    records = [m, far]
    monkeypatch.setattr(moves, "every", lambda c: records)
    on_b = peerrules.PeerRules(None, "b")  # type: ignore[arg-type]

    class Request:  # what the rules read of aiohttp's request
        def __init__(self, method: str, path: str, body: Any) -> None:
            self.method, self.path, self.body = method, path, body

        async def json(self) -> Any:
            if self.body is None:
                raise ValueError("no body")
            return self.body

    def why(names: set[str], method: str, path: str, body: Any = None) -> str | None:
        return asyncio.run(on_b(frozenset(names), Request(method, path, body)))  # type: ignore[arg-type]

    # a job's rank: a brace or a new redirect only of connections to the moving rank's old address
    to_it = [["10.1.0.9", 41000, "10.1.0.5", 29500, "10.1.0.7"]]
    elsewhere = [
        ["10.1.0.9", 41000, "10.1.0.5", 29500, "10.1.0.7"],
        ["10.1.0.9", 5432, "10.9.9.9", 5432, "10.1.0.7"],
    ]
    assert why({"a"}, "POST", "/v1/redirects", {"rules": to_it, "move": bid}) is None
    assert why({"a"}, "POST", "/v1/workloads/w/brace", {"connections": [r[:4] for r in to_it]}) is None
    for path, body in [
        ("/v1/redirects", {"rules": elsewhere, "move": bid}),  # a database's connection too
        ("/v1/redirects", {"rules": to_it, "move": other}),  # another move's
        ("/v1/redirects", {"rules": [], "move": bid}),
        ("/v1/workloads/w/brace", {"connections": [r[:4] for r in elsewhere]}),
        ("/v1/workloads/w/brace", {"connections": "all"}),
    ]:
        assert "whose old address these connections name" in (why({"a"}, "POST", path, body) or ""), body
    assert "no JSON body" in (why({"a"}, "POST", "/v1/redirects") or "")

    a = {"a", "10.0.0.2"}
    assert why(a, "GET", "/v1/info") is None and why(a, "GET", "/v1/workloads") is None
    assert why({"e"}, "POST", f"/v1/bundles/{other}/page-client") is None  # asked before any record
    for method, path in [
        ("POST", f"/v1/bundles/{bid}/expect"),
        ("PUT", f"/v1/bundles/{bid}"),
        ("DELETE", f"/v1/bundles/{bid}"),
        ("POST", f"/v1/redirects/{ours}/keep"),
        ("DELETE", f"/v1/redirects/{ours}"),
    ]:
        assert why(a, method, path) is None, (method, path)
    assert "no pending move of bundle" in (why(a, "PUT", f"/v1/bundles/{other}") or "")
    assert "no pending move of bundle" in (why({"c"}, "DELETE", f"/v1/bundles/{bid}") or "")
    # a redirect by its id: only a node the move it follows names (not any node some move names)
    assert "does not name it" in (why({"e"}, "POST", f"/v1/redirects/{ours}/keep") or "")
    for method, tail in (("POST", "/keep"), ("DELETE", "")):
        assert "does not name it" in (why(a, method, f"/v1/redirects/{theirs}{tail}") or "")  # c's move's
        for rid in (hosts, "d" * 32):  # a host job's (its ticket settles it); none
            assert "no redirect of a pod's move" in (why(a, method, f"/v1/redirects/{rid}{tail}") or "")
    brace = {"connections": [r[:4] for r in to_it]}
    assert "whose old address" in (why({"e"}, "POST", "/v1/workloads/w/brace", brace) or "")
    for method, path in [  # reading a bundle, restoring it: the holder's own calls alone
        ("GET", f"/v1/bundles/{bid}"),
        ("GET", f"/v1/bundles/{bid}/manifest"),
        ("GET", f"/v1/bundles/{bid}/pages"),
        ("PUT", f"/v1/bundles/{bid}/expect"),
        ("POST", f"/v1/bundles/{bid}"),
        ("POST", f"/v1/bundles/{bid}/restore"),
        ("POST", "/v1/workloads/w/checkpoint"),
        ("GET", "/v1/workloads/w/logs"),
        ("POST", "/v1/incoming"),
        ("POST", "/v1/outgoing"),
        ("GET", "/metrics"),
    ]:
        assert "the controller's, or this node's own" in (why(a, method, path) or ""), (method, path)

    def malformed(c: object) -> list:
        raise KeyError("phase")  # a ConfigMap labelled as a record, without one: moves._from fails

    monkeypatch.setattr(moves, "every", malformed)
    assert "malformed record" in (why(a, "PUT", f"/v1/bundles/{bid}") or "")
    monkeypatch.setattr(moves, "every", lambda c: [])  # the move is over: its bundle's routes close
    assert why(a, "PUT", f"/v1/bundles/{bid}") is not None


def test_the_controllers_certificate_opens_a_move_only_with_that_moves_grant(
    tmp_path: Path, monkeypatch
) -> None:
    """criuctl.agent.grants: on node b, the controller's certificate alone reads what runs there;
    a move's routes take a grant signed by the controller's key (its certificate, issued by the
    agents' CA and naming the controller, attached: no node's, no other CA's, none ended),
    unexpired, naming b, and where the call names a workload, one of the granted pod's. A stolen
    grant opens nothing else, for minutes."""
    import asyncio
    import json
    from types import SimpleNamespace

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from criuctl.agent import grants
    from criuctl.agent.server import Agent, AgentOptions
    from criuctl.core import workloads
    from criuctl.kube import signer

    monkeypatch.setenv("CRIUCTL_STATE_DIR", str(tmp_path / "state"))
    hour, minute = datetime.timedelta(hours=1), datetime.timedelta(minutes=1)
    cas = {}
    for who in ("ca", "other"):  # the agents' CA, and another
        _certificate(tmp_path / f"{who}.pem", who, [], life=hour, age=minute)
        raw = (tmp_path / f"{who}.pem").read_bytes()
        cas[who] = signer.CA(
            x509.load_pem_x509_certificate(raw), serialization.load_pem_private_key(raw, None)
        )
    keys = {  # the controller's certificate of each, and a node's of the agents' CA
        who: grants.Signing.load(signer.controller_identity(ca, tmp_path / f"ctl-{who}.pem").path)
        for who, ca in cas.items()
    }
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = cas["ca"].certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")]),
        node_key.public_key(),
        x509.SubjectAlternativeName([x509.DNSName("a")]),
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        3600,
    )
    keys["node"] = grants.Signing(node_key, x509.load_pem_x509_certificate(node_cert))
    old = signer.controller_identity(cas["ca"], tmp_path / "ctl-old.pem", seconds=60)
    keys["old"] = grants.Signing.load(old.path)
    cafile = tmp_path / "ca.crt"
    cafile.write_bytes(cas["ca"].cert.public_bytes(serialization.Encoding.PEM))
    agent = Agent(AgentOptions("127.0.0.1", 0, None, name="b", peer_ca=cafile))
    workloads.save(workloads.Workload("ctr-aaaaaaaaaaaa", ["python"], 0, 0, {}, pod_uid="u1"))
    workloads.save(workloads.Workload("ctr-bbbbbbbbbbbb", ["python"], 0, 0, {}, pod_uid="u2"))

    class Request:  # what `grant_refusal` reads of aiohttp's request
        def __init__(self, method: str, path: str, grant: str | None, body: Any = None) -> None:
            self.method, self.path, self.body = method, path, body
            self.headers = {} if grant is None else {grants.GRANT_HEADER: grant}

        async def json(self) -> Any:
            return self.body

    def grant(nodes=("a", "b"), uid="u1", expires=300.0, key="ca") -> str:
        return grants.sign(grants.Grant("ns", "p", uid, nodes, time.time() + expires), keys[key])

    def why(method: str, path: str, shown: str | None, body: Any = None) -> str:
        return asyncio.run(agent.grant_refusal(Request(method, path, shown, body))) or ""  # type: ignore[arg-type]

    mig = "/v1/outgoing/" + "1" * 32
    assert why("GET", "/v1/workloads", None) == "" and why("GET", "/v1/info", None) == ""
    assert "without a move's grant" in why("GET", mig, None)
    assert why("GET", mig, grant()) == "" and why("DELETE", "/v1/incoming/" + "2" * 32, grant()) == ""
    for method, path in [
        ("POST", "/v1/workloads/ctr-aaaaaaaaaaaa/checkpoint"),
        ("GET", "/v1/bundles/" + "1" * 32),
    ]:
        assert "no move needs it" in why(method, path, grant()), path  # a grant opens a move's routes alone
    assert "not node b" in why("GET", mig, grant(nodes=("a", "c")))
    assert "expired" in why("GET", mig, grant(expires=-1))
    assert "claims to last" in why("GET", mig, grant(expires=2 * grants.LONGEST))
    # signed by another CA's controller, by a node of the agents' CA, by a certificate no longer valid
    assert "not issued by the agents' CA" in why("GET", mig, grant(key="other"))
    assert "not the controller's" in why("GET", mig, grant(key="node"))
    assert why("GET", mig, grant(key="old")) == ""
    with pytest.raises(grants.GrantRefused, match="not valid now"):  # two minutes on: it has ended
        grants.read(grant(key="old"), [cas["ca"].cert], "b", now=time.time() + 120)
    data, sig, cert = grant().split(".")
    forged = json.loads(grants._unb64(data)) | {"uid": "u2"}
    assert "signature" in why("GET", mig, f"{grants._b64(json.dumps(forged).encode())}.{sig}.{cert}")
    # the agents' CA's own key signs no grant either (version 1 did): a grant needs the controller's
    keys["self"] = grants.Signing(cas["ca"].key, cas["ca"].cert)
    assert "not the controller's" in why("GET", mig, grant(key="self"))
    other_cert = grant(key="other").split(".")[2]
    assert "not issued by" in why("GET", mig, f"{data}.{sig}.{other_cert}")
    assert "different versions" in why("GET", mig, f"{data}.{sig}")  # version 1's form
    assert "not one criuctl's controller writes" in why("GET", mig, f"{data}.{sig}.{cert}.x")
    assert "not one criuctl's controller writes" in why("GET", mig, "garbage")
    assert why("POST", "/v1/outgoing", grant(), {"workload": "ctr-aaaaaaaaaaaa"}) == ""
    for named in ("ctr-bbbbbbbbbbbb", "ctr-cccccccccccc", "../x"):  # another pod's, none, a hostile name
        assert "is not its container" in why("POST", "/v1/outgoing", grant(), {"workload": named}), named
    assert "is not its container" in why(
        "POST", "/v1/outgoing/settle", grant(uid="u2"), {"workload": "ctr-aaaaaaaaaaaa"}
    )
    og = "3" * 32  # a move the agent started, of pod u2's workload: its later calls are u2's grant's
    agent.outgoing.machines[og] = SimpleNamespace(spec=SimpleNamespace(workload="ctr-bbbbbbbbbbbb"))  # type: ignore[assignment]
    assert "is not its container" in why("POST", f"/v1/outgoing/{og}/commit", grant())
    assert why("POST", f"/v1/outgoing/{og}/commit", grant(uid="u2")) == ""
    assert why("GET", f"/v1/outgoing/{og}", grant(uid="u2")) == ""

    scope: list[Any] = [None]
    granter = grants.Granter(lambda: scope[0], lambda: keys["ca"])
    assert granter() == ""  # nothing planned yet: no grant, so only reads open
    scope[0] = ("ns", "p", "u1", ("a", "b"))
    first = granter()
    assert granter() == first and why("GET", mig, first) == ""
    scope[0] = ("ns", "p", "u1", ("a", "c"))  # the status names other nodes: signed anew
    assert "not node b" in why("GET", mig, granter())
    # a grant whose certificate ends within half a grant's life is signed anew, with the renewed one
    signing = [keys["old"]]  # ends in a minute
    scope[0] = ("ns", "p", "u1", ("a", "b"))
    granter = grants.Granter(lambda: scope[0], lambda: signing[0])
    first = granter()
    signing[0] = keys["ca"]  # the controller renewed its certificate
    assert granter() != first and granter().split(".")[2] == grant().split(".")[2]


def test_a_body_the_auth_middleware_read_still_reaches_the_handler() -> None:
    """The grant's check reads `POST /v1/outgoing`'s body (its workload) before the route does:
    the route must see the same body, not an empty one (aiohttp's `can_read_body` is False then)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from criuctl.agent.httpjson import body_json

    @web.middleware
    async def peek(request: web.Request, handler: Any) -> web.StreamResponse:
        await request.json()
        return await handler(request)

    async def route(request: web.Request) -> web.Response:
        return web.json_response(await body_json(request))

    async def go() -> None:
        app = web.Application(middlewares=[peek])
        app.router.add_post("/v1/outgoing", route)
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/v1/outgoing", json={"workload": "ctr-aaaaaaaaaaaa"})
            assert await r.json() == {"workload": "ctr-aaaaaaaaaaaa"}

    asyncio.run(go())


def test_the_signer_gives_the_controller_its_name_alone_and_a_client_certificate(tmp_path: Path) -> None:
    """criuctl.kube.signer: the controller's ServiceAccount gets a certificate naming the URI
    `callers.CONTROLLER` and nothing else, for calling alone (it serves nothing); a request of it
    that adds a node's name, or names another, is denied with why."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from criuctl.agent import callers
    from criuctl.kube import identity, signer

    _certificate(tmp_path / "ca.pem", "ca", [], life=datetime.timedelta(hours=1), age=datetime.timedelta(0))
    raw = (tmp_path / "ca.pem").read_bytes()
    ca = signer.CA(x509.load_pem_x509_certificate(raw), serialization.load_pem_private_key(raw, None))

    def spec(cn: str, *names: x509.GeneralName, user: str = identity.CONTROLLER_USER) -> dict:
        req = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
            .sign(ec.generate_private_key(ec.SECP256R1()), hashes.SHA256())
        )
        pem = base64.b64encode(req.public_bytes(serialization.Encoding.PEM)).decode()
        return {"spec": {"username": user, "request": pem}}

    s = signer.Signer.__new__(signer.Signer)  # judging the controller reads nothing from the API server
    s.ca, s.seconds = ca, 3600
    uri = x509.UniformResourceIdentifier(callers.CONTROLLER)
    req, why = s.judge(spec(identity.CONTROLLER_CN, uri))
    assert req is not None and why == "criuctl's controller"
    cert = x509.load_pem_x509_certificate(s.sign(req))
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    for bad in [
        spec(identity.CONTROLLER_CN, uri, x509.DNSName("node-a")),  # and a node's name
        spec("node-a", x509.DNSName("node-a")),  # a node's alone
        spec(identity.CONTROLLER_CN, x509.UniformResourceIdentifier("urn:criuctl:other")),
    ]:
        req, why = s.judge(bad)
        assert req is None and "not the controller's name alone" in why, why
    req, why = s.judge(spec(identity.CONTROLLER_CN, uri, user="system:serviceaccount:default:default"))
    assert req is None and "not criuctl's agent" in why, why


def test_a_signer_given_another_key_than_its_cas_refuses_to_start(tmp_path: Path) -> None:
    """What it signed would verify against no one's ca.crt: one line, before any request is signed."""
    hour = datetime.timedelta(hours=1)
    for who in ("ca", "other"):
        _certificate(tmp_path / f"{who}.pem", who, [], life=hour, age=datetime.timedelta(0))
    files = ["--ca-cert", str(tmp_path / "ca.pem"), "--ca-key", str(tmp_path / "other.pem")]
    r = subprocess.run(
        [*CRIUCTL, "signer", "--state-dir", str(tmp_path), *files, "--kubeconfig", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "is not the key of the CA certificate" in lines[0], (
        r.stderr
    )


def test_a_pod_is_deleted_for_its_move_only_once_its_hook_reaches_the_agent(monkeypatch) -> None:
    """criuctl.kube.podmigrate.heard: waits while the agent has not said it listens in the pod
    (a pod just started, a job just restored), returns once it has, and refuses in one line, with
    nothing changed, when the word does not come, when a process of the pod holds the port, or
    when the pod is gone or replaced meanwhile."""
    from criuctl.kube import mutate, podmigrate, podplan

    hook = {"preStop": {"httpGet": {"port": 7071, "path": "/v1/prestop/ml/st-0"}}}
    base = {
        "metadata": {"name": "st-0", "namespace": "ml", "uid": "u1", "annotations": {}},
        "spec": {"containers": [{"name": "train", "lifecycle": hook}]},
        "status": {"containerStatuses": [{"name": "train", "containerID": "containerd://c1"}]},
    }
    p = podplan.PodPlan("ml", "st-0", "a", "b", "train", "ctr-c1", "st-0", 0, 0, None, None, base, None)  # type: ignore[arg-type]
    answers: list[dict | None] = []
    monkeypatch.setattr(
        podmigrate, "read_pod", lambda c, ns, name: answers.pop(0) if len(answers) > 1 else answers[0]
    )
    monkeypatch.setattr(podmigrate.time, "sleep", lambda s: None)

    def saying(value: str | None, uid: str = "u1") -> dict:
        p = copy.deepcopy(base)
        p["metadata"]["uid"] = uid
        if value is not None:
            p["metadata"]["annotations"][mutate.LISTENER] = value
        return p

    answers[:] = [saying(None), saying(None), saying("c1")]
    podmigrate.heard(None, p)  # type: ignore[arg-type]
    assert answers == [saying("c1")], "it read until the agent's word came"
    answers[:] = [saying(None)]
    with pytest.raises(podplan.NotMigratable) as late:
        podmigrate.heard(None, p, wait=0)  # type: ignore[arg-type]
    assert (
        "not yet made its preStop listener" in late.value.what
        and "agent running on node a" in late.value.hint
    )
    answers[:] = [saying(mutate.TAKEN + "c1")]
    with pytest.raises(podplan.NotMigratable, match="a process of the pod listens on port 7071"):
        podmigrate.heard(None, p)  # type: ignore[arg-type]
    for gone in (None, saying("c1", uid="u2")):
        answers[:] = [gone]
        with pytest.raises(podplan.NotMigratable, match="pod st-0 is gone"):
            podmigrate.heard(None, p)  # type: ignore[arg-type]


def test_a_dumped_pod_whose_prestop_died_with_its_agent_is_deleted_once_its_bundle_is_sealed(
    monkeypatch,
) -> None:
    """criuctl.kube.successors._settle_dumping, in the restarted source agent: a pod not yet
    deleted is left alone (no agent asked); one Terminating without a sealed bundle waits (its dump
    goes on, or fails and it ends); one Terminating beside a sealed bundle runs nothing and is
    deleted at once, as its preStop would have next, and the bundle goes on to the target, kept."""
    from criuctl.client.agents import AgentError
    from criuctl.kube import moves, successors

    m = moves.Move("ml", "st-0", "u1", "a", "train", moves.Phase.DUMPING, target="b", bundle="0" * 32)
    live = {"metadata": {"name": "st-0", "namespace": "ml", "uid": "u1"}}
    leaving = {"metadata": {**live["metadata"], "deletionTimestamp": "2026-12-07T10:15:15Z"}}
    pods: list[dict] = []
    sealed: list[bool] = []
    done: list[str] = []

    class Agent:
        def get(self, path: str) -> dict:
            done.append(f"get {path.rsplit('/', 1)[-1]}")
            if not sealed[0]:
                raise AgentError("no bundle", "", 404, {})  # type: ignore[typeddict-item]
            return {}

        def copy_bundle(self, bundle: str, to: object) -> int:
            done.append("copy")
            return 1

    def delete_now(c, pod: dict) -> None:
        done.append(f"delete {pod['metadata']['uid']}")
        pods.remove(pod)

    monkeypatch.setattr(successors.owners, "pods_of", lambda c, ns, name, sel: list(pods))
    monkeypatch.setattr(successors, "_agent", lambda c, node: Agent())
    monkeypatch.setattr(successors, "delete_now", delete_now)
    monkeypatch.setattr(successors.moves, "save", lambda c, rec: done.append(f"save {rec.phase}"))
    for pod, has, then in (
        (live, True, []),
        (leaving, False, ["get manifest"]),
        (leaving, True, ["get manifest", "delete u1", "copy", f"save {moves.Phase.KEPT}"]),
    ):
        pods[:], sealed[:], done[:] = [pod], [has], []
        m.pages = "x"  # no page lookup in this test
        successors._settle_dumping(None, m, "a")  # type: ignore[arg-type]
        assert done == then, (pod, has)
    assert m.phase == moves.Phase.KEPT and m.holder == "b"


def test_who_may_write_a_move_record(monkeypatch) -> None:
    """criuctl.kube.recordrules.judge, the webhook's word on every write of a record: the
    controller writes requests; an agent begins a move only from its own node, for a pod being
    deleted there at the address it claims, keeping the target asked for and taking a bundle id no
    other move names; later writes keep the move's identity, come from a node it names and name one
    of its two nodes as holder; a node deletes only what names it, or a request or failure whose
    pod is gone. Anyone else is RBAC's."""
    from criuctl.kube import identity, moves
    from criuctl.kube.recordrules import Operation, Writer, judge

    C, U, D = Operation.CREATE, Operation.UPDATE, Operation.DELETE
    ctl, admin = Writer(identity.CONTROLLER_USER), Writer("kubernetes-admin")
    a, b, x = (Writer(identity.AGENT_USER, n) for n in "abx")
    pod = {
        "metadata": {"name": "st-0", "uid": "u1", "deletionTimestamp": "2026-12-07T10:00:00Z"},
        "spec": {"nodeName": "a"},
        "status": {"podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}]},
    }
    pods: dict[tuple[str, str], dict | None] = {("ml", "st-0"): pod}
    others = [moves.Move("ml", "other", "u9", "b", "t", moves.Phase.KEPT, target="a", bundle="9" * 32)]

    def rec(phase=moves.Phase.DUMPING, **kw) -> moves.Move:
        base = {"target": "b", "bundle": "1" * 32, "source_pod": "st-0", "address": "10.0.0.5"}
        if phase == moves.Phase.REQUESTED:
            base.update(bundle="", address="")
        kw = {**base, **kw}
        return moves.Move("ml", "st-0", kw.pop("uid", "u1"), kw.pop("source", "a"), "t", phase, **kw)

    def why(op, who, old, new) -> str | None:
        return judge(op, who, old, new, lambda ns, n: pods.get((ns, n)), lambda: others)

    req = rec(moves.Phase.REQUESTED)
    assert why(C, ctl, None, req) is None and why(D, ctl, rec(), None) is None
    assert "writes only requested" in (why(U, ctl, rec(), rec(moves.Phase.KEPT, holder="b")) or "")
    assert why(C, admin, None, rec(source="x", target="x")) is None  # RBAC's to judge
    # begun by its source, for its pod being deleted there
    assert why(C, a, None, rec()) is None and why(U, a, req, rec()) is None
    assert "only a move from its own node" in (why(C, x, None, rec()) or "")
    assert "not being deleted on node x" in (why(C, x, None, rec(source="x", target="x")) or "")
    assert "target asked for" in (why(U, a, req, rec(target="x")) or "")
    assert "no address 10.9.9.9" in (why(C, a, None, rec(address="10.9.9.9")) or "")
    assert "another move's" in (why(C, a, None, rec(bundle="9" * 32)) or "")
    assert "held by node a or b alone, not node x" in (why(C, a, None, rec(holder="x")) or "")
    pods[("ml", "st-0")] = {**pod, "metadata": {"name": "st-0", "uid": "u1"}}  # not being deleted
    assert "not being deleted on node a" in (why(C, a, None, rec()) or "")
    pods[("ml", "st-0")] = pod
    # later writes: the move's nodes, its identity unchanged, held by one of its two nodes
    kept = rec(moves.Phase.KEPT, holder="b", version="7")
    assert why(U, b, kept, rec(moves.Phase.PULLING, holder="b", pulled=5)) is None
    assert why(U, b, kept, rec(moves.Phase.FAILED, holder="a")) is None
    assert "may not write" in (why(U, x, kept, rec(moves.Phase.FAILED, holder="b")) or "")
    assert "held by node a or b alone" in (why(U, b, kept, rec(moves.Phase.KEPT, holder="x")) or "")
    assert "may not change target" in (why(U, b, kept, rec(moves.Phase.KEPT, holder="b", target="x")) or "")
    assert "may not change bundle" in (
        why(U, a, kept, rec(moves.Phase.KEPT, holder="b", bundle="2" * 32)) or ""
    )
    # deletions: a node the move names; else only a request or a failure whose pod is gone
    assert why(D, b, kept, None) is None
    assert "not part of" in (why(D, x, kept, None) or "")
    assert "not part of" in (why(D, x, req, None) or ""), "its pod is still there"
    pods[("ml", "st-0")] = None
    assert why(D, x, req, None) is None and why(D, x, rec(moves.Phase.FAILED), None) is None
    assert "not part of" in (why(D, x, kept, None) or ""), "a kept bundle's record"


def test_the_webhook_refuses_a_records_write_it_cannot_judge() -> None:
    """POST /records: another namespace's ConfigMap is none of criuctl's; without credentials, or
    with the API server silent, a write is refused (Fail closed), with why, in a 403."""
    from criuctl.kube import webhook

    def review(namespace: str = "criuctl-system") -> dict:
        request = {
            "uid": "r1",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "operation": "CREATE",
            "namespace": namespace,
            "name": "move.ml.st-0",
            "userInfo": {"username": "system:serviceaccount:criuctl-system:criuctl-agent"},
        }
        return {"apiVersion": webhook.API_VERSION, "kind": "AdmissionReview", "request": request}

    def silent(req: dict) -> str | None:
        raise webhook.MovesUnknown("the API server did not answer")

    assert webhook.review_record(review("ml"))["response"]["allowed"]
    cases = [
        (webhook.Options(), "no API credentials"),
        (webhook.Options(record_write=lambda req: "node x may not"), "node x may not"),
        (webhook.Options(record_write=silent), "did not answer"),
    ]
    for opts, says in cases:
        r = webhook.review_record(review(), opts)["response"]
        assert not r["allowed"] and r["status"]["code"] == 403 and says in r["status"]["message"], r
    assert webhook.review_record(review(), webhook.Options(record_write=lambda req: None))["response"][
        "allowed"
    ]
