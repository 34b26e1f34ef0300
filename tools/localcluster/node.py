"""One kubelet node: a network namespace on the cluster bridge, and in a private mount namespace its
own containerd and a real kubelet.

Both daemons hard-code host paths (/run/containerd, /var/lib/kubelet, /var/log/pods, /var/lib/cni,
...): inside the node's mount namespace a folder of the node is bound over each, so two nodes on one
host never see each other's state, and everything a DaemonSet mounts by hostPath means this node's.
The kubelet writes six kernel settings it wants (vm.overcommit_memory=1, kernel.panic=10, ...): in
the node's mount namespace those /proc/sys entries are files of ours that already hold its values,
so it reads them, is satisfied, and the machine's own settings are never touched. The namespace is
made rshared after being made private, so the kubelet's mount propagation (HostToContainer volumes)
works inside it without ever reaching the host. `stop` ends every process whose mount namespace is
the node's, and every process in the node's cgroups; the namespace, and every mount in it, dies
with its last process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import time
from pathlib import Path

from localcluster import containerd_config, pki
from localcluster.control import spawn
from localcluster.layout import BUSYBOX, BUSYBOX_TAR, K8S_BIN, ClusterError, Layout, NodeInfo, sh

# node-private folder → the host path it stands in for, inside the node's mount namespace
BINDS = {
    "run-containerd": "/run/containerd",
    "var-lib-containerd": "/var/lib/containerd",
    "opt-containerd": "/opt/containerd",
    "var-lib-kubelet": "/var/lib/kubelet",
    "var-log-pods": "/var/log/pods",
    "var-log-containers": "/var/log/containers",
    "var-lib-cni": "/var/lib/cni",
    "etc-cni": "/etc/cni/net.d",
    "var-lib-criuctl": "/var/lib/criuctl",
    "var-lib-criuctl-inject": "/var/lib/criuctl-inject",
}
# what kubelet 1.20 writes unless it reads it already (pkg/kubelet/cm: setupKernelTunables)
SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
CGROUPS = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    return sorted(p for p in CGROUPS.iterdir() if p.is_dir() and os.path.ismount(p))


def network(lay: Layout, n: NodeInfo) -> None:
    sh("ip", "netns", "add", n.ns)
    sh("ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.ns)
    sh("ip", "link", "set", n.veth, "master", lay.bridge, "up")
    inside = ["ip", "netns", "exec", n.ns]
    sh(*inside, "ip", "addr", "add", f"{n.ip}/24", "dev", "eth0")
    sh(*inside, "ip", "link", "set", "eth0", "up")
    sh(*inside, "ip", "link", "set", "lo", "up")
    sh(*inside, "ip", "route", "add", "default", "via", lay.host_ip)
    sh("ip", "route", "add", n.pod_cidr, "via", n.ip, "dev", lay.bridge)


def pod_routes(lay: Layout) -> None:
    """Each node routes the other nodes' pod networks to them across the bridge (flannel's host-gw
    does the same): a pod reaches another node and its pods, and the answer comes back the way it
    went. Without it, only the host routes them, and the host does not forward (its ip_forward is
    the machine's setting, left alone)."""
    for name in lay.nodes:
        n = lay.node(name)
        for other in (lay.node(m) for m in lay.nodes if m != name):
            sh("ip", "netns", "exec", n.ns, "ip", "route", "replace", other.pod_cidr, "via", other.ip)


def cgroup_root(n: NodeInfo) -> None:
    """The kubelet's --cgroup-root must exist in every hierarchy; cpuset needs its cpus and mems."""
    for h in hierarchies():
        d = h / n.cgroup_root.lstrip("/")
        d.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (h / f).exists():
                (d / f).write_text((h / f).read_text())


def _files(lay: Layout, n: NodeInfo, token: str, proxy_token: str) -> Path:
    d = lay.node_dir(n.name)
    for sub in (*BINDS, "sysctl"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    for key, value in SYSCTLS.items():
        (d / "sysctl" / key.replace("/", "_")).write_text(value + "\n")
    (d / "containerd.toml").write_text(containerd_config.node_v2(BUSYBOX, "/usr/local/sbin/criu"))
    cni = {
        "cniVersion": "0.4.0",
        "name": f"{lay.prefix}-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "ipam": {"type": "host-local", "subnet": n.pod_cidr, "routes": [{"dst": "0.0.0.0/0"}]},
            }
        ],
    }
    (d / "etc-cni" / "10-pods.conflist").write_text(json.dumps(cni))
    kubelet = {
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "address": n.ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": n.cgroup_root,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
        "hairpinMode": "none",
        "resolvConf": "/etc/resolv.conf",
        "clusterDomain": "cluster.local",
        "clusterDNS": [lay.host_ip],  # the DNS stand-in (localcluster.dns)
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "4s",
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
    }
    (d / "kubelet.json").write_text(json.dumps(kubelet, indent=1))
    pki.kubeconfig(lay, d / "kubelet.kubeconfig", token)
    pki.kubeconfig(lay, d / "kube-proxy.kubeconfig", proxy_token)
    binds = (
        "\n".join(f"mount --bind {shlex.quote(str(d / k))} {v}" for k, v in BINDS.items())
        + "\n"
        + "\n".join(f"mount --bind {d}/sysctl/{k.replace('/', '_')} /proc/sys/{k}" for k in SYSCTLS)
    )
    images = " ".join(shlex.quote(str(p)) for p in (BUSYBOX_TAR, lay.agent_archive))
    script = f"""#!/bin/bash
# node {n.name} of the criuctl local cluster: run in its own mount namespace and its network
set -euo pipefail
mount --make-rshared /
for p in {" ".join(BINDS.values())}; do mkdir -p "$p"; done
{binds}
containerd --config {d}/containerd.toml >>{d}/containerd.log 2>&1 &
for i in $(seq 300); do [ -S /run/containerd/containerd.sock ] && break; sleep 0.1; done
for t in {images}; do ctr -n k8s.io images import "$t" >/dev/null; done
# kube-proxy (iptables mode, in this node's network namespace): Service addresses route, so pods
# reach the API server at the `kubernetes` Service as in any cluster. It must not set conntrack
# sysctls (the machine's own) or lower its OOM score (root here lacks CAP_SYS_RESOURCE).
{K8S_BIN}/kube-proxy --kubeconfig={d}/kube-proxy.kubeconfig --hostname-override={n.name} \
  --bind-address={n.ip} --proxy-mode=iptables --cluster-cidr={n.net.rsplit(".", 1)[0]}.0.0/16 \
  --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 \
  --conntrack-tcp-timeout-close-wait=0 --oom-score-adj=0 --healthz-bind-address=127.0.0.1:10256 \
  --metrics-bind-address=127.0.0.1:10249 --v=1 >>{d}/kube-proxy.log 2>&1 &
exec {K8S_BIN}/kubelet --config={d}/kubelet.json --kubeconfig={d}/kubelet.kubeconfig \\
  --container-runtime=remote --container-runtime-endpoint=unix:///run/containerd/containerd.sock \\
  --node-ip={n.ip} --hostname-override={n.name} --pod-infra-container-image={BUSYBOX} \\
  --node-labels=criuctl.io/local-cluster=true --v=1
"""
    (d / "node.sh").write_text(script)
    return d / "node.sh"


def start(lay: Layout, name: str, token: str, proxy_token: str) -> None:
    n = lay.node(name)
    network(lay, n)
    cgroup_root(n)
    script = _files(lay, n, token, proxy_token)
    ours = os.stat("/proc/self/ns/mnt").st_ino
    pid = spawn(
        lay,
        f"node-{name}",
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "nsenter",
            f"--net=/run/netns/{n.ns}",
            "bash",
            str(script),
        ],
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            ino = os.stat(f"/proc/{pid}/ns/mnt").st_ino
            if ino != ours:
                lay.mnt_ns[name] = ino
                lay.save()
                return
        time.sleep(0.05)
    raise ClusterError(f"node {name}: its mount namespace did not appear")


def binds_in_use() -> set[str]:
    """The BINDS targets on which another mount namespace (a node of another cluster) has a mount.
    `down` must leave those folders: removing a folder on the host detaches every mount on it in
    every other namespace (Linux >= 3.18), which would pull /run/containerd, /var/lib/kubelet, ...
    from under the nodes of a cluster still running."""
    ours = os.stat("/proc/self/ns/mnt").st_ino
    targets, seen = set(BINDS.values()), {ours}
    used: set[str] = set()
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # a process gone meanwhile
            ino = os.stat(p / "ns" / "mnt").st_ino if p.name.isdigit() else ours
            if ino in seen:
                continue
            seen.add(ino)
            used |= {line.split()[4] for line in (p / "mountinfo").read_text().splitlines()} & targets
    return used


def _kill_where(match) -> int:
    killed = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if match(p):
                os.kill(int(p.name), signal.SIGKILL)
                killed += 1
    return killed


def in_cgroup(p: Path, root: str) -> bool:
    """Whether process folder `p` (/proc/PID) is in cgroup `root` or below, in any hierarchy."""
    return any(
        line.split(":", 2)[2].startswith(root + "/") or line.split(":", 2)[2] == root
        for line in (p / "cgroup").read_text().splitlines()
    )


def stop(lay: Layout, name: str) -> None:
    """Every process of the node goes (daemons, shims, containers), then its cgroups and network."""
    n = lay.node(name)
    ino = lay.mnt_ns.get(name)
    for _ in range(20):
        hit = _kill_where(lambda p: ino is not None and os.stat(p / "ns" / "mnt").st_ino == ino)
        hit += _kill_where(lambda p: in_cgroup(p, n.cgroup_root))
        if not hit:
            break
        time.sleep(0.3)
    for h in hierarchies():
        top = h / n.cgroup_root.lstrip("/")
        if top.exists():
            for d in sorted((x for x in top.rglob("*") if x.is_dir()), key=lambda x: -len(x.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
    sh("ip", "route", "del", n.pod_cidr, check=False)
    sh("ip", "link", "del", n.veth, check=False)
    sh("ip", "netns", "del", n.ns, check=False)
