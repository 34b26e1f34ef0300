"""`scripts/local-cluster up|down|status|demo` (see the package docstring)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from localcluster import addons, control, node, pki, pytorchjob
from localcluster.layout import (
    DEFAULT_DIR,
    K8S_BIN,
    REPO,
    ClusterError,
    Layout,
    parse_net,
    parse_nodes,
    sh,
)

UP_NET, DEMO_NET = "10.200.0", "10.202.0"  # the defaults: `demo` runs beside a cluster `up` started

KUBE_PARTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd")


def kubectl(lay: Layout, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("kubectl", "--kubeconfig", str(lay.kubeconfig), *args, check=check)


def _wait(what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")


def _nodes_ready(lay: Layout) -> bool:
    out = kubectl(lay, "get", "nodes", "-o", "json", check=False).stdout
    if not out:
        return False
    ready = {
        n["metadata"]["name"]
        for n in json.loads(out)["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
    }
    return ready >= set(lay.nodes)


def _agents_ready(lay: Layout) -> bool:
    out = kubectl(lay, "-n", "criuctl-system", "get", "pods", "-o", "json", check=False).stdout
    if not out:
        return False
    ready = {
        p["spec"].get("nodeName")
        for p in json.loads(out)["items"]
        if p["metadata"]["name"].startswith("criuctl-agent")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    }
    return ready >= set(lay.nodes)


def _webhook_ready(lay: Layout) -> bool:
    """The webhook's Deployment has every replica ready and its Service names them: the API server
    calls the Service's endpoints, so admissions are wrapped from now on."""
    ns = ("-n", "criuctl-system", "get")
    dep = kubectl(lay, *ns, "deployment", "criuctl-webhook", "-o", "json", check=False)
    ep = kubectl(lay, *ns, "endpoints", "criuctl-webhook", "-o", "json", check=False)
    if not dep.stdout or not ep.stdout:
        return False
    want = json.loads(dep.stdout)["spec"]["replicas"]
    ready = json.loads(dep.stdout).get("status", {}).get("readyReplicas", 0)
    addresses = sum(len(s.get("addresses", [])) for s in json.loads(ep.stdout).get("subsets") or [])
    return ready == want and addresses == want


def _controller_leading(lay: Layout) -> bool:
    """Every controller replica Ready, and the Lease held by one of them."""
    ns = ("-n", "criuctl-system", "get")
    dep = kubectl(lay, *ns, "deployment", "criuctl-controller", "-o", "json", check=False)
    lease = kubectl(lay, *ns, "lease", "criuctl-controller", "-o", "json", check=False)
    if not dep.stdout or not lease.stdout:
        return False
    d = json.loads(dep.stdout)
    holder = json.loads(lease.stdout).get("spec", {}).get("holderIdentity") or ""
    return d.get("status", {}).get("readyReplicas", 0) == d["spec"]["replicas"] and bool(holder)


class Taken(ClusterError):
    """`up` refused before starting anything: its dir or net belongs to another cluster (or to the
    machine), which must not be taken down on the way out."""


def check_free(lay: Layout) -> None:
    """Taken unless `lay`'s dir and net are free. Two clusters on one net would share names (see
    Layout), so a net already routed here is refused, whoever routes it."""
    if (lay.dir / "state.json").exists():
        raise Taken(
            f"a local cluster is already recorded in {lay.dir}: take it down first "
            f"(scripts/local-cluster down --dir {lay.dir}), or give another cluster its own --dir and --net"
        )
    if sh("ip", "route", "show", f"{lay.net}.0/24").stdout.strip():
        raise Taken(
            f"{lay.net}.0/24 is already routed here (another local cluster, or a network of this machine): "
            "pass --net 10.N.0 with a free N, and its own --dir"
        )


def up(lay: Layout) -> Layout:
    if not all((K8S_BIN / b).exists() for b in ("kube-apiserver", "kubelet", "kube-proxy")):
        subprocess.run(["bash", str(REPO / "scripts" / "install-kubernetes.sh")], check=True)
    check_free(lay)
    lay.dir.mkdir(parents=True, exist_ok=True)
    lay.dir.chmod(0o700)
    lay.save()
    sh("ip", "link", "add", lay.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{lay.host_ip}/24", "dev", lay.bridge)
    sh("ip", "link", "set", lay.bridge, "up")
    tokens = pki.make(lay)
    pki.kubeconfig(lay, lay.kubeconfig, tokens["admin"])
    for user in ("migrator", "outsider"):
        pki.kubeconfig(lay, lay.dir / f"{user}.kubeconfig", tokens[user])
    for part in ("kube-scheduler", "kube-controller-manager"):
        pki.kubeconfig(lay, lay.dir / f"{part}.kubeconfig", tokens[part])
    control.start(lay, tokens)
    # no CoreDNS in Debian: dnsmasq fed from the API (localcluster.dns), the kubelets' clusterDNS
    control.spawn(
        lay,
        "dns-standin",
        [
            str(REPO / ".venv" / "bin" / "python"),
            "-m",
            "localcluster.dns",
            "--kubeconfig",
            str(lay.kubeconfig),
            "--listen",
            lay.host_ip,
            "--dir",
            str(lay.dir / "dns"),
        ],
        env={"PYTHONPATH": str(REPO / "tools"), "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"},
    )
    addons.agent_image(lay)
    for name in lay.nodes:
        node.start(lay, name, tokens[f"node-{name}"], tokens["kube-proxy"])
    node.pod_routes(lay)
    _wait("every node Ready", lambda: _nodes_ready(lay), 120)
    # the training operator and JobSet cannot run here: their stand-ins (localcluster.pytorchjob
    # and .trainjob, in one process; beside the package in tools/, not in it: hence its PYTHONPATH)
    pytorchjob.install_all(str(lay.kubeconfig))
    control.spawn(
        lay,
        "pytorchjob-standin",
        [
            str(REPO / ".venv" / "bin" / "python"),
            "-m",
            "localcluster.pytorchjob",
            "--kubeconfig",
            str(lay.kubeconfig),
        ],
        env={"PYTHONPATH": str(REPO / "tools")},
    )
    addons.apply(lay, addons.render(lay))
    _wait("criuctl's agent Ready on every node", lambda: _agents_ready(lay), 180)
    _wait("criuctl's webhook Ready and behind its Service", lambda: _webhook_ready(lay), 120)
    _wait("criuctl's controller Ready and leading", lambda: _controller_leading(lay), 120)
    return lay


def down(lay: Layout) -> None:
    for name in lay.nodes:
        node.stop(lay, name)
    for part, pid in lay.pids.items():
        if part.startswith("node-"):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    time.sleep(0.5)
    for pid in lay.pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    sh("ip", "link", "del", lay.bridge, check=False)
    in_use = node.binds_in_use()  # by the nodes of another cluster: theirs to remove
    for target in set(node.BINDS.values()) - in_use:  # folders `up` had to create on the host for its binds
        with contextlib.suppress(OSError):
            if Path(target).is_dir() and not any(Path(target).iterdir()):
                Path(target).rmdir()
    shutil.rmtree(lay.dir, ignore_errors=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked: ValueError with one line saying what is wrong and what to pass."""
    p = argparse.ArgumentParser(prog="local-cluster", description=__doc__)
    p.add_argument("verb", choices=("up", "down", "status", "demo"))
    p.add_argument("--out", type=Path, default=Path("criuctl-demo"), help="demo: where the plot goes")
    p.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"where everything lives (default {DEFAULT_DIR})"
    )
    p.add_argument("--nodes", default="a,b", help="up, demo: node names, comma-separated (default a,b)")
    p.add_argument(
        "--net",
        help=f"up, demo: the cluster's bridge 10.N.0 (default {UP_NET}, demo {DEMO_NET}); a second "
        "cluster beside another needs its own --net and --dir",
    )
    a = p.parse_args(argv)
    a.dir = a.dir.absolute()
    if a.net is not None and a.verb in ("down", "status"):
        raise ValueError(f"--net is for up and demo: {a.verb} finds the cluster by its --dir")
    a.net = parse_net(a.net) if a.net is not None else (DEMO_NET if a.verb == "demo" else UP_NET)
    a.nodes = parse_nodes(a.nodes)
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)
    except ValueError as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("local-cluster: must run as root", file=sys.stderr)
        return 2
    lay = Layout(a.dir / "demo" if a.verb == "demo" else a.dir, nodes=a.nodes, net=a.net)
    try:
        if a.verb == "demo":  # its own cluster, up and down around it
            from localcluster import demo

            check_free(lay)  # before the `finally`: a taken dir or net is another cluster's
            try:
                return demo.run(up(lay), a.out)
            finally:
                down(lay)
        if a.verb == "up":
            print(f"export KUBECONFIG={up(lay).kubeconfig}")
        elif not (a.dir / "state.json").exists():
            print(f"local-cluster: nothing recorded in {a.dir}", file=sys.stderr)
            return 0 if a.verb == "down" else 1
        elif a.verb == "down":
            down(Layout.load(a.dir))
        else:
            lay = Layout.load(a.dir)
            for part, pid in lay.pids.items():
                print(f"{part:28} {'up' if control.alive(pid) else 'DOWN'} (pid {pid})")
            print(f"export KUBECONFIG={lay.kubeconfig}")
    except Taken as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        return 1
    except ClusterError as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        print(
            f"local-cluster: logs in {lay.dir}/logs; `scripts/local-cluster down --dir {a.dir}` cleans up",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
