"""The Kubernetes manifests (manifests/): schema-valid, in kubernetes-validate's strict mode, for
Kubernetes 1.30 and for the newest schema the installed kubernetes-validate ships; and shaped the
way the agent needs them (host PID namespace, privileged, probes on the route that needs no token,
the port, files and env the agent reads, least-privilege RBAC; no bundle key shared through a
Secret). Also $CRIUCTL_BUNDLE_KEY, the file a node's own signing key may live in instead.

Offline: no cluster. With `kubectl` on PATH the kustomization is rendered and the rendered objects
are what is checked; without it, the files one by one.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from criuctl.agent import preflight
from criuctl.cli import main
from criuctl.container import containers, runtime
from criuctl.core import statedir
from criuctl.core.env import BUNDLE_KEY, STATE_DIR
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle
from criuctl.kube import identity, signer
from tests.conftest import parse_python
from tests.requirements import needs, require

try:
    import kubernetes_validate
    import yaml
except ImportError:  # a bare pytest without the dev extras: the tests needing them say so
    kubernetes_validate = None
    yaml = None

needs_validate = needs("kubernetes-validate")

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
OLDEST = "1.30.0"  # the oldest Kubernetes schema kubernetes-validate checks them against
KUBECTL = shutil.which("kubectl")

Obj = dict[str, Any]


def newest_schema() -> str:
    """The newest Kubernetes version whose strict schemas the installed kubernetes-validate ships,
    from the names of its bundled schema folders (`v1.37.0-local-strict`)."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    found = [
        m.group(1)
        for entry in folder.iterdir()
        if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", entry.name)) and entry.is_dir()
    ]
    assert found, f"no strict schemas in {folder}"
    return max(found, key=lambda v: tuple(int(p) for p in v.split(".")))


def versions() -> list[str]:
    if kubernetes_validate is None:
        return [OLDEST]
    return sorted({OLDEST, newest_schema()}, key=lambda v: tuple(int(p) for p in v.split(".")))


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def load_file(path: Path) -> list[Obj]:
    return [o for o in yaml.safe_load_all(path.read_text()) if o]


def render(root: Path) -> list[Obj]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(root)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {root} failed:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def validate(obj: Obj, version: str) -> None:
    """Strict validation, failing (not warning, as the CLI does) on a kind without a schema."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} against {version}"
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{where}: {path}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{where}: {e.message}")


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    """What `kubectl apply -k manifests/` would send; the files' objects without kubectl."""
    require("kubernetes-validate")
    if KUBECTL:
        return render(MANIFESTS)
    return [o for p in manifest_files() for o in load_file(p)]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def agent_container(objs: list[Obj]) -> Obj:
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "agent")


def expanded_args(c: Obj) -> list[str]:
    """The container's args as the kubelet runs them: $(VAR) replaced from literal env values."""
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update({e["name"]: f"<{e['name']}>" for e in c.get("env", []) if "valueFrom" in e})
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in c["args"]]


def agent_options(objs: list[Obj]) -> Any:
    """The DaemonSet's command line, parsed by criuctl's own parser (an unknown flag fails here)."""
    return main.parser().parse_args(expanded_args(agent_container(objs)))


def default_port() -> int:
    """The agent's port when --listen is not given, from the CLI itself."""
    return preflight.parse_listen(main.parser().parse_args(["agent", "--token-file", "t"]).listen)[1]


def secret_file(objs: list[Obj], path: str) -> tuple[Obj, str, Obj]:
    """The Secret volume, and the key in it, that provides `path` inside the agent container."""
    c = agent_container(objs)
    vols = {v["name"]: v for v in one(objs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    for m in c["volumeMounts"]:
        rel = (
            PurePosixPath(path).relative_to(m["mountPath"]) if path.startswith(m["mountPath"] + "/") else None
        )
        if rel is not None and "secret" in vols[m["name"]]:
            sv = vols[m["name"]]["secret"]
            return one(objs, "Secret", sv["secretName"]), str(rel), sv
    pytest.fail(f"{path} is not in a Secret volume of the agent container")


def secret_value(secret: Obj, key: str) -> str:
    if key in secret.get("stringData", {}):
        return secret["stringData"][key]
    assert key in secret.get("data", {}), f"Secret {secret['metadata']['name']} has no {key!r}"
    return base64.b64decode(secret["data"][key]).decode()


def host_mounts(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(mountPath, volumeMount, hostPath volume) for each hostPath the agent mounts."""
    vols = {v["name"]: v for v in one(objs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    for m in agent_container(objs)["volumeMounts"]:
        if "hostPath" in vols[m["name"]]:
            yield m["mountPath"], m, vols[m["name"]]["hostPath"]


# ------------------------------------------------------------------------------------- schemas


@needs_validate
def test_the_kustomization_lists_every_manifest() -> None:
    """Without kubectl the files are validated one by one: none may be missing from what
    `kubectl apply -k` applies, nor listed there and missing."""
    listed = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in manifest_files()]


@needs_validate
def test_the_newest_schema_is_found_in_the_package() -> None:
    assert newest_schema() == kubernetes_validate.latest_version()
    assert (
        resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{OLDEST}-local-strict"
    ).is_dir()


@needs_validate
@pytest.mark.parametrize("version", versions())
def test_every_manifest_file_validates_strictly(version: str) -> None:
    for path in manifest_files():
        objs = load_file(path)
        assert objs, f"{path.name} holds no object"
        for obj in objs:
            validate(obj, version)


@needs_validate
@pytest.mark.parametrize("version", versions())
def test_what_kubectl_apply_k_sends_validates_strictly(objects: list[Obj], version: str) -> None:
    kinds = sorted(o["kind"] for o in objects)
    expected = ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    expected += ["Secret"]  # criuctl-agent-tls: the agents' CA certificate (no token Secret: none is shared)
    expected += ["Secret"]  # criuctl-ca: the agents' CA, mounted by the signer alone
    expected += ["Role", "RoleBinding"]  # the agent's, in criuctl-system: move records, its Secrets
    expected += ["DaemonSet", "Deployment", "Service", "MutatingWebhookConfiguration"]  # agent, webhook
    expected += ["ServiceAccount", "Role", "RoleBinding"]  # the webhook's: reads move records
    expected += [
        "ClusterRole",
        "ClusterRoleBinding",
    ]  # the webhook's: lists pods (a JobSet pod's predecessor)
    expected += ["CustomResourceDefinition"]  # PodMigration
    expected += ["Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    expected += ["ClusterRole"]  # criuctl-migrator, for users
    # the signer's (holds the CA key, signs the agents' and the controller's certificates)
    expected += ["Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    assert kinds == sorted(expected)
    for obj in objects:
        validate(obj, version)


@needs_validate
@pytest.mark.parametrize("version", versions())
def test_the_command_line_validator_passes_without_warnings(version: str) -> None:
    """`kubernetes-validate --strict -k VERSION` as manifests/README.md says, warnings included
    (the CLI only warns about a kind it has no schema for)."""
    out = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *map(str, manifest_files())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "WARN" not in out.stdout + out.stderr, out.stdout + out.stderr


@needs_validate
@pytest.mark.parametrize("version", versions())
def test_strict_validation_rejects_a_field_kubernetes_does_not_have(objects: list[Obj], version: str) -> None:
    """The check above is not vacuous: a misplaced field (privileged on the container, not in its
    securityContext) fails it."""
    import copy

    bad = copy.deepcopy(one(objects, "DaemonSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["privileged"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


# --------------------------------------------------------------------------------- the DaemonSet


def test_the_daemonset_runs_privileged_in_the_hosts_pid_namespace_and_network(objects: list[Obj]) -> None:
    ds = one(objects, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert agent_container(objects)["securityContext"]["privileged"] is True
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount", "criuctl-agent")["metadata"]["name"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_the_agent_listens_on_its_default_port_and_the_pod_declares_it(objects: list[Obj]) -> None:
    port = default_port()
    assert port == 7070
    a = agent_options(objects)
    assert a.verb == "agent" and preflight.parse_listen(a.listen) == ("0.0.0.0", port)
    (p,) = agent_container(objects)["ports"]
    assert p["containerPort"] == p["hostPort"] == port


def test_both_probes_ask_healthz_the_way_the_agent_serves_it(objects: list[Obj]) -> None:
    """With a certificate (--tls-cert, or --tls-from-cluster) the agent serves HTTPS only, so the
    probes use HTTPS (the kubelet does not verify a probe's certificate)."""
    c = agent_container(objects)
    a = agent_options(objects)
    scheme = "HTTPS" if a.tls_cert or a.tls_from_cluster else "HTTP"
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == ("/healthz", default_port(), scheme), probe


def test_healthz_answers_without_a_token_and_nothing_else_does(tmp_path: Path, state_dir: Path) -> None:
    """What lets a probe, which sends no token, use /healthz: the agent's one unauthenticated route."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from criuctl.agent.server import Agent, AgentOptions

    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    agent = Agent(AgentOptions("127.0.0.1", 0, token, name="probe"))

    async def go() -> tuple[int, int]:
        async with TestClient(TestServer(agent.app())) as client:
            health = await client.get("/healthz")
            info = await client.get("/v1/info")
            return health.status, info.status

    assert asyncio.run(go()) == (200, 401)


def test_requests_and_a_memory_limit_are_set(objects: list[Obj]) -> None:
    res = agent_container(objects)["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert "memory" in res["limits"]


def test_the_agent_takes_certificates_of_the_ca_from_the_secret_and_no_token(objects: list[Obj]) -> None:
    """No token every node holds: callers show certificates of the agents' CA (criuctl.agent.callers)."""
    a = agent_options(objects)
    assert a.token_file is None and a.tls_from_cluster
    secret, got_key, _ = secret_file(objects, a.peer_ca)
    assert (secret["metadata"]["name"], got_key) == ("criuctl-agent-tls", "ca.crt")
    env = {e["name"] for e in agent_container(objects)["env"]}
    assert not {n for n in env if "TOKEN" in n}
    assert one(objects, "Secret", "criuctl-ca")["type"] == "kubernetes.io/tls"


def test_each_agent_signs_with_a_key_of_its_own_in_its_nodes_state_dir(objects: list[Obj]) -> None:
    """No Secret gives the agents a bundle key: one node's key must open no other node's bundles."""
    env = {e["name"]: e.get("value") for e in agent_container(objects)["env"]}
    assert BUNDLE_KEY not in env
    for secret in (o for o in objects if o["kind"] == "Secret"):
        assert not any("key" in k and k != "tls.key" for k in secret.get("stringData") or {}), secret
    # the same state dir as `criuctl run` on the host, mounted from the host at the same path
    assert env[STATE_DIR] == str(statedir.DEFAULT_STATE_DIR)
    mounts = {path: hp for path, _, hp in host_mounts(objects)}
    assert mounts[str(statedir.DEFAULT_STATE_DIR)]["path"] == str(statedir.DEFAULT_STATE_DIR)


def test_the_secret_templates_hold_placeholders_the_agent_refuses(objects: list[Obj], tmp_path: Path) -> None:
    """Applying the templates unchanged must leave the agents refusing to work, never running
    with a secret that is printed in this repository."""
    tls = one(objects, "Secret", "criuctl-agent-tls")
    ca = one(objects, "Secret", "criuctl-ca")
    crt, pem = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_text(secret_value(ca, "tls.crt"))
    pem.write_text(secret_value(ca, "tls.key"))
    with pytest.raises(CriuctlError):
        signer.CA.load(crt, pem)
    assert "BEGIN CERTIFICATE" not in secret_value(tls, "ca.crt")


# the host paths the agent works in, each mounted at the same path inside (a path the runtime or the
# kubelet reports means the same thing in the agent)
SAME_PATH = [
    "/var/lib/criuctl",
    str(containers.INJECT_DIR),  # where pods find criuctl's init: written by the agent, on the host
    "/sys/fs/cgroup",
    "/var/lib/kubelet/pods",
    "/var/lib/kubelet/checkpoints",
    "/run/containerd",
]
# the sockets the agent tries (criuctl.container.runtime): a missing one stays missing, never a folder
RUNTIME_SOCKETS = [ep.removeprefix("unix://") for ep in runtime.DEFAULT_ENDPOINTS]


def test_the_host_paths_the_agent_needs_are_mounted(objects: list[Obj]) -> None:
    mounts = {path: (m, hp) for path, m, hp in host_mounts(objects)}
    for path in SAME_PATH:
        assert path in mounts, f"{path} is not mounted"
        assert mounts[path][1]["path"] == path, f"{path} is mounted from {mounts[path][1]['path']}"
    assert any(hp["path"] == "/proc" for _, hp in mounts.values()), "the host's /proc is not mounted"
    # new container rootfs and volume mounts appear after the agent started: it must see them
    for path in ("/run/containerd", "/var/lib/kubelet/pods"):
        assert mounts[path][0].get("mountPropagation") == "HostToContainer", path
    # a runtime socket is reached through its folder, mounted at the same path, and that folder may
    # be missing on a node without that runtime (the pod must still start)
    assert "/run/containerd/containerd.sock" in RUNTIME_SOCKETS
    assert "/var/run/crio/crio.sock" in RUNTIME_SOCKETS
    for sock in RUNTIME_SOCKETS:
        assert sock not in mounts, f"{sock} is mounted as a file"
        parent = str(PurePosixPath(sock).parent)
        assert parent in mounts and mounts[parent][1]["path"] == parent, f"{sock}: {parent} not mounted"
        assert mounts[parent][1]["type"] == "DirectoryOrCreate", parent


def test_everything_namespaced_is_in_criuctl_system(objects: list[Obj]) -> None:
    ns = one(objects, "Namespace")
    assert ns["metadata"]["name"] == "criuctl-system"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for o in objects:
        cluster_scoped = ("Namespace", "ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration")
        cluster_scoped += ("CustomResourceDefinition",)
        if o["kind"] not in cluster_scoped:
            assert o["metadata"]["namespace"] == "criuctl-system", f"{o['kind']}/{o['metadata']['name']}"


# ---------------------------------------------------------------------------------------- RBAC

AGENT_RULES = {
    ("", "pods"): {"get", "list", "patch", "delete"},
    # a Job's moving pod marked DisruptionTarget, for its podFailurePolicy (criuctl.kube.jobfailures)
    ("", "pods/status"): {"patch"},
    ("", "nodes"): {"get", "list"},
    ("", "events"): {"create"},
    # a preStop checkpoint passes over the nodes a claim's volume cannot reach (criuctl.kube.podvolumes)
    ("", "persistentvolumeclaims"): {"get"},
    ("", "persistentvolumes"): {"get"},
    ("apps", "statefulsets"): {"get"},
    ("kubeflow.org", "pytorchjobs"): {"get"},
    ("batch", "jobs"): {"get"},
    ("jobset.x-k8s.io", "jobsets"): {"get"},
    # a drain's move is recorded as a PodMigration (criuctl.kube.prestop)
    ("criuctl.io", "podmigrations"): {"create"},
    # its own key's certificate, asked of the controller (criuctl.kube.identity)
    ("certificates.k8s.io", "certificatesigningrequests"): {"create", "get"},
}
# in criuctl-system only: the move records, and criuctl's own two Secrets by name
AGENT_NS_RULES = {("", "configmaps"): {"get", "list", "create", "update", "delete"}, ("", "secrets"): {"get"}}


def rules(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for o in objs:
        if o["kind"] in ("ClusterRole", "Role"):
            for r in o.get("rules", []):
                yield o, r


def test_no_role_grants_wildcards_or_escalation(objects: list[Obj]) -> None:
    for role, r in rules(objects):
        where = f"{role['kind']}/{role['metadata']['name']}: {r}"
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert "*" not in r.get(field, []), where
        assert not {"escalate", "bind", "impersonate"} & set(r["verbs"]), where
        assert not any(res.endswith("/*") for res in r.get("resources", [])), where


def test_no_cluster_role_reads_secrets(objects: list[Obj]) -> None:
    for role, r in rules(objects):
        if role["kind"] == "ClusterRole":
            assert "secrets" not in r.get("resources", []), f"ClusterRole/{role['metadata']['name']}: {r}"


def _granted(role: Obj) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for r in role["rules"]:
        for group in r["apiGroups"]:
            for res in r["resources"]:
                granted.setdefault((group, res), set()).update(r["verbs"])
    return granted


def test_the_agent_role_is_exactly_the_minimal_one(objects: list[Obj]) -> None:
    """pods and nodes read, Events recorded, the kubelet checkpoint API, and what a controller-owned
    pod's move needs (its successor annotated, an empty placeholder deleted, its owner read, the
    claims and PVs of its volumes); in
    criuctl-system only, the move records and the agents' CA's Secret by name: nothing more."""
    assert _granted(one(objects, "ClusterRole", "criuctl-agent")) == AGENT_RULES
    ns_role = one(objects, "Role", "criuctl-agent")
    assert ns_role["metadata"]["namespace"] == "criuctl-system"
    assert _granted(ns_role) == AGENT_NS_RULES
    (secrets,) = [r for r in ns_role["rules"] if "secrets" in r["resources"]]
    assert sorted(secrets["resourceNames"]) == ["criuctl-agent-tls"]
    sa = one(objects, "ServiceAccount", "criuctl-agent")["metadata"]
    subject = [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = one(objects, kind, "criuctl-agent")
        role_kind = kind.removesuffix("Binding")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": "criuctl-agent",
        }
        assert binding["subjects"] == subject


CONTROLLER_RULES = {
    ("criuctl.io", "podmigrations"): {"get", "list", "watch", "patch", "delete"},
    ("criuctl.io", "podmigrations/status"): {"patch"},
    ("", "pods"): {"get", "list", "create", "delete", "patch"},
    ("", "nodes"): {"get"},
    ("", "events"): {"create"},
    ("apps", "statefulsets"): {"get"},
    ("kubeflow.org", "pytorchjobs"): {"get"},
    ("batch", "jobs"): {"get"},
    ("jobset.x-k8s.io", "jobsets"): {"get"},
    ("", "persistentvolumeclaims"): {"get"},
    ("", "persistentvolumes"): {"get"},
    # its own certificate request, asked of criuctl's signer (criuctl.kube.identity); it signs none
    ("certificates.k8s.io", "certificatesigningrequests"): {"create", "get"},
}
SIGNER_RULES = {
    ("certificates.k8s.io", "certificatesigningrequests"): {"get", "list"},
    ("certificates.k8s.io", "certificatesigningrequests/approval"): {"update"},
    ("certificates.k8s.io", "certificatesigningrequests/status"): {"update"},
    ("certificates.k8s.io", "signers"): {"approve", "sign"},
    ("", "nodes"): {"get"},
}
CONTROLLER_NS_RULES = {
    ("", "secrets"): {"get"},
    ("", "configmaps"): {"get", "create", "update", "delete"},
    ("coordination.k8s.io", "leases"): {"get", "create", "update"},
}


def test_the_controller_role_is_exactly_what_it_calls(objects: list[Obj]) -> None:
    assert _granted(one(objects, "ClusterRole", "criuctl-controller")) == CONTROLLER_RULES
    ns_role = one(objects, "Role", "criuctl-controller")
    assert _granted(ns_role) == CONTROLLER_NS_RULES
    (secrets,) = [r for r in ns_role["rules"] if "secrets" in r["resources"]]
    assert sorted(secrets["resourceNames"]) == ["criuctl-agent-tls"]
    pod = one(objects, "Deployment", "criuctl-controller")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "criuctl-controller"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not any("hostPath" in v for v in pod.get("volumes", [])), "the controller needs no host path"
    assert "--tls-from-cluster" in pod["containers"][0]["args"]


def test_the_signer_role_is_exactly_what_it_calls(objects: list[Obj]) -> None:
    """The one component that may approve and sign, for criuctl's signer name alone, and read the
    asking agent pods of its own namespace: no Secret, no move, no write but a request's verdict."""
    assert _granted(one(objects, "ClusterRole", "criuctl-signer")) == SIGNER_RULES
    assert _granted(one(objects, "Role", "criuctl-signer")) == {("", "pods"): {"get"}}
    (signers,) = [
        r for r in one(objects, "ClusterRole", "criuctl-signer")["rules"] if "signers" in r["resources"]
    ]
    assert signers["resourceNames"] == [identity.SIGNER], "it may approve and sign for criuctl's signer alone"
    dep = one(objects, "Deployment", "criuctl-signer")["spec"]
    assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate"
    pod = dep["template"]["spec"]
    assert pod["serviceAccountName"] == "criuctl-signer" and pod["securityContext"]["runAsNonRoot"] is True
    assert not any("hostPath" in v for v in pod.get("volumes", [])), "the signer needs no host path"


def test_each_agent_gets_its_own_certificate_and_only_the_signer_holds_the_ca(objects: list[Obj]) -> None:
    """No Secret holds an agent's key: each agent asks for its own certificate with a token bound to
    its pod, and the CA's key is mounted in the signer's pod alone (not the controller's: a stolen
    controller makes no node), readable by its user only."""
    a = agent_options(objects)
    assert a.tls_from_cluster and a.tls_cert is None and a.tls_key is None
    secret, key, _ = secret_file(objects, a.peer_ca)  # callers checked against the agents' CA
    assert (secret["metadata"]["name"], key) == ("criuctl-agent-tls", "ca.crt")
    ds = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in agent_container(objects)["volumeMounts"]}
    vols = {v["name"]: v for v in ds["volumes"]}
    projected = vols[mounts[str(identity.BOUND_TOKEN.parent)]]["projected"]
    assert projected["defaultMode"] & 0o077 == 0
    (source,) = projected["sources"]
    assert source["serviceAccountToken"]["path"] == identity.BOUND_TOKEN.name
    holders = [
        o["metadata"]["name"]
        for o in objects
        if o["kind"] in ("DaemonSet", "Deployment")
        for v in o["spec"]["template"]["spec"].get("volumes", [])
        if (v.get("secret") or {}).get("secretName") == "criuctl-ca"
    ]
    assert holders == ["criuctl-signer"]
    pod = one(objects, "Deployment", "criuctl-signer")["spec"]["template"]["spec"]
    (ca,) = [v for v in pod["volumes"] if (v.get("secret") or {}).get("secretName") == "criuctl-ca"]
    assert ca["secret"]["defaultMode"] & 0o007 == 0, "the CA key is readable by others"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == ca["name"]]
    args = pod["containers"][0]["args"]
    assert args[args.index("--ca-cert") + 1] == f"{mount['mountPath']}/tls.crt"
    assert args[args.index("--ca-key") + 1] == f"{mount['mountPath']}/tls.key"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_users_need_podmigrations_only_and_edit_gets_them(objects: list[Obj]) -> None:
    role = one(objects, "ClusterRole", "criuctl-migrator")
    assert _granted(role) == {
        ("criuctl.io", "podmigrations"): {"get", "list", "watch", "create", "delete", "patch"},
        ("criuctl.io", "podmigrations/status"): {"get"},
        ("", "pods"): {"get", "list"},  # `criuctl ps --jobs`: the ranks the agents publish on pods
    }
    # what `ps --jobs` calls as the user is in the role: no Secret, no agent (before: the token Secret)
    assert _calls("jobs:cluster_survey") <= {("", "pods", v) for v in ("get", "list")}
    # patch, for `criuctl cancel`'s annotation (the spec stays immutable: components/immutable-spec)
    assert _calls("podmigrations:cancel") == {("criuctl.io", "podmigrations", "patch")}
    assert role["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"


# what each API method of the official client asks of RBAC: (group, resource, verb)
_VERB = {"read": "get", "get": "get", "list": "list", "create": "create", "delete": "delete"}
_VERB |= {"patch": "patch", "replace": "update"}
_SUBRESOURCES = ("_status", "_approval")  # replace_certificate_signing_request_approval: .../approval
# the modules whose calls each identity makes: the controller's move, the agents' preStop and
# successors loop (criuctl.kube.nodeside), and what both share; of podmigrations, the controller
# makes the calls of these functions (the others are the CLI's, as the user: criuctl-migrator)
CALLERS = {
    "criuctl-controller": [
        "controller",
        "podmigrate",
        "podmigrations:read,every,patch_status,delete",
        "podplan",
        "moves:read,save,forget",
        "events",
        "cluster",
        "owners",
        "podvolumes",
        "identity:_ask",
    ],
    "criuctl-signer": ["signer", "identity:node_addresses,agent_node"],
    "criuctl-agent": [
        "identity:_ask,issue,obtain,node_addresses",
        "podmigrations:record_drain,create",
        "jobs:publish",
        "prestop",
        "successors",
        "nodeside",
        "moves",
        "events",
        "cluster",
        "owners",
        "podvolumes",
        "podplan",
        "peerrules",
    ],
}
_RESOURCE = {
    "pod": ("", "pods"),
    "node": ("", "nodes"),
    "event": ("", "events"),
    "config_map": ("", "configmaps"),
    "secret": ("", "secrets"),
    "stateful_set": ("apps", "statefulsets"),
    "persistent_volume_claim": ("", "persistentvolumeclaims"),
    "persistent_volume": ("", "persistentvolumes"),
    "certificate_signing_request": ("certificates.k8s.io", "certificatesigningrequests"),
}
# the custom objects a module reads or writes: by the group its calls name
_CUSTOM = {
    "podmigrations": [("criuctl.io", "podmigrations")],
    # the owner a pod comes back to: a PyTorchJob, or a JobSet's Job and the JobSet
    "owners": [("kubeflow.org", "pytorchjobs"), ("batch", "jobs"), ("jobset.x-k8s.io", "jobsets")],
}


def _calls(where: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every API call in criuctl/kube/MODULE.py (or, for "MODULE:F,G",
    in its functions F and G only): `c.core.read_node` → ("", "nodes", "get");
    `c.custom.patch_namespaced_custom_object_status` → the module's custom resource's status, "patch"."""
    import ast

    module, _, only = where.partition(":")
    text = (MANIFESTS.parent / "criuctl" / "kube" / f"{module}.py").read_text()
    if only:
        tree = parse_python(text)
        defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in only.split(",")]
        assert len(defs) == len(only.split(",")), f"{where}: a function is missing"
        text = "\n".join(ast.get_source_segment(text, d) or "" for d in defs)
    out: set[tuple[str, str, str]] = set()
    for api, method in re.findall(r"\bc\.(core|apps|custom|certificates)\.([a-z_]+)\b", text):
        if method in ("api_client", "timeouts", "get_api_resources"):
            continue
        verb_word, _, rest = method.partition("_")
        verb = _VERB[verb_word]
        rest = rest.removeprefix("namespaced_").removeprefix("cluster_").removesuffix("_for_all_namespaces")
        if api == "custom":
            status = "/status" if rest.endswith("_status") else ""
            out |= {(group, resource + status, verb) for group, resource in _CUSTOM[module]}
        else:
            sub = next((x for x in _SUBRESOURCES if rest.endswith(x)), "")
            group, resource = _RESOURCE[rest.removesuffix(sub)]
            out.add((group, resource + sub.replace("_", "/"), verb))
    return out


@pytest.mark.parametrize("identity", sorted(CALLERS))
def test_every_api_call_of_the_code_is_granted(objects: list[Obj], identity: str) -> None:
    """RBAC from the code: each call site in the modules an identity runs needs its verb granted
    (a role short of one fails the call at run time, in a cluster, mid-move)."""
    granted = _granted(one(objects, "ClusterRole", identity))
    for (group, res), verbs in _granted(one(objects, "Role", identity)).items():
        granted.setdefault((group, res), set()).update(verbs)
    needed = set().union(*(_calls(m) for m in CALLERS[identity]))
    missing = {(g, r, v) for g, r, v in needed if v not in granted.get((g, r), set())}
    if identity == "criuctl-agent":  # of PodMigrations, the agents only record a drain's move
        assert {n for n in needed if n[1].startswith("podmigrations")} == {
            ("criuctl.io", "podmigrations", "create")
        }
    assert not missing, f"{identity} calls without RBAC: {sorted(missing)}"


def test_the_webhook_reads_move_records_and_pods_and_patches_only_pods(objects: list[Obj]) -> None:
    """Pods patched: an evicted Job's pod leaves its Job's count (criuctl.kube.jobfailures.untrack);
    the eviction webhook sees every eviction outside the system namespaces, with side effects only
    where the request is no dry run, and never stands in a drain's way."""
    role = one(objects, "Role", "criuctl-webhook")
    assert role["metadata"]["namespace"] == "criuctl-system"
    assert _granted(role) == {("", "configmaps"): {"get", "list"}}
    assert _granted(one(objects, "ClusterRole", "criuctl-webhook")) == {
        ("", "pods"): {"list", "get", "patch"}
    }
    hooks = {w["name"]: w for w in one(objects, "MutatingWebhookConfiguration", "criuctl")["webhooks"]}
    evict = hooks["evictions.criuctl.io"]
    assert [r["resources"] for r in evict["rules"]] == [["pods/eviction"]]
    assert evict["clientConfig"]["service"]["path"] == "/evict"
    assert (evict["failurePolicy"], evict["sideEffects"]) == ("Ignore", "NoneOnDryRun")
    assert "objectSelector" not in evict  # an Eviction carries none of the pod's labels
    pod = one(objects, "Deployment", "criuctl-webhook")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "criuctl-webhook"


def test_every_rule_says_why() -> None:
    """Each rule of rbac.yaml is preceded by a comment line that names its resource."""
    lines = (MANIFESTS / "rbac.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            resources_line = lines[i + 1]
            res = re.search(r'resources: \["([^"]+)"', resources_line)
            assert res, resources_line
            comment = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                comment.insert(0, lines[j])
                j -= 1
            assert any(res[1] in c for c in comment), f"rule for {res[1]} has no comment saying why"


# -------------------------------------------------------------------- the documented overlay


@needs("kubernetes-validate", "kubectl")  # the overlay of docs/deploy.md is rendered by kubectl
def test_an_overlay_replaces_the_secret_templates_as_docs_deploy_says(tmp_path: Path) -> None:
    """docs/deploy.md: an overlay outside the repository whose secretGenerator (behavior: replace)
    takes the real values from files; the Secrets keep their names, so the DaemonSet still finds them."""
    overlay = tmp_path / "mycluster"
    overlay.mkdir()
    values = {
        "ca.crt": "-----BEGIN CERTIFICATE-----\nnot-checked-here\n-----END CERTIFICATE-----\n",
        "tls.crt": "-----BEGIN CERTIFICATE-----\nnot-checked-here\n-----END CERTIFICATE-----\n",
        "tls.key": "-----BEGIN PRIVATE KEY-----\nnot-checked-here\n-----END PRIVATE KEY-----\n",
    }
    for name, text in values.items():
        (overlay / name).write_text(text)
    base = os.path.relpath(MANIFESTS, overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources: [{base}]\n"
        "secretGenerator:\n"
        "  - name: criuctl-agent-tls\n"
        "    namespace: criuctl-system\n"
        "    behavior: replace\n"
        "    files: [ca.crt]\n"
        "  - name: criuctl-ca\n"
        "    namespace: criuctl-system\n"
        "    behavior: replace\n"
        "    type: kubernetes.io/tls\n"
        "    files: [tls.crt, tls.key]\n"
    )
    objs = render(overlay)
    for version in versions():
        for obj in objs:
            validate(obj, version)
    tls = one(objs, "Secret", "criuctl-agent-tls")
    ca = one(objs, "Secret", "criuctl-ca")
    for secret in (tls, ca):
        assert "stringData" not in secret
        for key in secret["data"]:
            assert secret_value(secret, key) == values[key]
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {"criuctl-agent-tls"}
    pod = one(objs, "Deployment", "criuctl-signer")["spec"]["template"]["spec"]
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {"criuctl-ca"}
    pod = one(objs, "Deployment", "criuctl-controller")["spec"]["template"]["spec"]
    assert not any("secret" in v for v in pod["volumes"]), "the controller mounts no Secret"


# ------------------------------------------------------------------- CRIUCTL_BUNDLE_KEY (code)


def test_the_signing_key_is_taken_from_the_file_the_env_names(tmp_path: Path, monkeypatch) -> None:
    key = secrets.token_bytes(32)
    path = tmp_path / "secret" / "bundle.key"
    path.parent.mkdir()
    path.write_text(key.hex() + "\n")
    monkeypatch.setenv(BUNDLE_KEY, str(path))
    assert statedir.key_path() == path
    assert bundle.load_key(statedir.key_path(), create=False) == key


def test_without_the_env_the_signing_key_is_in_the_state_dir(state_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(BUNDLE_KEY, raising=False)
    assert statedir.key_path() == state_dir / "bundle.key"
    monkeypatch.setenv(BUNDLE_KEY, "")
    assert statedir.key_path() == state_dir / "bundle.key"


@needs_validate
@needs("kubectl")
@pytest.mark.parametrize("version", versions())
def test_the_immutable_spec_component_makes_the_api_server_refuse_a_spec_change(
    tmp_path: Path, version: str
) -> None:
    """manifests/components/immutable-spec, as an overlay adds it on a cluster with CRD validation
    rules: the CRD then carries `self == oldSelf` on the spec, and stays strictly valid."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(MANIFESTS, overlay)
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{base}]\ncomponents: [{base}/components/immutable-spec]\n"
    )
    crd = one(render(overlay), "CustomResourceDefinition")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = spec["x-kubernetes-validations"]
    assert rule["rule"] == "self == oldSelf" and "cannot change" in rule["message"]
    validate(crd, version)
    assert "x-kubernetes-validations" not in str(one(render(MANIFESTS), "CustomResourceDefinition"))
