"""What runs on the local cluster besides Kubernetes: criuctl's agent as the DaemonSet of
`manifests/` and the admission webhook's Deployment, rendered by kustomize as a user applies them:
the image built here from the Dockerfile (an image override), the Secrets filled in, the webhook's
certificate from scripts/webhook-cert.sh. Nothing of the checkout or of the host's Python is mounted
into criuctl's pods."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tarfile
from pathlib import Path

from localcluster.layout import IMAGES, REPO, ClusterError, Layout, sh

AGENT_REPO = "criuctl-agent"  # scripts/build-image.sh's name; containerd files it under docker.io/library


def agent_image(lay: Layout) -> None:
    """The agent image, as a user builds it (`make image`: scripts/build-image.sh, the Dockerfile),
    kept as an archive in the shared cache under its content key: built once per content of its
    inputs, then reused by every cluster and test session. Recorded in `lay` for the nodes (which
    import the archive) and for the tests (which check that the agents run exactly this image)."""
    r = sh("bash", str(REPO / "scripts" / "build-image.sh"), "--archive-dir", str(IMAGES))
    _key, tag, archive = r.stdout.strip().splitlines()[-1].split()
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None, f"{archive} has no manifest.json"
        config = json.load(member)[0]["Config"]
    lay.agent_image = f"{AGENT_REPO}:{tag}"
    lay.agent_image_id = "sha256:" + config.removesuffix(".json").removeprefix("blobs/sha256/")
    lay.agent_archive = archive
    lay.save()


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def overlay(lay: Layout) -> Path:
    """The kustomization that turns manifests/ into this cluster's: written into DIR/manifests."""
    d = lay.dir / "manifests"
    d.mkdir(parents=True, exist_ok=True)
    pki = lay.pki
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "criuctl-agent-tls", "namespace": "criuctl-system"},
            "stringData": None,
            "data": {"ca.crt": _b64(pki / "criuctl-ca.crt")},
        },
        {  # the agents' own CA (not the cluster's): criuctl's signer signs their certificates with it
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "criuctl-ca", "namespace": "criuctl-system"},
            "stringData": None,
            "data": {"tls.crt": _b64(pki / "criuctl-ca.crt"), "tls.key": _b64(pki / "criuctl-ca.key")},
        },
    ]
    # a short lease: a frozen source whose client died asks the target after 20 s, not 120 s (the
    # tests of a dead client wait for it)
    lease: list[dict] = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": v}
        for v in ("--lease", f"{lay.agent_lease:g}")
    ]
    # the tests make a node's restores fail (criuctl.core.faults) by a file in its state dir
    lease.append(
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "CRIUCTL_FAULT_DIR", "value": "/var/lib/criuctl/faults"},
        }
    )
    # and stop an agent at a named instant (criuctl.agent.points) by DIR/pause/armed in its state dir
    lease.append(
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "CRIUCTL_PAUSE_DIR", "value": "/var/lib/criuctl/pause"},
        }
    )
    # an agent restarted under a move (the tests kill them) is Ready within 2 s, not up to 10
    lease.append(
        {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe/periodSeconds", "value": 2}
    )
    patches = [{"path": f"secret{i}.json"} for i in range(len(secrets))]
    patches.append({"target": {"kind": "DaemonSet", "name": "criuctl-agent"}, "patch": json.dumps(lease)})
    # the controller's Lease short too: a replica takes a dead leader's moves up within seconds
    election = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": v}
        for v in ("--lease-seconds", "6", "--renew-seconds", "4", "--retry-seconds", "1")
    ]
    # the tests stop the controller at a named instant (criuctl.agent.points): they arm the points in
    # DIR/pause/armed, which every replica reads (a test-only setting: docs/kubernetes.md)
    pause = lay.dir / "pause"
    pause.mkdir(exist_ok=True)
    pause.chmod(0o1777)
    election += [
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "CRIUCTL_PAUSE_DIR", "value": str(pause)},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/volumeMounts/-",
            "value": {"name": "pause", "mountPath": str(pause)},
        },
        {
            "op": "add",
            "path": "/spec/template/spec/volumes/-",
            "value": {"name": "pause", "hostPath": {"path": str(pause), "type": "Directory"}},
        },
    ]
    patches.append(
        {"target": {"kind": "Deployment", "name": "criuctl-controller"}, "patch": json.dumps(election)}
    )
    # the certificates short-lived: the agents' and the controller's are renewed every 10 minutes,
    # under the moves the tests make (a rotation must not fail one)
    short = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": v}
        for v in ("--cert-seconds", "900")
    ]
    patches.append({"target": {"kind": "Deployment", "name": "criuctl-signer"}, "patch": json.dumps(short)})
    for i, s in enumerate(secrets):
        (d / f"secret{i}.json").write_text(json.dumps(s))
    kust = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "manifests", d)],
        # the one change a user makes for an image of their own: its name and tag
        "images": [{"name": "criuctl-agent", "newName": AGENT_REPO, "newTag": lay.agent_image.split(":")[1]}],
        "patches": patches,
    }
    (d / "kustomization.yaml").write_text(json.dumps(kust, indent=1))
    return d


def render(lay: Layout) -> list[dict]:
    """The objects `kubectl apply -k` makes of the overlay, with the webhook's TLS as a user makes it
    (scripts/webhook-cert.sh: its Secret, and its CA as the configuration's caBundle)."""
    import yaml

    tls = lay.pki / "webhook"
    sh("bash", str(REPO / "scripts" / "webhook-cert.sh"), "--print-only", str(tls))
    out = sh("kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay(lay))).stdout
    objs = [o for o in yaml.safe_load_all(out) if o]
    for o in objs:
        if o["kind"] == "MutatingWebhookConfiguration":
            webhook_configuration(o, (tls / "cabundle.b64").read_text().strip())
    return [*objs, yaml.safe_load((tls / "secret.yaml").read_text())]


def webhook_configuration(o: dict, ca_bundle: str) -> None:
    """The manifests' webhook configuration, trusting the webhook's CA, for what 1.20 can select."""
    for w in o.get("webhooks", []):
        w["clientConfig"]["caBundle"] = ca_bundle
        # 1.20 does not label namespaces with their name (1.21+): select what this cluster can
        for sel in ("namespaceSelector", "objectSelector"):
            exprs = w.get(sel, {}).get("matchExpressions", [])
            w.setdefault(sel, {})["matchExpressions"] = [
                e for e in exprs if e["key"] != "kubernetes.io/metadata.name"
            ]


def apply(lay: Layout, objs: list[dict]) -> None:
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    r = subprocess.run(
        ["kubectl", "--kubeconfig", str(lay.kubeconfig), "apply", "-f", "-"],
        input=doc,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise ClusterError(f"kubectl apply: {r.stderr.strip()[-1500:]}")
