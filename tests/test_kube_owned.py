"""Controller-owned pods keep their identity (docs/kubernetes.md, "Controller-owned pods"), on the
local cluster: a real StatefulSet controller, the PyTorchJob stand-in operator, `kubectl drain`
with the real eviction API and the real kubelet's preStop hook.

Each test follows the job across its pods' logs and checks the only thing a user cares about:
every step's loss and the final weights are those of an uninterrupted run, no step ran twice with
another loss, and the job did not start over.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from localcluster import __main__ as lc

from criuctl.kube.moves import record_name
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.kube import (
    JOB,
    Controller,
    Kubectl,
    LogFollower,
    combined_steps,
    drain,
    final,
    grant_migrator,
    steps,
    training_pod,
    wait_podmigration,
    wait_step,
)

pytestmark = [needs_criu, pytest.mark.slow]

STEPS = 500
SYSTEM_NS = "criuctl-system"


def _template(name: str, node: str, steps_: int) -> dict:
    """A pod template for a controller: the training pod, kept on `node` by a nodeSelector."""
    pod = training_pod(name, steps=steps_, container="pytorch")  # PyTorchJob's name; any for a StatefulSet
    spec = {**pod["spec"], "nodeSelector": {"kubernetes.io/hostname": node}}
    labels = {**pod["metadata"]["labels"], "app": name}
    return {"metadata": {"labels": labels, "annotations": pod["metadata"]["annotations"]}, "spec": spec}


def _statefulset(name: str, node: str) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": _template(name, node, STEPS),
        },
    }


def _pytorchjob(name: str, node: str) -> dict:
    template = _template(name, node, STEPS)
    master = {"replicas": 1, "restartPolicy": "OnFailure", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        # the strictest backoff: any restart of a container fails the job (a move restarts none)
        "spec": {"runPolicy": {"backoffLimit": 0}, "pytorchReplicaSpecs": {"Master": master}},
    }


def _apply_retrying(k: Kubectl, obj: dict, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while k("apply", "-f", "-", input=json.dumps(obj), check=False).returncode != 0:
        assert time.monotonic() < deadline, f"{obj['kind']} not accepted"
        time.sleep(0.5)


def _successor(k: Kubectl, name: str, old_uid: str, node: str, timeout: float = 300) -> dict:
    """The pod `name` after the move: another UID, on `node`, running the restored job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = k.get("pod", name)
        notes = (p or {}).get("metadata", {}).get("annotations") or {}
        if p and p["metadata"]["uid"] != old_uid and "criuctl.io/migrated-at" in notes:
            assert p["spec"]["nodeName"] == node, f"restored on {p['spec']['nodeName']}, not {node}"
            assert notes["criuctl.io/migrated-from"].startswith(f"default/{name}@")
            return p
        time.sleep(0.5)
    moves = k("-n", SYSTEM_NS, "get", "cm", "-l", "criuctl.io/move", "-o", "yaml", check=False).stdout
    raise AssertionError(f"pod {name} was not restored on {node} within {timeout}s; records: {moves[-1500:]}")


def _follow_to_the_end(k: Kubectl, followers: list[LogFollower], ref, name: str) -> None:
    """The job's steps over its pods' logs are the reference's, resumed (not restarted), and its
    final weights the reference's."""
    for f in followers:
        f.join(400)
    parts = [steps(f.text) for f in followers]
    assert all(parts), f"a pod's log showed no step: {[f.text[-300:] for f in followers]}"
    assert min(parts[-1]) > 0, "the job started over in the new pod"
    assert combined_steps(parts) == ref.steps
    assert final(followers[-1].text) == [ref.final], "final weights differ from an uninterrupted run"
    events = k("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json").stdout
    assert "Migrated" in events
    # its own record: another test's failure must not fail this one too
    assert k.get("cm", record_name("default", name), SYSTEM_NS) is None, "a finished move left its record"


def _move_with_cli(lay, k: Kubectl, name: str, node: str) -> dict:
    """`criuctl migrate` as a user whose RBAC is criuctl-migrator alone."""
    grant_migrator(k)
    env = {**os.environ, "KUBECONFIG": str(lay.dir / "migrator.kubeconfig")}
    r = subprocess.run(
        [*CRIUCTL, "migrate", name, node, "-o", "json"], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["new_pod"] == name and out["target"] == node, out
    assert out["mode"] == "post-copy through its successor", out  # the default where both nodes can
    assert out["pages_seconds"] is not None and 0 < out["downtime_seconds"] < out["total_seconds"], out
    return out


def _apply_podmigration(lay, k: Kubectl, name: str, node: str) -> str:
    """A PodMigration applied with kubectl by a user whose RBAC is criuctl-migrator alone; the node
    it ended on."""
    grant_migrator(k)
    pm = {
        "apiVersion": "criuctl.io/v1alpha1",
        "kind": "PodMigration",
        "metadata": {"name": f"{name}-to-{node}", "namespace": "default"},
        "spec": {"pod": name, "node": node},
    }
    r = subprocess.run(
        ["kubectl", "--kubeconfig", str(lay.dir / "migrator.kubeconfig"), "apply", "-f", "-"],
        input=json.dumps(pm),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    st = wait_podmigration(k, pm["metadata"]["name"], timeout=900)["status"]
    assert st["phase"] == "Succeeded" and st["via"] == "successor" and st["newPod"] == name, st
    assert st["result"]["mode"] == "post-copy through its successor" and st["downtime"], st
    return st["result"]["target"]


def _succeeded(job: dict) -> bool:
    conditions = job.get("status", {}).get("conditions", [])
    return any(c["type"] == "Succeeded" and c["status"] == "True" for c in conditions)


@pytest.fixture
def ref(reference):
    return reference(os.path.basename(JOB), "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")


def _moved_mid_training(k: Kubectl, name: str, ref, *moves) -> dict:
    """Pod `name` (its controller just created) trains past step 40; each of `moves()` moves it
    (the next one 20 steps after the last) and returns the node it should come back on; the
    successor runs there under the same name, and the job's log over all the pods is the
    uninterrupted run's."""
    new = k.wait_running(name, timeout=120)
    follow = [LogFollower(k, name)]
    follow[0].start()
    wait_step(k, name, 40)
    for move in moves:
        if len(follow) > 1:
            wait_step(k, name, max(steps(follow[-1].text) or [40]) + 20)
        new = _successor(k, name, new["metadata"]["uid"], move())
        follow.append(LogFollower(k, name))
        follow[-1].start()
    _follow_to_the_end(k, follow, ref, name)
    return new


def test_statefulset_pod_moves_keeping_its_name(local_cluster, ref) -> None:
    """`criuctl migrate st-0 b`: the StatefulSet controller (the real one) recreates st-0, the
    webhook pins it to b as the placeholder, b's agent restores the bundle its preStop kept. Then
    back to a: the restored pod's preStop reaches b's agent in the pod too (its listener is made
    from the placeholder's container, whose job was restored into it)."""
    lay, k = local_cluster
    k.apply(_statefulset("st", "a"))
    try:
        _moved_mid_training(
            k,
            "st-0",
            ref,
            lambda: _move_with_cli(lay, k, "st-0", "b")["target"],
            lambda: _move_with_cli(lay, k, "st-0", "a")["target"],
        )
    finally:
        k("delete", "statefulset", "st", "--wait=false")


def test_pytorchjob_worker_moves_keeping_its_name(local_cluster, ref) -> None:
    """A single-replica PyTorchJob's pod (the stand-in operator makes it and makes it again under
    its name), moved with `criuctl migrate`: same name, same rank env, bit-identical."""
    lay, k = local_cluster
    _apply_retrying(k, _pytorchjob("mnist", "a"))
    try:
        new = _moved_mid_training(
            k, "mnist-master-0", ref, lambda: _apply_podmigration(lay, k, "mnist-master-0", "b")
        )
        env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "1", "mnist-master-0")
        deadline = time.monotonic() + 60
        while not _succeeded(k.get("pytorchjob", "mnist") or {}):
            assert time.monotonic() < deadline, "the PyTorchJob did not succeed"
            time.sleep(1)
    finally:
        k("delete", "pytorchjob", "mnist", "--wait=false")


def test_drain_moves_the_pod_without_loss(local_cluster, ref) -> None:
    """`kubectl drain a`: the eviction deletes the pod, its preStop hook (the kubelet's own call)
    checkpoints the job into a bundle kept on b, the StatefulSet recreates it, and it continues."""
    lay, k = local_cluster
    k.apply(_statefulset("dr", "a"))
    # b's kernel refuses userfaultfd (criuctl.core.faults): no post-copy, so stop-and-copy, said so
    no_uffd = lay.node_dir("b") / "var-lib-criuctl" / "faults" / "userfaultfd"
    no_uffd.parent.mkdir(exist_ok=True)

    def drain_a() -> str:
        no_uffd.touch()
        drain(k, "a", "app=dr")
        return "b"

    try:
        _moved_mid_training(k, "dr-0", ref, drain_a)
        no_uffd.unlink()
        said = k("get", "events", "--field-selector", "involvedObject.name=dr-0").stdout
        assert "post-copy could not run (node b has no userfaultfd" in said and "stop-and-copy" in said, said
        # the drain's move is listed with every other: a PodMigration the controller followed
        (pm,) = [
            o["metadata"]["name"]
            for o in json.loads(k("get", "podmigrations", "-o", "json").stdout)["items"]
            if o["spec"]["pod"] == "dr-0"
        ]
        obj = wait_podmigration(k, pm)
        assert obj["metadata"]["annotations"]["criuctl.io/origin"] == "prestop"
        assert obj["status"]["phase"] == "Succeeded" and obj["status"]["source"] == "a", obj["status"]
        assert obj["status"]["result"]["mode"] == "stop-and-copy through its successor", obj["status"]
        assert obj["spec"]["node"] == "b"
    finally:
        no_uffd.unlink(missing_ok=True)
        k("uncordon", "a", check=False)
        k("delete", "statefulset", "dr", "--wait=false")


def _phase(k: Kubectl, pod: str) -> str | None:
    cm = k.get("configmap", f"move.default.{pod}", SYSTEM_NS)
    return (cm or {}).get("data", {}).get("phase")


@pytest.mark.parametrize("victim", ["target agent", "controller", "source agent"])
def test_killed_mid_move_loses_nothing(local_cluster, ref, victim: str) -> None:
    """While the pod's preStop checkpoints the job for node b:

    - a's agent pod, whose preStop is dumping the job, is killed: the dump (a handoff outside the
      agent's container) goes on and ends the job's tree, and a's restarted agent finds the
      bundle and carries it on to b;
    - b's agent pod is killed: the bundle's copy to b fails (the source's own copy is then the one
      kept, and the job comes back on a) or reaches b's restarted agent;
    - the leading controller is killed: the other replica takes the Lease over and follows the move
      from the PodMigration's status to its end (the agents carry it meanwhile); `criuctl migrate`,
      which only follows the object, sees it end.

    The job resumes once, bit-identical, and no move record is left: on b, except that b's agent
    dying may leave it on a (said as the failure it is); a's agent or the controller dying never
    costs the move."""
    lay, k = local_cluster
    name = {"target agent": "ka", "controller": "kc", "source agent": "ks"}[victim]
    pod = f"{name}-0"
    k.apply(_statefulset(name, "a"))

    def move_and_kill() -> str:
        env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
        cli = subprocess.Popen(
            [*CRIUCTL, "migrate", pod, "b", "-o", "json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while _phase(k, pod) != "dumping":
            assert cli.poll() is None and time.monotonic() < deadline, "the move never reached its dump"
            time.sleep(0.05)
        if victim == "controller":
            ctl = Controller(lay, k)
            ctl.wait_leader(ctl.kill_leader())
        else:
            agents = k.pods(SYSTEM_NS, "app.kubernetes.io/name=criuctl-agent")
            node = "a" if victim == "source agent" else "b"
            (agent,) = [p["metadata"]["name"] for p in agents if p["spec"]["nodeName"] == node]
            k("-n", SYSTEM_NS, "delete", "pod", agent, "--grace-period=0", "--force")
        out, err = cli.communicate(timeout=900)
        # only b's agent dying may end the move on a; the other two must not cost the move
        if cli.returncode == 4 and victim == "target agent":  # whole on a, said as the failure it is
            (line,) = err.strip().splitlines()[-1:]
            assert line.startswith("criuctl: error: ") and "not moved to node b" in line, err[-3000:]
            assert "on node a" in line and "Traceback" not in err, err[-3000:]
            return "a"
        assert cli.returncode == 0, f"{victim} killed: the move did not go on\n{err[-3000:]}"
        target = json.loads(out.strip().splitlines()[-1])["target"]
        assert target == "b", out
        return target

    try:
        _moved_mid_training(k, pod, ref, move_and_kill)
    finally:
        k("delete", "statefulset", name, "--wait=false")
        deadline = time.monotonic() + 120
        while not lc._agents_ready(lay):  # the next test needs b's agent again
            assert time.monotonic() < deadline, "b's agent did not come back"
            time.sleep(1)


PULL_STATE_MB = 1024  # live state besides the model: its pull takes seconds, the window the kills aim at
PULL_STEPS = 900


def _agent_pod(k: Kubectl, node: str) -> str:
    agents = k.pods(SYSTEM_NS, "app.kubernetes.io/name=criuctl-agent")
    (agent,) = [p["metadata"]["name"] for p in agents if p["spec"]["nodeName"] == node]
    return agent


def _when_pulling(k: Kubectl, pod: str, timeout: float = 300) -> dict:
    """The move record once the successor runs the job and pulls its memory."""
    deadline = time.monotonic() + timeout
    while True:
        cm = k.get("configmap", f"move.default.{pod}", SYSTEM_NS) or {}
        if cm.get("data", {}).get("phase") == "pulling":
            return cm["data"]
        assert time.monotonic() < deadline, f"the move never reached its pull: {cm.get('data')}"
        time.sleep(0.05)


def test_a_pull_outlives_both_agents_and_a_cut_link(local_cluster, reference) -> None:
    """Post-copy through the successor, hit while the successor pulls the job's memory (a GiB of
    live state besides the model): three moves of one StatefulSet pod, each with its own fault in
    that window, and the job runs on from each as if nothing happened.

    1. a → b, b's agent pod (the holder, whose loop follows the pull) killed: the keeper and its
       lazy-pages daemon live outside the agent's pod and go on; the restarted agent's loop finds
       the record `pulling` and finishes once the last page is in.
    2. b → a, b's agent pod (the source, whose dump handoff serves the pages) killed: the handoff
       lives outside the agent's pod and serves on.
    3. a → b, a's link cut for 5 s: the pull waits (TCP retransmits; the keepalive gives up only
       after 30 s) and resumes.

    Bit-identical to an uninterrupted run, no step run twice, no record left."""
    lay, k = local_cluster
    ref = reference(
        os.path.basename(JOB),
        "--steps",
        str(PULL_STEPS),
        "--workers",
        "2",
        "--log",
        "/dev/null",
        "--state-mb",
        str(PULL_STATE_MB),
    )
    st = _statefulset("pl", "a")
    st["spec"]["template"]["spec"]["containers"][0]["args"] = [
        *[
            a.replace(str(STEPS), str(PULL_STEPS))
            for a in st["spec"]["template"]["spec"]["containers"][0]["args"]
        ],
        "--state-mb",
        str(PULL_STATE_MB),
    ]
    k.apply(st)
    name = "pl-0"
    node_a = lay.node("a")
    try:
        first = k.wait_running(name, timeout=120)
        follow = [LogFollower(k, name)]
        follow[0].start()
        uid = first["metadata"]["uid"]
        for i, (to, fault) in enumerate((("b", "holder"), ("a", "source"), ("b", "cut"))):
            wait_step(k, name, 40 + 200 * i, timeout=300)
            env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
            cli = subprocess.Popen(
                [*CRIUCTL, "migrate", name, to, "-o", "json"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            record = _when_pulling(k, name)
            assert record["pages"] and record["page_cert"].startswith("-----BEGIN CERTIFICATE"), record
            if fault == "cut":
                subprocess.run(["ip", "link", "set", node_a.veth, "down"], check=True)
                time.sleep(5)
                subprocess.run(["ip", "link", "set", node_a.veth, "up"], check=True)
            else:
                k("-n", SYSTEM_NS, "delete", "pod", _agent_pod(k, "b"), "--grace-period=0", "--force")
            out, err = cli.communicate(timeout=900)
            assert cli.returncode == 0, err[-3000:]
            moved = json.loads(out.strip().splitlines()[-1])
            assert moved["target"] == to and moved["mode"] == "post-copy through its successor", moved
            new = _successor(k, name, uid, to)
            uid = new["metadata"]["uid"]
            follow.append(LogFollower(k, name))
            follow[-1].start()
            deadline = time.monotonic() + 120
            while not lc._agents_ready(lay):
                assert time.monotonic() < deadline, "b's agent did not come back"
                time.sleep(1)
        _follow_to_the_end(k, follow, ref, name)
    finally:
        subprocess.run(["ip", "link", "set", node_a.veth, "up"], check=False)
        k("delete", "statefulset", "pl", "--wait=false")


def test_pages_lost_mid_pull_end_the_move_and_the_job_starts_over_once(local_cluster, reference) -> None:
    """The source's pages go while the successor pulls them (its node died, or its serving time
    ran out: here its page server is killed). The successor's job cannot go on with memory it
    never got: its keeper ends it, the move fails and says why, the successor is deleted, and its
    controller makes an ordinary pod that starts the job over: never two copies, the new one an
    uninterrupted run from its first step."""
    lay, k = local_cluster
    args = ("--steps", str(STEPS), "--workers", "2", "--log", "/dev/null", "--state-mb", str(PULL_STATE_MB))
    ref = reference(os.path.basename(JOB), *args)
    st = _statefulset("ls", "a")
    ctr = st["spec"]["template"]["spec"]["containers"][0]
    ctr["args"] = [*ctr["args"], "--state-mb", str(PULL_STATE_MB)]
    k.apply(st)
    name = "ls-0"
    try:
        first = k.wait_running(name, timeout=120)
        wait_step(k, name, 40)
        env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
        cli = subprocess.Popen(
            [*CRIUCTL, "migrate", name, "b"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        record = _when_pulling(k, name)
        serving = lay.node_dir("a") / "var-lib-criuctl" / "pages" / record["bundle"] / "serving.json"
        handoff = json.loads(serving.read_text())["pid"]
        for pid in [
            handoff,
            *(
                int(p)
                for p in subprocess.run(
                    ["pgrep", "-P", str(handoff)], capture_output=True, text=True
                ).stdout.split()
            ),
        ]:
            os.kill(pid, 9)  # the handoff and the CRIU that serves the pages: gone as with their node
        _, err = cli.communicate(timeout=900)
        (line,) = err.strip().splitlines()[-1:]
        assert cli.returncode == 4 and line.startswith("criuctl: error: "), err[-3000:]
        assert "memory could not be pulled from node a" in line and "starts over" in line, line
        assert "Traceback" not in err
        # its controller's new pod: no placeholder, the job from its first step, once
        deadline = time.monotonic() + 180
        while True:
            pods = [p for p in k.pods(selector="app=ls") if not p["metadata"].get("deletionTimestamp")]
            fresh = [p for p in pods if p["metadata"]["uid"] != first["metadata"]["uid"]]
            notes = fresh[0]["metadata"].get("annotations", {}) if fresh else {}
            if (
                fresh
                and "criuctl.io/placeholder-for" not in notes
                and fresh[0]["status"].get("phase") == "Running"
            ):
                break
            assert time.monotonic() < deadline, f"no ordinary successor: {[p['metadata'] for p in pods]}"
            time.sleep(1)
        assert len(pods) == 1, "two copies of the job"
        follow = LogFollower(k, name)
        follow.start()
        follow.join(600)
        assert min(steps(follow.text)) == 0 and steps(follow.text) == ref.steps, follow.text[-1000:]
        assert final(follow.text) == [ref.final]
        assert not k("-n", SYSTEM_NS, "get", "cm", "-l", "criuctl.io/move", "-o", "name").stdout.strip() or (
            _phase(k, name) == "failed"
        ), "the failed move's record says something else"
    finally:
        k("delete", "statefulset", "ls", "--wait=false")
