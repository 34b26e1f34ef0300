"""The admission webhook: the pure mutation (criuctl.kube.mutate), the AdmissionReview handling, the
real HTTPS server with a certificate from scripts/webhook-cert.sh, that script's cluster steps
(against a recording fake kubectl), and what manifests/webhook.yaml must agree on with all of them.

No cluster and no root: pods are the JSON dicts the API server sends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from criuctl.agent import preflight
from criuctl.container import containers
from criuctl.core import nsinit
from criuctl.kube import moves, mutate, webhook
from criuctl.kube.mutate import INIT, INJECTED, NOT_WRAPPED, PLACEHOLDER_FOR
from tests import podsecurity
from tests.jobs import CRIUCTL

ROOT = Path(__file__).resolve().parent.parent
CERT_SCRIPT = ROOT / "scripts" / "webhook-cert.sh"
MANIFEST = ROOT / "manifests" / "webhook.yaml"
TOKEN_VOLUME = "kube-api-access-x7k2p"  # what the ServiceAccount admission plugin adds (>= 1.22)
OLD_TOKEN_VOLUME = "trainer-token-9fzq2"  # the same before 1.22: a Secret volume `<sa>-token-…`

Obj = dict[str, Any]


# ----------------------------------------------------------------------------------- fixtures


def pod(*containers_: Obj, annotations: Obj | None = None, **spec: Any) -> Obj:
    """A pod as the API server sends it to a mutating webhook on CREATE: no uid yet, and the
    service-account token volume already added (built-in admission runs before webhooks)."""
    token_mount = {"name": TOKEN_VOLUME, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    cs = [
        {**c, "volumeMounts": [*c.get("volumeMounts", []), dict(token_mount, readOnly=True)]}
        for c in containers_
    ]
    meta: Obj = {"generateName": "train-", "namespace": "ml", "labels": {mutate.LABEL: "true"}}
    if annotations is not None:
        meta["annotations"] = annotations
    volumes = [*spec.pop("volumes", []), {"name": TOKEN_VOLUME, "projected": {"sources": []}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"serviceAccountName": "trainer", "containers": cs, "volumes": volumes, **spec},
    }


TRAIN = {"name": "train", "image": "trainer:1", "command": ["python"], "args": ["train.py", "--epochs", "3"]}
SIDECAR = {"name": "sidecar", "image": "exporter:2"}  # runs its image's ENTRYPOINT
INIT_CONTAINER = {"name": "fetch", "image": "fetcher:1", "command": ["sh", "-c", "fetch data"]}


def containers_by_name(p: Obj) -> dict[str, Obj]:
    return {c["name"]: c for c in p["spec"]["containers"]}


def apply_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """A minimal RFC 6902 applier (add, replace, remove on objects and lists), as the API server
    applies the webhook's patch; independent of criuctl's code."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if isinstance(target, list):
            index = len(target) if last == "-" else int(last)
            if op["op"] == "remove" or op["op"] == "replace":
                del target[index]
            if op["op"] in ("add", "replace"):
                target.insert(index, copy.deepcopy(op["value"]))
        elif op["op"] == "remove":
            del target[last]
        else:
            assert op["op"] == "add" or last in target, f"replace of a missing member: {op}"
            target[last] = copy.deepcopy(op["value"])
    return doc


def admission(obj: Any, operation: str = "CREATE", kind: str = "Pod", group: str = "", **extra: Any) -> Obj:
    request = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
        "namespace": "ml",
        "operation": operation,
        "object": obj,
        "oldObject": None,
        **extra,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


# --------------------------------------------------------------------------------------- wrap


def test_wrap_starts_the_command_under_the_init_and_keeps_args() -> None:
    source = pod(TRAIN)
    before = copy.deepcopy(source)
    wrapped = mutate.wrap(source)
    assert source == before, "wrap changed its argument"
    train = containers_by_name(wrapped)["train"]
    assert train["command"] == ["python3", "-I", INIT, "--", "python"]
    # Kubernetes appends args to command: the job's argv is the same as before
    assert train["args"] == TRAIN["args"]
    assert train["command"][4:] + train["args"] == TRAIN["command"] + TRAIN["args"]
    assert {"name": "criuctl-inject", "mountPath": "/.criuctl", "readOnly": True} in train["volumeMounts"]
    injects = [v for v in wrapped["spec"]["volumes"] if v["name"] == mutate.VOLUME]
    assert injects == [{"name": "criuctl-inject", "hostPath": {"path": INJECT_DIR, "type": "Directory"}}]
    assert wrapped["metadata"]["annotations"] == {INJECTED: "true"}
    assert mutate.is_wrapped(train) and not mutate.is_placeholder(wrapped)


INJECT_DIR = str(containers.INJECT_DIR)


def test_the_inject_dir_and_init_paths_are_those_of_the_agent_and_nsinit() -> None:
    assert mutate.INJECT_DIR == INJECT_DIR == "/var/lib/criuctl-inject"
    assert Path(nsinit.__file__).name == Path(INIT).name and Path(INIT).parent == Path(mutate.MOUNT)
    assert mutate.RUN_DIR == nsinit.CONTROL_DIR


def test_a_container_without_command_is_left_alone_and_named() -> None:
    wrapped = mutate.wrap(pod(TRAIN, SIDECAR, initContainers=[INIT_CONTAINER]))
    by_name = containers_by_name(wrapped)
    assert "command" not in by_name["sidecar"]
    assert not any(m["name"] == mutate.VOLUME for m in by_name["sidecar"]["volumeMounts"])
    assert mutate.is_wrapped(by_name["train"])
    reasons = json.loads(wrapped["metadata"]["annotations"][NOT_WRAPPED])
    assert reasons == {"sidecar": mutate.NO_COMMAND}
    assert "entrypoint is not in the pod spec" in reasons["sidecar"]
    assert mutate.not_wrapped(wrapped) == reasons
    # init containers are never touched
    assert wrapped["spec"]["initContainers"] == [INIT_CONTAINER]


def test_a_pod_with_no_command_anywhere_gets_no_volume() -> None:
    wrapped = mutate.wrap(pod(SIDECAR))
    assert [v["name"] for v in wrapped["spec"]["volumes"]] == [TOKEN_VOLUME]
    assert wrapped["metadata"]["annotations"][INJECTED] == "true"
    assert set(mutate.not_wrapped(wrapped)) == {"sidecar"}


def test_the_python_annotation_names_the_interpreter() -> None:
    wrapped = mutate.wrap(pod(TRAIN, annotations={mutate.PYTHON_ANNOTATION: "/opt/conda/bin/python"}))
    assert containers_by_name(wrapped)["train"]["command"][:4] == ["/opt/conda/bin/python", "-I", INIT, "--"]


def test_wrap_is_idempotent() -> None:
    once = mutate.wrap(pod(TRAIN, SIDECAR))
    twice = mutate.wrap(once)
    assert twice == once and twice is not once
    # even without the annotation a wrapped command is not wrapped again
    del once["metadata"]["annotations"][INJECTED]
    again = containers_by_name(mutate.wrap(once))["train"]
    assert again["command"] == ["python3", "-I", INIT, "--", "python"]
    assert sum(m["mountPath"] == mutate.MOUNT for m in again["volumeMounts"]) == 1
    assert sum(v["name"] == mutate.VOLUME for v in mutate.wrap(once)["spec"]["volumes"]) == 1


def test_a_pod_wrapped_by_hand_as_the_docs_show_keeps_its_own_volume() -> None:
    """docs/containers.md names the volume `criuctl`: a second mount at /.criuctl would be refused
    by the API server (duplicate mountPath), so nothing is added but the pod-UID variable."""
    hand = {
        "name": "train",
        "image": "trainer:1",
        "command": ["python3", "-I", INIT, "--"],
        "args": ["python", "train.py"],
        "volumeMounts": [{"name": "criuctl", "mountPath": "/.criuctl", "readOnly": True}],
    }
    volume = {"name": "criuctl", "hostPath": {"path": INJECT_DIR, "type": "Directory"}}
    source = pod(hand, volumes=[volume])
    wrapped = mutate.wrap(source)
    env = wrapped["spec"]["containers"][0].pop("env")
    assert env == [{"name": "CRIUCTL_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    assert wrapped["spec"] == source["spec"]
    assert wrapped["metadata"]["annotations"] == {INJECTED: "true"}


# -------------------------------------------------------------------------------- placeholder


def running(p: Obj) -> Obj:
    """The wrapped pod as `kubectl get -o json` returns it once it runs on node a."""
    p = mutate.wrap(p)
    p["metadata"].update(
        name="train-abc12",
        uid="0c1d2e3f",
        resourceVersion="4711",
        creationTimestamp="2026-01-01T00:00:00Z",
        ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "9"}],
        managedFields=[{"manager": "kube-controller-manager"}],
    )
    spec = p["spec"]
    spec.update(nodeName="node-a", priority=0, preemptionPolicy="PreemptLowerPriority")
    spec["ephemeralContainers"] = [{"name": "debugger", "image": "busybox"}]
    p["status"] = {"phase": "Running", "podIP": "10.0.0.7"}
    return p


PROBE = {"httpGet": {"path": "/", "port": 8080}}
FULL = {
    **TRAIN,
    "livenessProbe": PROBE,
    "readinessProbe": PROBE,
    "startupProbe": PROBE,
    "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
}


def test_placeholder_is_the_source_spec_waiting_on_the_target_node() -> None:
    init = {**INIT_CONTAINER, "volumeMounts": [{"name": OLD_TOKEN_VOLUME, "mountPath": "/var/run/secrets/x"}]}
    old_token = {"name": OLD_TOKEN_VOLUME, "secret": {"secretName": OLD_TOKEN_VOLUME}}
    source = running(pod(FULL, volumes=[{"name": "data", "emptyDir": {}}, old_token], initContainers=[init]))
    before = copy.deepcopy(source)
    ph = mutate.placeholder(source, "node-b", "ml/train-abc12")
    assert source == before, "placeholder changed its argument"

    assert set(ph) == {"apiVersion", "kind", "metadata", "spec"}  # no status
    assert set(ph["metadata"]) == {"namespace", "labels", "annotations"}  # the caller names it
    assert ph["metadata"]["namespace"] == "ml"
    assert ph["metadata"]["labels"] == source["metadata"]["labels"]
    assert ph["metadata"]["annotations"][PLACEHOLDER_FOR] == "ml/train-abc12"
    assert ph["metadata"]["annotations"][INJECTED] == "true"
    assert mutate.is_placeholder(ph)

    spec = ph["spec"]
    assert spec["nodeName"] == "node-b"
    assert spec["serviceAccountName"] == "trainer"
    for gone in ("ephemeralContainers", "priority", "preemptionPolicy"):
        assert gone not in spec, gone
    (train,) = spec["containers"]
    assert train["command"] == ["python3", "-I", INIT, "--placeholder"]
    for gone in ("args", "lifecycle", "livenessProbe", "readinessProbe", "startupProbe"):
        assert gone not in train, gone
    # the job's mounts stay (the restore maps each to the placeholder's), the token mounts go
    assert [m["mountPath"] for m in train["volumeMounts"]] == ["/data", mutate.MOUNT]
    assert [v["name"] for v in spec["volumes"]] == ["data", mutate.VOLUME]
    assert spec["initContainers"] == [{**INIT_CONTAINER, "volumeMounts": []}]
    assert "node-a" not in json.dumps(ph)  # the source's node, in nodeName and nowhere else


def test_placeholder_keeps_a_token_volume_of_another_account() -> None:
    """Only the volume the ServiceAccount plugin adds for this pod's account is dropped; a Secret
    the user mounts whose name happens to contain "-token-" stays."""
    user = {"name": "github-token-x", "secret": {"secretName": "github-token-x"}}
    ph = mutate.placeholder(running(pod(TRAIN, volumes=[user])), "node-b", "ml/train-abc12")
    assert [v["name"] for v in ph["spec"]["volumes"]] == ["github-token-x", mutate.VOLUME]


def test_placeholder_uses_the_wrapped_commands_interpreter() -> None:
    source = running(pod(TRAIN, annotations={mutate.PYTHON_ANNOTATION: "/usr/bin/python3.11"}))
    ph = mutate.placeholder(source, "node-b", "ml/x")
    assert ph["spec"]["containers"][0]["command"] == ["/usr/bin/python3.11", "-I", INIT, "--placeholder"]


def test_placeholder_of_a_read_only_rootfs_gets_a_folder_for_the_inits_fifos() -> None:
    ro = {**TRAIN, "securityContext": {"readOnlyRootFilesystem": True}}
    ph = mutate.placeholder(running(pod(ro)), "node-b", "ml/x")
    (c,) = ph["spec"]["containers"]
    assert {"name": mutate.RUN_VOLUME, "mountPath": nsinit.CONTROL_DIR} in c["volumeMounts"]
    assert {"name": mutate.RUN_VOLUME, "emptyDir": {}} in ph["spec"]["volumes"]
    plain = mutate.placeholder(running(pod(TRAIN)), "node-b", "ml/x")
    assert mutate.RUN_VOLUME not in json.dumps(plain)


def test_a_read_only_rootfs_job_gets_a_folder_for_its_step_boundary() -> None:
    """The hook keeps its control directory in /run/criuctl (nsinit.BOUNDARY_DIR): a read-only
    rootfs gets an emptyDir there, once, in the job's pod and in its placeholder alike."""
    ro = {**TRAIN, "securityContext": {"readOnlyRootFilesystem": True}}
    wrapped = mutate.wrap(pod(ro))
    (c,) = wrapped["spec"]["containers"]
    assert nsinit.BOUNDARY_DIR.startswith(nsinit.CONTROL_DIR + "/")
    assert c["volumeMounts"].count({"name": mutate.RUN_VOLUME, "mountPath": nsinit.CONTROL_DIR}) == 1
    ph = mutate.placeholder(running(wrapped), "node-b", "ml/x")
    (pc,) = ph["spec"]["containers"]
    assert pc["volumeMounts"].count({"name": mutate.RUN_VOLUME, "mountPath": nsinit.CONTROL_DIR}) == 1
    assert [v for v in ph["spec"]["volumes"] if v["name"] == mutate.RUN_VOLUME] == [
        {"name": mutate.RUN_VOLUME, "emptyDir": {}}
    ]
    assert mutate.RUN_VOLUME not in json.dumps(mutate.wrap(pod(TRAIN)))  # a writable rootfs has /run


def test_placeholder_refuses_a_pod_whose_containers_are_not_wrapped() -> None:
    with pytest.raises(
        ValueError, match=r"ml/train-abc12: container\(s\) sidecar do not run under criuctl's init"
    ):
        mutate.placeholder(running(pod(TRAIN, SIDECAR)), "node-b", "ml/train-abc12")
    with pytest.raises(ValueError, match="train"):
        mutate.placeholder(pod(TRAIN), "node-b", "ml/never-wrapped")


def test_a_placeholder_passes_the_webhook_unchanged() -> None:
    ph = mutate.placeholder(running(pod(TRAIN)), "node-b", "ml/x")
    del ph["metadata"]["annotations"][INJECTED]  # even a hand-wrapped source's placeholder
    response = webhook.review(admission(ph))["response"]
    assert response["allowed"] is True and "patch" not in response


# -------------------------------------------------------------------------------------- patch


@pytest.mark.parametrize(
    "source",
    [
        pod(TRAIN),  # annotations absent: add; volumes present: replace
        pod(TRAIN, SIDECAR, annotations={"team": "ml"}),  # annotations replaced
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [TRAIN]}},
        {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [TRAIN]}},  # no metadata at all
    ],
    ids=["no-annotations", "annotations", "no-volumes", "no-metadata"],
)
def test_the_patch_turns_the_pod_into_exactly_the_wrapped_one(source: Obj) -> None:
    wrapped = mutate.wrap(source)
    ops = mutate.patch(source, wrapped)
    assert ops and {op["op"] for op in ops} <= {"add", "replace"}
    assert apply_patch(source, ops) == wrapped


def test_patch_of_equal_pods_is_empty_and_removal_works() -> None:
    p = mutate.wrap(pod(TRAIN))
    assert mutate.patch(p, p) == []
    less = copy.deepcopy(p)
    del less["spec"]["volumes"]
    ops = mutate.patch(p, less)
    assert ops == [{"op": "remove", "path": "/spec/volumes"}]
    assert apply_patch(p, ops) == less


def test_patch_refuses_differences_it_would_lose() -> None:
    p = pod(TRAIN)
    other = copy.deepcopy(p)
    other["spec"]["hostNetwork"] = True
    with pytest.raises(ValueError, match="differ outside"):
        mutate.patch(p, other)


# ------------------------------------------------------------------------------------- review


def decoded_patch(response: Obj) -> list[Obj]:
    assert response["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(response["patch"]))


def test_review_of_a_pod_create_answers_with_the_patch_that_wraps_it() -> None:
    source = pod(TRAIN, SIDECAR)
    review = admission(source)
    answer = webhook.review(review)
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    response = answer["response"]
    assert response["uid"] == review["request"]["uid"]
    assert response["allowed"] is True and "status" not in response
    assert apply_patch(source, decoded_patch(response)) == mutate.wrap(source)


IMAGE = "registry.example/criuctl-agent:0.1.0-g1234567"
RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
HARDENED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _indexed(p: Obj) -> Obj:
    """A JobSet's (a TrainJob's) pod: a stable identity, so the webhook gives it the preStop hook."""
    p["metadata"]["labels"][mutate.JOBSET_LABEL] = "llm"
    p["metadata"]["annotations"] = {mutate.COMPLETION_INDEX: "3"}
    p["spec"].update(hostname="llm-node-0-3", subdomain="llm")
    return p


# the pods a training namespace sees: what a user writes, what Trainer and the operator make
TRAINING_PODS = {
    "plain": pod(TRAIN),
    "sidecar-and-init": pod(TRAIN, SIDECAR, initContainers=[INIT_CONTAINER]),
    "restricted": pod(
        {**TRAIN, "securityContext": HARDENED},
        securityContext=RESTRICTED,
        volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    ),
    "trainjob-node": _indexed(pod({**TRAIN, "ports": [{"containerPort": 29500}]})),
    "named": {**pod(TRAIN), "metadata": {"name": "w0", "namespace": "ml", "labels": {mutate.LABEL: "true"}}},
}


def _wrapped_by_the_webhook(source: Obj, on_host: bool = False) -> Obj:
    opts = webhook.Options(prestop_port=7071, image=IMAGE, prestop_on_host=on_host)
    return apply_patch(source, decoded_patch(webhook.review(admission(source), opts)["response"]))


@pytest.mark.parametrize("name", sorted(TRAINING_PODS))
def test_every_pod_the_webhook_wraps_passes_pod_security_baseline(name: str) -> None:
    """What the webhook patches into a baseline pod keeps it baseline (the PodSecurity plugin's
    checks, tests/podsecurity.py): criuctl's files come from its image by an init container into an
    emptyDir, not by hostPath, and that container is `restricted` itself. From Kubernetes 1.34 the
    level also refuses a `host` in a lifecycle hook: criuctl's preStop hook names none (the agent
    listens in the pod, criuctl.kube.nodeside.PodHooks), so the pod passes at every version; with
    --prestop-on-host (the agent's loopback) it fails there, and only there."""
    source = TRAINING_PODS[name]
    assert podsecurity.baseline(source) == []
    wrapped = _wrapped_by_the_webhook(source)
    assert mutate.is_wrapped(containers_by_name(wrapped)["train"])
    spec = wrapped["spec"]
    inject = spec["initContainers"][0]
    assert inject == mutate.inject_container(IMAGE) and inject["args"] == ["inject", mutate.MOUNT]
    volume = next(v for v in spec["volumes"] if v["name"] == mutate.VOLUME)
    assert "emptyDir" in volume and "hostPath" not in volume
    assert podsecurity.baseline(wrapped, version=(1, 33)) == []
    assert podsecurity.baseline(wrapped) == []
    on_host = _wrapped_by_the_webhook(source, on_host=True)
    assert podsecurity.baseline(on_host, version=(1, 33)) == []
    hooked = [i for i, c in enumerate(on_host["spec"]["containers"]) if mutate.has_prestop(c)]
    assert hooked == [i for i, c in enumerate(spec["containers"]) if mutate.has_prestop(c)]
    hosts = [f"spec.containers[{i}].lifecycle.preStop.httpGet.host" for i in hooked]
    assert podsecurity.baseline(on_host) == hosts
    # criuctl's own init container would pass `restricted` too: non-root, no capability, no escalation
    ctx = inject["securityContext"]
    assert ctx["runAsNonRoot"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}


POD_CTX, CTR, C0 = "spec.securityContext", "spec.containers[0]", {**TRAIN, "name": "c0"}
REFUSED = [
    ({"hostNetwork": True}, "spec.hostNetwork"),
    ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, f"{POD_CTX}.seccompProfile.type"),
    ({"securityContext": {"sysctls": [{"name": "kernel.msgmax"}]}}, f"{POD_CTX}.sysctls[0].name"),
    ({"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}, f"{POD_CTX}.seLinuxOptions.type"),
    ({"containers": [{**C0, "securityContext": {"privileged": True}}]}, f"{CTR}.securityContext.privileged"),
    (
        {"containers": [{**C0, "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
        f"{CTR}.securityContext.capabilities.add",
    ),
    ({"containers": [{**C0, "ports": [{"containerPort": 80, "hostPort": 80}]}]}, f"{CTR}.ports[0].hostPort"),
]


@pytest.mark.parametrize(("change", "field"), REFUSED)
def test_the_baseline_stand_in_refuses_what_the_plugin_refuses(change: Obj, field: str) -> None:
    """Each check of tests/podsecurity.py fails the field the real plugin names (check_*.go)."""
    bad = copy.deepcopy(pod(TRAIN))
    bad["spec"].update(copy.deepcopy(change))
    assert podsecurity.baseline(bad) == [field]


def test_without_an_image_the_files_come_by_hostpath_which_baseline_refuses() -> None:
    """The check is not vacuous: the node's copy by hostPath (a webhook told no image) fails it."""
    wrapped = mutate.wrap(pod(TRAIN))
    index = next(i for i, v in enumerate(wrapped["spec"]["volumes"]) if v["name"] == mutate.VOLUME)
    assert podsecurity.baseline(wrapped, version=(1, 25)) == [f"spec.volumes[{index}].hostPath"]
    assert "initContainers" not in wrapped["spec"]


def test_the_placeholder_of_a_wrapped_pod_fills_its_own_emptydir_first() -> None:
    """On the target, the placeholder runs the same init container before it waits for the
    restore, so the restored job finds criuctl's files at the same path in its new pod."""
    wrapped = _wrapped_by_the_webhook(pod(TRAIN, initContainers=[INIT_CONTAINER]))
    held = mutate.placeholder(running(wrapped), "node-b", "ml/train-x")
    names = [c["name"] for c in held["spec"]["initContainers"]]
    assert names == [mutate.INJECT_CONTAINER, INIT_CONTAINER["name"]]
    assert podsecurity.baseline(held) == []  # the placeholder has no preStop hook


def test_the_inject_verb_writes_what_the_init_container_mounts(tmp_path: Path) -> None:
    """`criuctl inject DIR`, the init container's command: the init and the hook, readable by any
    user of the job's container (the init container runs as an unprivileged user of its own)."""
    dest = tmp_path / "inject"
    dest.mkdir()
    r = subprocess.run([*CRIUCTL, "inject", str(dest)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (dest / nsinit.INJECT_NAME).read_bytes() == Path(nsinit.__file__).read_bytes()
    assert (dest / "hooks").is_dir() and any((dest / "hooks").rglob("*.py"))
    assert all(p.stat().st_mode & 0o004 for p in dest.rglob("*"))


@pytest.mark.parametrize(
    "review",
    [
        admission(pod(TRAIN), operation="UPDATE"),
        admission(None, operation="DELETE"),  # a DELETE carries no object
        admission({"kind": "Deployment"}, kind="Deployment", group="apps"),
        admission({"kind": "EphemeralContainers"}, operation="UPDATE", subResource="ephemeralcontainers"),
        admission(mutate.wrap(pod(TRAIN))),  # already injected (it matched both webhooks)
        admission(mutate.placeholder(running(pod(TRAIN)), "node-b", "ml/x")),
    ],
    ids=["update", "delete", "not-a-pod", "subresource", "injected", "placeholder"],
)
def test_review_allows_what_it_does_not_mutate_unchanged(review: Obj) -> None:
    response = webhook.review(review)["response"]
    assert response == {"uid": review["request"]["uid"], "allowed": True}


@pytest.mark.parametrize(
    ("body", "uid", "says"),
    [
        (None, "", "not a JSON object"),
        (
            {**admission(pod(TRAIN)), "apiVersion": "admission.k8s.io/v1beta1"},
            "",
            "not an admission.k8s.io/v1",
        ),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "", "no request with a uid"),
        (admission(None), "705ab4f5-6393-11e8-b7cc-42010a800002", "has no object"),
        (admission({"spec": {"containers": "train"}}), "705ab4f5-6393-11e8-b7cc-42010a800002", "can read"),
    ],
    ids=["not-json-object", "v1beta1", "no-request", "create-without-object", "containers-not-a-list"],
)
def test_review_refuses_a_malformed_request_and_says_why(body: Any, uid: str, says: str) -> None:
    response = webhook.review(body)["response"]
    assert response["uid"] == uid
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 400
    assert says in response["status"]["message"]


# ------------------------------------------------------------------ the HTTPS server, for real


def make_certs(out: Path) -> Path:
    """A CA and the webhook's serving certificate, as scripts/webhook-cert.sh makes them."""
    subprocess.run(["bash", str(CERT_SCRIPT), "--print-only", str(out)], check=True, timeout=30)
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("webhook-tls"))


def manifest() -> dict[str, Obj]:
    return {o["kind"]: o for o in yaml.safe_load_all(MANIFEST.read_text()) if o}


def service_name() -> str:
    """The name the API server verifies the webhook's certificate against: SERVICE.NAMESPACE.svc."""
    (hook, *_) = manifest()["MutatingWebhookConfiguration"]["webhooks"]
    svc = hook["clientConfig"]["service"]
    return f"{svc['name']}.{svc['namespace']}.svc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def listening(argv: list[str], port: int, log: Path) -> Iterator[None]:
    """The webhook started by `argv` (a child process, stderr to `log`), once it listens on `port`."""
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stderr=err, cwd=ROOT)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, f"the webhook exited: {log.read_text()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the webhook did not listen: {log.read_text()}"
                time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a thread stuck in a call: never leave it running
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(certs: Path, tmp_path_factory: pytest.TempPathFactory):
    """`serve()` itself in a child process (it blocks, and sets up logging and signals like the CLI)."""
    port = free_port()
    log = tmp_path_factory.mktemp("webhook-log") / "stderr"
    code = "import sys; from criuctl.kube.webhook import serve; serve(*sys.argv[1:])"
    args = [f"127.0.0.1:{port}", str(certs / "tls.crt"), str(certs / "tls.key")]
    with listening([sys.executable, "-c", code, *args], port, log):
        yield port, log


def client_context(ca: Path) -> ssl.SSLContext:
    """As the API server verifies a webhook: against the caBundle, by the Service's DNS name."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


async def call(port: int, ctx: ssl.SSLContext, hostname: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        if body is None:
            async with session.get(
                f"https://127.0.0.1:{port}/healthz", ssl=ctx, server_hostname=hostname
            ) as r:
                return r.status, await r.text()
        async with session.post(
            f"https://127.0.0.1:{port}/mutate", json=body, ssl=ctx, server_hostname=hostname
        ) as r:
            return r.status, await r.json()


def test_the_server_answers_an_admission_review_over_verified_https(certs: Path, server) -> None:
    port, log = server
    ctx, name = client_context(certs / "ca.crt"), service_name()
    assert asyncio.run(call(port, ctx, name)) == (200, "ok\n")
    source = pod(TRAIN, SIDECAR)
    status, answer = asyncio.run(call(port, ctx, name, admission(source)))
    assert status == 200
    assert answer["response"]["allowed"] is True
    assert apply_patch(source, decoded_patch(answer["response"])) == mutate.wrap(source)
    # one line per admission: the pod (generateName before it has a name) and what was done
    deadline = time.monotonic() + 5
    while "ml/train-: mutated" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in log.read_text().splitlines() if "ml/train-" in line]
    assert len(lines) == 1 and "wrapped: train; not wrapped: sidecar" in lines[0], log.read_text()


def test_the_servers_certificate_fails_against_another_ca_or_name(
    certs: Path, server, tmp_path: Path
) -> None:
    port, _ = server
    other = tmp_path / "other"
    subprocess.run(["bash", str(CERT_SCRIPT), "--print-only", str(other)], check=True, timeout=30)
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(call(port, client_context(other / "ca.crt"), service_name()))
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(call(port, client_context(certs / "ca.crt"), "criuctl-webhook.elsewhere.svc"))


def test_a_body_that_is_not_json_is_refused_in_a_review(certs: Path, server) -> None:
    port, _ = server

    async def post_garbage() -> tuple[int, Obj]:
        async with aiohttp.ClientSession() as session:
            ctx = client_context(certs / "ca.crt")
            async with session.post(
                f"https://127.0.0.1:{port}/mutate", data=b"{not json", ssl=ctx, server_hostname=service_name()
            ) as r:
                return r.status, await r.json()

    status, answer = asyncio.run(post_garbage())
    assert status == 200 and answer["response"]["allowed"] is False


def test_serve_refuses_bad_options_in_one_line(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(preflight.BadOption, match="not HOST:PORT"):
        webhook.serve("8443", str(certs / "tls.crt"), str(certs / "tls.key"))
    with pytest.raises(preflight.BadOption, match="cannot read --tls-key"):
        webhook.serve("127.0.0.1:18443", str(certs / "tls.crt"), str(tmp_path / "missing.key"))
    with pytest.raises(preflight.BadOption, match="not a PEM certificate and its key"):
        webhook.serve("127.0.0.1:18443", str(certs / "tls.crt"), str(certs / "ca.crt"))


# ------------------------------------------------------------ webhook-cert.sh against a cluster

FAKE_KUBECTL = r"""#!/usr/bin/env bash
# records every call; answers the few reads webhook-cert.sh makes
echo "$*" >>"$FAKE_LOG"
case "$*" in
  "get mutatingwebhookconfiguration criuctl "*) printf 'pods.criuctl.io\nnamespaces.criuctl.io\n' ;;
  *" get secret criuctl-webhook-tls "*) printf '%s' "$FAKE_OLD_CA" ;;
  "patch "*) printf '%s' "${@: -1}" >"$FAKE_PATCH" ;;
  "apply -f "*) cp "$3" "$FAKE_APPLIED" ;;
esac
"""


def test_the_cert_script_trusts_old_and_new_ca_then_applies_and_restarts(certs: Path, tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    fake.write_text(FAKE_KUBECTL)
    fake.chmod(0o755)
    old_ca = (certs / "ca.crt").read_text()
    env = {
        **os.environ,
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "calls"),
        "FAKE_OLD_CA": base64.b64encode(old_ca.encode()).decode(),
        "FAKE_PATCH": str(tmp_path / "patch.json"),
        "FAKE_APPLIED": str(tmp_path / "secret.yaml"),
    }
    subprocess.run(["bash", str(CERT_SCRIPT)], check=True, timeout=60, env=env, capture_output=True)

    calls = (tmp_path / "calls").read_text().splitlines()
    verbs = [c.split()[0] if not c.startswith("-n") else c.split()[2] for c in calls]
    assert verbs.index("patch") < verbs.index("apply") < verbs.index("rollout"), calls
    assert any(c.endswith("rollout restart deployment criuctl-webhook") for c in calls), calls

    secret = yaml.safe_load((tmp_path / "secret.yaml").read_text())
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == (
        "criuctl-webhook-tls",
        "criuctl-system",
    )
    assert secret["type"] == "kubernetes.io/tls"
    new_ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
    assert new_ca != old_ca

    ops = json.loads((tmp_path / "patch.json").read_text())
    assert [op["path"] for op in ops] == [f"/webhooks/{i}/clientConfig/caBundle" for i in (0, 1)]
    assert {op["op"] for op in ops} == {"add"}
    bundle = base64.b64decode(ops[0]["value"]).decode()
    assert bundle.strip() == (new_ca + old_ca).strip()
    # the Secret's certificate verifies against the new CA by the Service's name
    ctx = ssl.create_default_context(cadata=bundle)
    crt = tmp_path / "tls.crt"
    crt.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    out = subprocess.run(
        ["openssl", "verify", "-CAfile", "/dev/stdin", "-verify_hostname", service_name(), str(crt)],
        input=new_ca,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert ctx.cert_store_stats()["x509_ca"] == 2


# ------------------------------------------------------------------------------- the manifest


def test_the_manifest_agrees_with_the_code_and_the_script(certs: Path) -> None:
    objs = manifest()
    hooks = {h["name"]: h for h in objs["MutatingWebhookConfiguration"]["webhooks"]}
    assert set(hooks) == {
        "pods.criuctl.io",
        "namespaces.criuctl.io",
        "evictions.criuctl.io",
        "records.criuctl.io",
    }
    evict = hooks.pop("evictions.criuctl.io")  # tests/test_manifests.py: the pods it may patch
    assert evict["clientConfig"]["service"]["path"] == "/evict" and evict["failurePolicy"] == "Ignore"
    # every write of a move record is judged, and none goes unjudged (Fail); only criuctl's namespace
    records = hooks.pop("records.criuctl.io")
    assert records["clientConfig"]["service"]["path"] == "/records" and records["failurePolicy"] == "Fail"
    assert records["sideEffects"] == "None"
    (rule,) = records["rules"]
    assert rule["resources"] == ["configmaps"] and rule["operations"] == ["CREATE", "UPDATE", "DELETE"]
    assert records["objectSelector"]["matchExpressions"] == [{"key": moves.LABEL, "operator": "Exists"}]
    assert records["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [moves.SYSTEM_NS]}
    ]
    svc = objs["Service"]
    # a pod labelled itself must not be admitted unwrapped; a namespace's every pod must not be blocked
    assert hooks["pods.criuctl.io"]["failurePolicy"] == "Fail"
    assert hooks["namespaces.criuctl.io"]["failurePolicy"] == "Ignore"
    for h in hooks.values():
        assert h["sideEffects"] == "None"
        assert h["admissionReviewVersions"] == ["v1"] and "caBundle" not in h["clientConfig"]
        assert h["clientConfig"]["service"] == {
            "namespace": svc["metadata"]["namespace"],
            "name": svc["metadata"]["name"],
            "path": "/mutate",
            "port": svc["spec"]["ports"][0]["port"],
        }
        assert h["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        excluded = next(
            e for e in h["namespaceSelector"]["matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"
        )
        assert (excluded["operator"], set(excluded["values"])) == ("NotIn", {"kube-system", "criuctl-system"})
    assert hooks["pods.criuctl.io"]["objectSelector"]["matchExpressions"] == [
        {"key": mutate.LABEL, "operator": "In", "values": ["true"]}
    ]
    assert hooks["namespaces.criuctl.io"]["objectSelector"]["matchExpressions"] == [
        {"key": mutate.LABEL, "operator": "NotIn", "values": ["false"]}
    ]
    assert {"key": mutate.LABEL, "operator": "In", "values": ["true"]} in hooks["namespaces.criuctl.io"][
        "namespaceSelector"
    ]["matchExpressions"]

    # the Deployment serves on the Service's target port, from the Secret the script writes
    pod_spec = objs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod_spec["containers"]
    args = dict(zip(c["args"][1::2], c["args"][2::2], strict=True))
    assert c["args"][0] == "webhook"
    (port,) = c["ports"]
    assert preflight.parse_listen(args["--listen"])[1] == port["containerPort"]
    assert svc["spec"]["ports"][0]["targetPort"] == port["name"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"], "scheme": "HTTPS"}
    secret = yaml.safe_load((certs / "secret.yaml").read_text())
    (mount,) = c["volumeMounts"]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["metadata"]["namespace"] == objs["Deployment"]["metadata"]["namespace"]
    for flag, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):
        assert args[flag] == f"{mount['mountPath']}/{key}" and key in secret["data"]
    # no privilege: the pod runs as a non-root number that fsGroup lets read the key
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert (
        pod_spec["securityContext"]["runAsNonRoot"] is True and pod_spec["securityContext"]["runAsUser"] > 0
    )
    assert volume["secret"]["defaultMode"] & 0o040 and pod_spec["securityContext"]["fsGroup"] > 0


# ------------------------------------------------------------------ preStop and successors


def named(p: Obj, name: str = "st-0") -> Obj:
    p = copy.deepcopy(p)
    del p["metadata"]["generateName"]
    p["metadata"]["name"] = name
    return p


def test_a_named_pod_gets_the_prestop_hook_and_time_for_it() -> None:
    new = mutate.wrap(named(pod(TRAIN, terminationGracePeriodSeconds=30)), prestop_port=7071)
    train = containers_by_name(new)["train"]
    get = train["lifecycle"]["preStop"]["httpGet"]
    # no host: the kubelet calls the pod's IP, where the agent listens (nodeside.PodHooks)
    assert get == {"port": 7071, "path": "/v1/prestop/ml/st-0"}
    on_host = mutate.wrap(named(pod(TRAIN)), prestop_port=7071, prestop_on_host=True)
    assert containers_by_name(on_host)["train"]["lifecycle"]["preStop"]["httpGet"]["host"] == "127.0.0.1"
    assert mutate.has_prestop(train)
    assert new["spec"]["terminationGracePeriodSeconds"] == mutate.PRESTOP_GRACE
    longer = mutate.wrap(named(pod(TRAIN, terminationGracePeriodSeconds=900)), prestop_port=7071)
    assert longer["spec"]["terminationGracePeriodSeconds"] == 900, "a longer grace period is the user's"


def test_a_move_waits_for_the_agents_listener_in_the_container_that_runs_now() -> None:
    """A delete before the agent's listener is in the pod would end the job, not move it: the
    move reads the agent's word on the pod (mutate.LISTENER) for the running container's ID. An
    earlier container's word is no word; a port the pod's own process holds is a lasting no; a
    hook at the agent's loopback, or a pod in the node's network, needs no listener in the pod."""
    new = mutate.wrap(named(pod(TRAIN)), prestop_port=7071)
    new["status"] = {"containerStatuses": [{"name": "train", "containerID": "containerd://c2", "state": {}}]}

    def said(value: str | None, p: Obj = new) -> Obj:
        p = copy.deepcopy(p)
        if value is not None:
            p["metadata"].setdefault("annotations", {})[mutate.LISTENER] = value
        return p

    why, lasting = mutate.unheard(said(None), "train") or ("", True)
    assert "has not yet made its preStop listener in the pod (port 7071)" in why and not lasting
    assert mutate.unheard(said("c1"), "train") == (why, False), "the container before it"
    assert mutate.unheard(said("c2"), "train") is None
    taken = mutate.unheard(said(mutate.TAKEN + "c2"), "train")
    assert taken is not None and "a process of the pod listens on port 7071" in taken[0] and taken[1]
    on_host = mutate.wrap(named(pod(TRAIN)), prestop_port=7071, prestop_on_host=True)
    assert mutate.unheard({**on_host, "status": new["status"]}, "train") is None
    in_node_net = said(None, {**new, "spec": {**new["spec"], "hostNetwork": True}})
    assert mutate.unheard(in_node_net, "train") is None
    bare = mutate.wrap(pod(TRAIN), prestop_port=7071)  # a generated name: no hook
    assert (mutate.unheard(bare, "train") or ("", False))[1], "nothing to wait for: refused at once"


def test_no_prestop_for_a_generated_name_or_a_users_own_hook() -> None:
    generated = mutate.wrap(pod(TRAIN), prestop_port=7071)  # its successor gets another name
    assert "lifecycle" not in containers_by_name(generated)["train"]
    own = {**TRAIN, "lifecycle": {"preStop": {"exec": {"command": ["flush"]}}}}
    kept = containers_by_name(mutate.wrap(named(pod(own)), prestop_port=7071))["train"]
    assert kept["lifecycle"] == own["lifecycle"] and not mutate.has_prestop(kept)


def test_a_successor_is_pinned_where_the_bundle_is_and_keeps_its_identity() -> None:
    src = named(
        pod(
            TRAIN,
            nodeSelector={"kubernetes.io/hostname": "a"},
            affinity={"nodeAffinity": {"x": 1}, "podAntiAffinity": {"y": 2}},
        )
    )
    src["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "name": "st", "controller": True}]
    wrapped = mutate.wrap(src, prestop_port=7071)
    new = mutate.successor(wrapped, "b", "ml/st-0@a")
    assert new["spec"]["nodeName"] == "b" and "nodeSelector" not in new["spec"]
    assert new["spec"]["affinity"] == {"podAntiAffinity": {"y": 2}}
    assert (
        new["metadata"]["name"] == "st-0"
        and new["metadata"]["ownerReferences"] == src["metadata"]["ownerReferences"]
    )
    assert mutate.is_placeholder(new)
    train = containers_by_name(new)["train"]
    assert train["command"][-1] == "--placeholder" and "args" not in train
    assert mutate.has_prestop(train), "once the job runs in it, a delete must checkpoint it again"
    assert apply_patch(src, mutate.patch(src, new)) == new


def test_the_webhook_turns_a_pending_moves_pod_into_its_placeholder() -> None:
    from criuctl.kube import moves, webhook

    m = moves.Move(
        "ml", "st-0", "uid-1", "a", "train", moves.Phase.KEPT, target="b", holder="b", bundle="0" * 32
    )
    opts = webhook.Options(
        prestop_port=7071, pending=lambda ns, name: m if (ns, name) == ("ml", "st-0") else None
    )
    src = named(pod(TRAIN))
    out = webhook.review(admission(src), opts)["response"]
    new = apply_patch(src, json.loads(base64.b64decode(out["patch"])))
    assert new["spec"]["nodeName"] == "b" and mutate.is_placeholder(new)
    m.phase = moves.Phase.FAILED  # a failed move's pod is an ordinary pod again
    plain = apply_patch(
        src, json.loads(base64.b64decode(webhook.review(admission(src), opts)["response"]["patch"]))
    )
    assert "nodeName" not in plain["spec"] and not mutate.is_placeholder(plain)


def test_a_move_record_name_is_unambiguous_and_fits() -> None:
    from criuctl.kube import moves

    assert moves.record_name("ml", "st-0") == "move.ml.st-0"
    long = moves.record_name("n" * 63, "p" * 253)
    assert len(long) <= 253 and long.startswith("move.")


def jobset_pod(index: int = 1) -> Obj:
    """A TrainJob's pod as its Indexed Job creates it: no name yet (generateName), its completion
    index's hostname under the JobSet's subdomain."""
    p = pod(TRAIN, hostname=f"trn-node-0-{index}", subdomain="trn")
    p["metadata"]["generateName"] = f"trn-node-0-{index}-"
    p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] = "trn"
    p["metadata"]["ownerReferences"] = [{"kind": "Job", "name": "trn-node-0", "controller": True}]
    return p


def test_a_jobset_pod_is_known_by_its_dns_name_not_its_random_one() -> None:
    """Its successor gets a new random name but the same hostname and subdomain: that is what its
    preStop hook, its move record and the webhook's lookup are keyed by."""
    from criuctl.kube import moves, webhook

    p = jobset_pod()
    assert mutate.identity(p) == "trn-node-0-1.trn" and mutate.indexed(p)
    assert mutate.identity(named(pod(TRAIN))) == "st-0", "any other pod: its name"
    no_subdomain = copy.deepcopy(p)
    del no_subdomain["spec"]["subdomain"]
    assert not mutate.indexed(no_subdomain) and mutate.identity(no_subdomain) == ""
    hook = containers_by_name(mutate.wrap(p, prestop_port=7071))["train"]["lifecycle"]["preStop"]
    assert hook["httpGet"]["path"].endswith("/ml/trn-node-0-1.trn")
    assert "lifecycle" not in containers_by_name(mutate.wrap(no_subdomain, prestop_port=7071))["train"]

    m = moves.Move("ml", "trn-node-0-1.trn", "u", "a", "train", moves.Phase.KEPT, target="b", holder="b")
    asked: list[tuple[str, str]] = []
    opts = webhook.Options(prestop_port=7071, pending=lambda ns, n: asked.append((ns, n)) or m)
    out = webhook.review(admission(p), opts)["response"]
    new = apply_patch(p, json.loads(base64.b64decode(out["patch"])))
    assert asked == [("ml", "trn-node-0-1.trn")]
    assert new["spec"]["nodeName"] == "b" and mutate.is_placeholder(new)
    assert new["spec"]["hostname"] == "trn-node-0-1" and new["spec"]["subdomain"] == "trn"


def test_a_leaving_predecessor_holds_its_successor_only_within_its_grace_period() -> None:
    """A pod on a dead node stays Terminating past its grace period: it holds nothing then."""
    from criuctl.kube import webhook

    now = 1_800_000_000.0
    stamp = datetime.datetime.fromtimestamp(now + 30, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert webhook._in_grace(stamp, now) and webhook._in_grace(stamp, now + 30 + webhook.GRACE_MARGIN - 1)
    assert not webhook._in_grace(stamp, now + 30 + webhook.GRACE_MARGIN + 1)
    assert not webhook._in_grace(None, now)


def test_a_jobset_pods_successor_waits_while_its_predecessors_move_is_undecided() -> None:
    """A recent Job controller replaces a deleted pod at once (TerminatingOrFailed), before the
    predecessor's preStop has recorded its dump: the new pod is refused (its controller retries)
    while a predecessor of its index is leaving and no record says `dumping`, or one only says
    `requested`, or one of a failed or earlier move; a record `dumping` makes it the placeholder;
    with no predecessor leaving (gone, or past its grace period) it is admitted as any pod. A pod
    known by its name (not a JobSet's) is never held: its successor cannot exist beside it."""
    from criuctl.kube import moves, webhook

    p = jobset_pod()
    leaving = "trn-node-0-1-x1y2z"
    asked: list[tuple[str, str]] = []

    def opts(move: moves.Move | None, gone: str | None) -> webhook.Options:
        return webhook.Options(
            prestop_port=7071,
            pending=lambda ns, n: move,
            leaving=lambda ns, n, sel: asked.append((ns, n, sel)) or gone,
        )

    def move(phase: moves.Phase) -> moves.Move:
        return moves.Move("ml", "trn-node-0-1.trn", "u", "a", "train", phase, target="b")

    for m in (None, move(moves.Phase.REQUESTED)):
        out = webhook.review(admission(p), opts(m, leaving))["response"]
        assert out["allowed"] is False and leaving in out["status"]["message"], out
    assert asked[-1] == ("ml", "trn-node-0-1.trn", "jobset.sigs.k8s.io/jobset-name=trn")
    indexed = copy.deepcopy(p)
    indexed["metadata"]["labels"].update({"jobset.sigs.k8s.io/job-index": "0", mutate.INDEX_LABELS[-1]: "1"})
    webhook.review(admission(indexed), opts(None, leaving))
    assert asked[-1][2] == (
        "jobset.sigs.k8s.io/jobset-name=trn,jobset.sigs.k8s.io/job-index=0,batch.kubernetes.io/job-completion-index=1"
    )
    out = webhook.review(admission(p), opts(move(moves.Phase.DUMPING), leaving))["response"]
    assert out["allowed"] and mutate.is_placeholder(
        apply_patch(p, json.loads(base64.b64decode(out["patch"])))
    )
    # a failed checkpoint (the job runs on in the predecessor until it ends), or a stale record of
    # an earlier pod: held all the same while the predecessor is leaving
    for m in (move(moves.Phase.FAILED), move(moves.Phase.PULLING)):
        out = webhook.review(admission(p), opts(m, leaving))["response"]
        assert out["allowed"] is False, out
    for m, gone in ((move(moves.Phase.FAILED), None), (None, None)):
        out = webhook.review(admission(p), opts(m, gone))["response"]
        new = apply_patch(p, json.loads(base64.b64decode(out["patch"])))
        assert (
            out["allowed"]
            and not mutate.is_placeholder(new)
            and "lifecycle" in containers_by_name(new)["train"]
        )
    asked.clear()
    out = webhook.review(admission(named(pod(TRAIN))), opts(None, leaving))["response"]
    assert out["allowed"] and asked == []
