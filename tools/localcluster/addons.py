"""What runs on the local cluster besides Kubernetes: criuctl's agent as the DaemonSet of
`manifests/` (rendered by kustomize with a local overlay: the agent image built here from the
Dockerfile, real Secrets), and the admission webhook on the host, registered by URL (no kube-proxy
here, so a Service's address would not route)."""

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
    ds_patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "criuctl-agent", "namespace": "criuctl-system"},
        "spec": {
            "template": {
                "spec": {
                    # no kube-proxy here: a Service address would not route, so the agent's in-cluster
                    # client is pointed at the API server itself (its certificate names that address)
                    "containers": [
                        {
                            "name": "agent",
                            "env": [
                                {"name": "KUBERNETES_SERVICE_HOST", "value": lay.host_ip},
                                {"name": "KUBERNETES_SERVICE_PORT", "value": str(lay.api_port)},
                            ],
                        }
                    ],
                }
            }
        },
    }
    pki = lay.pki
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "criuctl-agent", "namespace": "criuctl-system"},
            "stringData": None,
            "data": {"token": _b64(pki / "agent-token"), "bundle.key": _b64(pki / "bundle.key")},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "criuctl-agent-tls", "namespace": "criuctl-system"},
            "stringData": None,
            "data": {
                "tls.crt": _b64(pki / "agent.crt"),
                "tls.key": _b64(pki / "agent.key"),
                "ca.crt": _b64(pki / "ca.crt"),
            },
        },
    ]
    # a short lease: a frozen source whose client died asks the target after 20 s, not 120 s (the
    # tests of a dead client wait for it)
    lease = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": v}
        for v in ("--lease", f"{lay.agent_lease:g}")
    ]
    patches = [{"path": "daemonset.json"}] + [{"path": f"secret{i}.json"} for i in range(len(secrets))]
    patches.append({"target": {"kind": "DaemonSet", "name": "criuctl-agent"}, "patch": json.dumps(lease)})
    (d / "daemonset.json").write_text(json.dumps(ds_patch))
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
    """The objects `kubectl apply -k` would create, minus what the local cluster replaces: the
    webhook's Deployment and Service (the webhook runs on the host; see `webhook_configuration`)."""
    out = sh("kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay(lay))).stdout
    import yaml

    objs = [o for o in yaml.safe_load_all(out) if o]
    keep = []
    for o in objs:
        if o["kind"] in ("Deployment", "Service") and o["metadata"]["name"] == "criuctl-webhook":
            continue
        if o["kind"] == "MutatingWebhookConfiguration":
            o = webhook_configuration(lay, o)
        keep.append(o)
    return keep


def webhook_configuration(lay: Layout, o: dict) -> dict:
    """The manifests' webhook configuration, pointed at the webhook on the host by URL, with our CA."""
    for w in o.get("webhooks", []):
        path = w["clientConfig"].get("service", {}).get("path", "/mutate")
        w["clientConfig"] = {
            "url": f"https://{lay.host_ip}:{lay.webhook_port}{path}",
            "caBundle": _b64(lay.pki / "ca.crt"),
        }
        # 1.20 does not label namespaces with their name (1.21+): select what this cluster can
        for sel in ("namespaceSelector", "objectSelector"):
            exprs = w.get(sel, {}).get("matchExpressions", [])
            w.setdefault(sel, {})["matchExpressions"] = [
                e for e in exprs if e["key"] != "kubernetes.io/metadata.name"
            ]
    return o


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
