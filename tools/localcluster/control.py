"""The control plane on the host, bound to the cluster bridge's address: etcd, kube-apiserver,
kube-scheduler, kube-controller-manager. Each runs in its own session so `down` can end its group."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import requests

from localcluster.layout import K8S_BIN, ClusterError, Layout


def spawn(lay: Layout, part: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start one daemon detached from us (it outlives `up`), its output in DIR/logs/PART.log."""
    logs = lay.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{part}.log").open("ab") as log:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true", **(env or {})},
        )
    lay.pids[part] = p.pid
    lay.save()
    return p.pid


def log_tail(lay: Layout, part: str, n: int = 1500) -> str:
    try:
        return (lay.dir / "logs" / f"{part}.log").read_text(errors="replace")[-n:]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait(lay: Layout, part: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(lay.pids[part]):
            raise ClusterError(f"{part} exited: {log_tail(lay, part)}")
        try:
            if ready():
                return
        except (OSError, requests.RequestException):
            pass
        time.sleep(0.3)
    raise ClusterError(f"{part} not ready after {timeout:.0f}s: {log_tail(lay, part)}")


def start(lay: Layout, tokens: dict[str, str]) -> None:
    pki = lay.pki
    etcd_url = lay.etcd_url
    spawn(
        lay,
        "etcd",
        [
            "etcd",
            "--name",
            "local",
            "--data-dir",
            str(lay.dir / "etcd"),
            "--listen-client-urls",
            etcd_url,
            "--advertise-client-urls",
            etcd_url,
            "--listen-peer-urls",
            lay.etcd_peer_url,
            "--initial-advertise-peer-urls",
            lay.etcd_peer_url,
            "--initial-cluster",
            f"local={lay.etcd_peer_url}",
        ],
    )
    wait(lay, "etcd", lambda: requests.get(f"{etcd_url}/health", timeout=2).ok, 30)
    spawn(
        lay,
        "kube-apiserver",
        [
            str(K8S_BIN / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={lay.host_ip}",
            f"--advertise-address={lay.host_ip}",
            f"--secure-port={lay.api_port}",
            f"--tls-cert-file={pki}/apiserver.crt",
            f"--tls-private-key-file={pki}/apiserver.key",
            f"--client-ca-file={pki}/ca.crt",
            f"--token-auth-file={pki}/tokens.csv",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki}/sa.pub",
            f"--service-account-signing-key-file={pki}/sa.key",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--allow-privileged=true",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # the API server calls a webhook Service at its pods' addresses (the host routes every
            # node's pod range; the host itself runs no kube-proxy)
            "--enable-aggregator-routing=true",
            "--insecure-port=0",
            "--profiling=false",
        ],
    )
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    ca = str(pki / "ca.crt")

    def api_ready() -> bool:
        return requests.get(f"{lay.api_url}/readyz", headers=admin, verify=ca, timeout=2).ok

    wait(lay, "kube-apiserver", api_ready, 90)
    common = ["--leader-elect=false", "--port=0", "--secure-port=0"]
    spawn(
        lay,
        "kube-scheduler",
        [
            str(K8S_BIN / "kube-scheduler"),
            f"--kubeconfig={lay.dir}/kube-scheduler.kubeconfig",
            *common,
        ],
    )
    spawn(
        lay,
        "kube-controller-manager",
        [
            str(K8S_BIN / "kube-controller-manager"),
            f"--kubeconfig={lay.dir}/kube-controller-manager.kubeconfig",
            *common,
            f"--service-account-private-key-file={pki}/sa.key",
            f"--root-ca-file={pki}/ca.crt",
            f"--flex-volume-plugin-dir={lay.dir}/flexvolume",
            "--controllers=*,-bootstrapsigner,-tokencleaner,-job",  # Jobs: localcluster.indexedjob
            "--use-service-account-credentials=true",
            "--node-monitor-grace-period=20s",
            "--pod-eviction-timeout=30s",
        ],
    )
    time.sleep(1)
    for part in ("kube-scheduler", "kube-controller-manager"):
        if not alive(lay.pids[part]):
            raise ClusterError(f"{part} exited: {log_tail(lay, part)}")
