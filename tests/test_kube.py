"""`criuctl migrate POD NODE` and the webhook on a real Kubernetes (tests/conftest.py `local_cluster`):
the API server calls the webhook itself, kubelets start the pods through containerd, criuctl's agent
runs as the DaemonSet of manifests/, and a training pod (DataLoader workers, a thread, a log file in
an emptyDir) moves a → b → a with bit-identical losses and final weights."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from localcluster import __main__ as lc
from localcluster.layout import REPO

from tests.conftest import needs_criu
from tests.kube import (
    JOB,
    Controller,
    Kubectl,
    LogFollower,
    advertise,
    criuctl,
    criuctl_runs_the_built_image,
    final,
    migrate_pod,
    steps,
    to_the_end,
    training_pod,
    wait_step,
)
from tests.requirements import installed_criu

pytestmark = [needs_criu, pytest.mark.timeout(600)]
CRIUCTL = [str(REPO / ".venv" / "bin" / "criuctl")]
STEPS = 400


def _dry_run(k: Kubectl, pod: dict, namespace: str = "default") -> dict:
    """What the API server would store: admission (our webhook, called by the server) included."""
    r = k("-n", namespace, "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod))
    return json.loads(r.stdout)


def _sleeper(name: str, labels: dict | None = None, node: str | None = None, memory: str = "16Mi") -> dict:
    spec = {
        "containers": [
            {
                "name": "main",
                "image": "criuctl.test/busybox:1",
                "imagePullPolicy": "Never",
                "command": ["/bin/sleep", "3600"],
                "resources": {"requests": {"memory": memory, "cpu": "10m"}},
            }
        ],
        "terminationGracePeriodSeconds": 1,
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def test_agent_image_runs_doctor_and_agent_help(local_cluster) -> None:
    """The agent pods run the image built from the Dockerfile: inside it `criuctl doctor` passes
    (CRIU runs in the pod, against this node's kernel and runtime) and names the image's commit and
    CRIU; `criuctl agent --help` answers; and the image holds what the agent needs and nothing of
    training (no torch, numpy, matplotlib) or of building (no compiler, no source tree)."""
    lay, k = local_cluster
    pod = criuctl_runs_the_built_image(lay, k)[0]["metadata"]["name"]

    def inside(*argv: str) -> subprocess.CompletedProcess:
        return k("-n", "criuctl-system", "exec", pod, "--", *argv, check=False)

    doctor = inside("criuctl", "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    commit = lay.agent_image.split("-g")[1][:12]
    built = installed_criu()  # by the same script as on the host
    assert f"agent image of commit {commit} (CRIU {built})" in doctor.stdout, doctor.stdout
    assert f"ok   CRIU: {built} at /usr/local/sbin/criu" in doctor.stdout, doctor.stdout
    assert "ok   criu check" in doctor.stdout and "ok   container runtime: containerd" in doctor.stdout
    # the node's whole tree mounted (manifests/daemonset.yaml), the kubelets' --cgroup-root under it
    said = [line for line in doctor.stdout.splitlines() if line.startswith("ok   cgroups: ")]
    assert said and "cgroupfs driver; the node's cgroup namespace" in said[0], doctor.stdout
    version = inside("criuctl", "--version")
    assert f"agent image of commit {commit} (CRIU {built})" in version.stdout, version.stdout
    help_ = inside("criuctl", "agent", "--help")
    assert help_.returncode == 0 and "--listen" in help_.stdout, help_.stdout + help_.stderr
    probe = (
        "import importlib.util as u, shutil, sys; "
        "print([m for m in ('torch', 'numpy', 'matplotlib', 'pip') if u.find_spec(m)], "
        "[c for c in ('gcc', 'cc', 'make') if shutil.which(c)], sys.prefix)"
    )
    r = inside("python", "-c", probe)
    assert r.stdout.split() == ["[]", "[]", "/opt/criuctl/venv"], r.stdout + r.stderr
    gone = ("/opt/criuctl/src", "/usr/local/src/criuctl", "/opt/criuctl/venv/bin/pip")
    r = inside("sh", "-c", f"ls -d {' '.join(gone)} 2>&1; true")
    assert r.stdout.count("No such file") == len(gone), r.stdout


def test_webhook_called_by_the_api_server(local_cluster) -> None:
    _, k = local_cluster
    wrapped = _dry_run(k, training_pod("w1"))
    c = wrapped["spec"]["containers"][0]
    assert c["command"][1:4] == ["-I", "/.criuctl/nsinit.py", "--"], c["command"]
    assert c["command"][4:] == training_pod("w1")["spec"]["containers"][0]["command"]
    assert c["args"] == training_pod("w1")["spec"]["containers"][0]["args"], "args must stay as written"
    assert {"name": "criuctl-inject", "mountPath": "/.criuctl", "readOnly": True} in c["volumeMounts"]
    assert wrapped["metadata"]["annotations"]["criuctl.io/injected"] == "true"
    plain = _dry_run(k, _sleeper("p1"))
    assert plain["spec"]["containers"][0]["command"] == ["/bin/sleep", "3600"]
    assert "criuctl.io/injected" not in (plain["metadata"].get("annotations") or {})
    # a namespace labelled migratable: its pods are wrapped without a label, unless they opt out
    k("create", "namespace", "mig")
    try:
        k("label", "namespace", "mig", "criuctl.io/migratable=true")
        in_ns = _dry_run(k, _sleeper("n1"), "mig")
        assert in_ns["spec"]["containers"][0]["command"][2:4] == ["/.criuctl/nsinit.py", "--"]
        out = _dry_run(k, _sleeper("n2", {"criuctl.io/migratable": "false"}), "mig")
        assert out["spec"]["containers"][0]["command"] == ["/bin/sleep", "3600"]
    finally:
        k("delete", "namespace", "mig", "--wait=false")


def _scale_webhook(k: Kubectl, replicas: int) -> None:
    """The webhook's Deployment scaled to `replicas`, once the Service names exactly that many ready
    pods (the API server calls those addresses)."""
    k("-n", "criuctl-system", "scale", "deployment", "criuctl-webhook", f"--replicas={replicas}")
    deadline = time.monotonic() + 90
    while True:
        ep = k.get("endpoints", "criuctl-webhook", "criuctl-system") or {}
        ready = sum(len(s.get("addresses", [])) for s in ep.get("subsets") or [])
        pods = k.pods("criuctl-system", "app.kubernetes.io/name=criuctl-webhook")
        if ready == replicas and len(pods) == replicas:
            return
        assert time.monotonic() < deadline, f"webhook: {ready} addresses, {len(pods)} pods, not {replicas}"
        time.sleep(0.5)


def test_webhook_down_blocks_only_labelled_pods(local_cluster) -> None:
    """With the webhook down (its Deployment scaled to zero), a pod labelled migratable is refused
    with the webhook named (Fail: admitted unwrapped, a move's successor would start its job over),
    and every other pod is admitted unchanged: the cluster is never blocked (docs/webhook.md)."""
    _, k = local_cluster
    replicas = k.get("deployment", "criuctl-webhook", "criuctl-system")["spec"]["replicas"]
    _scale_webhook(k, 0)
    try:
        r = k(
            "create",
            "--dry-run=server",
            "-o",
            "json",
            "-f",
            "-",
            input=json.dumps(training_pod("d1")),
            check=False,
        )
        assert r.returncode != 0 and "pods.criuctl.io" in r.stderr, r.stderr
        assert _dry_run(k, _sleeper("d2"))["spec"]["containers"][0]["command"] == ["/bin/sleep", "3600"]
    finally:
        _scale_webhook(k, replicas)
    assert _dry_run(k, training_pod("d3"))["spec"]["containers"][0]["command"][2] == "/.criuctl/nsinit.py"


def test_pod_moves_there_and_back_bit_identical(local_cluster, reference) -> None:
    lay, k = local_cluster
    ref = reference(os.path.basename(JOB), "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")
    pod = training_pod("train", steps=STEPS, node="a", extra_spec={"restartPolicy": "OnFailure"})
    k.apply(pod)
    k.wait_running("train")
    follow = [LogFollower(k, "train")]
    follow[0].start()
    wait_step(k, "train", 40)
    on_b = migrate_pod(lay, k, "train", "b")
    follow.append(LogFollower(k, on_b))
    follow[-1].start()
    before = max(steps(k.logs(on_b)) or [0])
    wait_step(k, on_b, before + 30)  # it trains on b, and `kubectl logs` of the new pod shows it
    on_a = migrate_pod(lay, k, on_b, "a", "--mode", "stop-and-copy")
    follow.append(LogFollower(k, on_a))
    follow[-1].start()
    to_the_end(k, on_a, follow)
    parts = [steps(f.text) for f in follow]
    assert all(parts), "a pod's log showed no step: the move was not mid-training"
    combined: dict[int, str] = {}
    for part in parts:
        for s, loss in part.items():
            assert combined.get(s, loss) == loss, f"step {s} reported twice with different losses"
            combined[s] = loss
    assert min(parts[1]) > 0 and min(parts[2]) > 0, "a move started the job over"
    assert combined == ref.steps
    assert final(follow[-1].text) == [ref.final], "final weights differ from the uninterrupted run"
    # the log file in the emptyDir continued across both moves (heartbeats from the thread too)
    text = k("exec", on_a, "--", "cat", "/scratch/train.log", check=False).stdout
    assert text == "" or f"step {STEPS - 1} " in text  # the pod has exited: exec may find no container
    reasons = k("get", "events", "--field-selector", f"involvedObject.name={on_a}", "-o", "json").stdout
    assert "Migrated" in reasons
    k("delete", "pod", on_a, "--wait=false")


@pytest.fixture(scope="module")
def running(local_cluster):
    """A migratable training pod on node a for the refusals below (each must leave it running)."""
    lay, k = local_cluster
    k.apply(training_pod("steady", steps=100000, node="a"))
    k.wait_running("steady")
    k.apply(_sleeper("plain", node="a"))
    k.wait_running("plain")
    yield lay, k
    k("delete", "pod", "steady", "plain", "--grace-period=1", "--wait=false")


def _live_pods(k: Kubectl) -> tuple[set[str], set[str]]:
    """The pods by name: those standing, and those an earlier test's delete is still taking away."""
    pods = {p["metadata"]["name"]: bool(p["metadata"].get("deletionTimestamp")) for p in k.pods()}
    return {n for n, going in pods.items() if not going}, set(pods)


def _wait_gone_or_say_why(lay, k: Kubectl, pod: str) -> None:
    """A pod deleted with a short grace; the node's kubelet lines about it if it stays (CI once saw
    one stay 60 s with its status never past PodInitializing, and kept no kubelet log)."""
    try:
        k.wait_gone("pod", pod, timeout=180)
    except AssertionError as exc:
        node = ((k.get("pod", pod) or {}).get("spec") or {}).get("nodeName", "a")
        log = lay.dir / "logs" / f"node-{node}.log"
        about = [line for line in log.read_text(errors="replace").splitlines() if pod in line]
        raise AssertionError(f"{exc}\nkubelet on {node}:\n" + "\n".join(about[-40:])) from None


def _refused(lay, k: Kubectl, *args: str) -> str:
    standing, present = _live_pods(k)
    r = criuctl(lay, "migrate", *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0, r.stderr
    assert len(lines) == 1 and lines[0].startswith("criuctl: error: "), r.stderr
    assert "Traceback" not in r.stderr
    after, after_present = _live_pods(k)
    # a refusal makes no pod and deletes none (a pod already going before it may finish going)
    assert after == standing and after_present <= present, f"a refusal changed the cluster: {r.stderr}"
    assert k.get("pod", "steady")["status"]["phase"] == "Running"
    return lines[0]


def test_refusals_change_nothing(running) -> None:
    lay, k = running
    assert "no pod 'nosuch'" in _refused(lay, k, "nosuch", "b")
    assert "no node 'nowhere'" in _refused(lay, k, "steady", "nowhere")
    assert "already runs on node a" in _refused(lay, k, "steady", "a")
    assert "not migratable" in _refused(lay, k, "plain", "b")
    assert "not a valid pod name" in _refused(lay, k, "../../etc", "b")
    assert "not a valid node name" in _refused(lay, k, "steady", "b;rm")
    # a Node object no kubelet serves: NotReady
    k.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "ghost"}})
    try:
        assert "node ghost is NotReady" in _refused(lay, k, "steady", "ghost")
        # reported Ready (as by a kubelet) but with no criuctl agent on it
        status = {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "test",
                        "lastHeartbeatTime": _now(),
                        "lastTransitionTime": _now(),
                    }
                ],
                "allocatable": {"memory": "8Gi", "cpu": "2", "pods": "10"},
                "capacity": {"memory": "8Gi", "cpu": "2", "pods": "10"},
            }
        }
        k(
            "patch",
            "node",
            "ghost",
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
        assert _ready(k.get("node", "ghost")), "the Node's status was not taken"
        assert "node ghost has no ready criuctl agent" in _refused(lay, k, "steady", "ghost")
    finally:
        k("delete", "node", "ghost", "--wait=false")
    # a cordoned node
    k("cordon", "b")
    try:
        assert "cordoned" in _refused(lay, k, "steady", "b")
    finally:
        k("uncordon", "b")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def test_refused_without_memory_on_the_target(running) -> None:
    lay, k = running
    node = k.get("node", "b")
    from kubernetes.utils import parse_quantity

    alloc = int(parse_quantity(node["status"]["allocatable"]["memory"]))
    used = sum(
        int(parse_quantity(c.get("resources", {}).get("requests", {}).get("memory", "0")))
        for p in k.pods("criuctl-system")
        if p["spec"].get("nodeName") == "b"
        for c in p["spec"]["containers"]
    )
    k.apply(_sleeper("filler", node="b", memory=str((alloc - used - (100 << 20)) >> 20) + "Mi"))
    try:
        k.wait_running("filler")
        assert "allocatable memory free" in _refused(lay, k, "steady", "b")
    finally:
        k("delete", "pod", "filler", "--grace-period=1")


def test_a_gpu_pod_is_refused_where_no_gpu_is_free_and_moves_where_one_is(running) -> None:
    """A pod that requests nvidia.com/gpu: its placeholder asks the target for one too, so a target
    whose GPUs are all taken (here: none advertised free) is refused before anything is made, in one
    line; one with a free GPU gets the placeholder, and the pod moves. (No device plugin here: the
    nodes advertise the resource as one would; the job itself is a CPU job.)"""
    lay, k = running
    gpu = "nvidia.com/gpu"
    advertise(k, "a", gpu, 1)
    advertise(k, "b", gpu, 0)
    pod = training_pod("gpu-steady", steps=100000, node="a")
    pod["spec"]["containers"][0]["resources"]["limits"] = {gpu: "1"}
    moved = None
    try:
        k.apply(pod)
        k.wait_running("gpu-steady")
        assert _refused(lay, k, "gpu-steady", "b").endswith(
            f"node b has 0 {gpu} free; pod gpu-steady needs 1: pick a node with a free {gpu} "
            "(`kubectl describe node`) or free one there; nothing was changed"
        )
        advertise(k, "b", gpu, 1)
        moved = migrate_pod(lay, k, "gpu-steady", "b")
        placed = k.get("pod", moved)
        assert placed is not None and placed["spec"]["nodeName"] == "b"
        assert placed["spec"]["containers"][0]["resources"]["limits"][gpu] == "1"
    finally:
        gone = ("--grace-period=1", "--wait=false", "--ignore-not-found")  # the move deleted the source
        k("delete", "pod", "gpu-steady", *([moved] if moved else []), *gone)
        advertise(k, "a", gpu, None)
        advertise(k, "b", gpu, None)
    for name in ("gpu-steady", moved):  # the next refusals compare the pods before and after
        if name:
            k.wait_gone("pod", name)


def test_refuses_pods_whose_controller_would_not_bring_them_back(running) -> None:
    """The PyTorchJob CRD is the stand-in operator's (`up` installs it); this job has no pod
    templates, so the stand-in creates no pods for it (it marks it failed validation): the worker
    pod here is made by hand, owned by the job as the operator's would be. A finished job would not
    recreate its worker, so the move is refused (a running job's worker moves: test_kube_jobs)."""
    lay, k = running
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "ddp"},
        "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1}, "Worker": {"replicas": 1}}},
    }
    deadline = time.monotonic() + 30
    while k("apply", "-f", "-", input=json.dumps(job), check=False).returncode != 0:
        assert time.monotonic() < deadline, "the PyTorchJob CRD was not served"
        time.sleep(0.5)
    uid = k.get("pytorchjob", "ddp")["metadata"]["uid"]
    worker = training_pod("ddp-worker-0", steps=100000, node="a")
    worker["metadata"]["ownerReferences"] = [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "ddp", "uid": uid, "controller": True}
    ]
    k.apply(worker)
    try:
        k.wait_running("ddp-worker-0")
        assert "the PyTorchJob has finished" in _refused(lay, k, "ddp-worker-0", "b")
    finally:
        k("delete", "pod", "ddp-worker-0", "--grace-period=1", "--wait=false")
    _wait_gone_or_say_why(lay, k, "ddp-worker-0")  # else it may go during the next refusal
    trainer = training_pod("x", steps=100000, node="a")  # migratable: only the owner is refused
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dep"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "dep"}},
            "template": {
                "metadata": {
                    "labels": {"app": "dep", "criuctl.io/migratable": "true"},
                    "annotations": trainer["metadata"]["annotations"],
                },
                "spec": trainer["spec"],
            },
        },
    }
    k.apply(dep)
    try:
        deadline = time.monotonic() + 60
        while not (pods := k.pods(selector="app=dep")):
            assert time.monotonic() < deadline, "the Deployment made no pod"
            time.sleep(0.5)
        name = pods[0]["metadata"]["name"]
        k.wait_running(name)
        said = _refused(lay, k, name, "b")
        assert "owned by ReplicaSet" in said and "another name" in said, said
    finally:
        k("delete", "deployment", "dep", "--wait=false")


def test_target_agent_killed_mid_move_leaves_the_source_pod_running(running, tmp_path) -> None:
    """The target node's agent pod dies once the bundle reached it (the controller stopped at
    client.sent meanwhile): the move fails in one line, the placeholder pod is deleted, the source
    pod's job thaws and goes on training, Events say so."""
    lay, k = running
    ctl = Controller(lay, k)
    ctl.arm("client.sent")
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    cli = subprocess.Popen(
        [*CRIUCTL, "migrate", "steady", "b", "--mode", "stop-and-copy"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ctl.reached("client.sent")
    finally:
        ctl.disarm()
    agent = next(p["metadata"]["name"] for p in k.pods("criuctl-system") if p["spec"]["nodeName"] == "b")
    k("-n", "criuctl-system", "delete", "pod", agent, "--grace-period=0", "--force")
    ctl.go("client.sent")
    _, err = cli.communicate(timeout=300)
    assert cli.returncode == 4, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("criuctl: error: ") and "keeps running on a" in last, err
    assert "Traceback" not in err
    k.wait_gone("pod", "steady-m1")
    before = max(steps(k.logs("steady")))
    wait_step(k, "steady", before + 5)  # thawed: it trains on, in its own pod
    assert k.get("pod", "steady")["status"]["containerStatuses"][0]["restartCount"] == 0
    reasons = k("get", "events", "--field-selector", "involvedObject.name=steady", "-o", "json").stdout
    assert "MigrationFailed" in reasons
    deadline = time.monotonic() + 120  # the DaemonSet brings the agent back for the next tests
    while not lc._agents_ready(lay):
        assert time.monotonic() < deadline, "the agent on b did not come back"
        time.sleep(1)
