"""`scripts/local-cluster`: two clusters side by side (a test's and a user's, each with its own --dir
and --net), and its options checked in one line.

The option tests run the real CLI (`scripts/local-cluster`) and start nothing: each input is
refused before anything starts. The slow test starts a user's cluster through the CLI next to the
session's `local_cluster` and takes it down again while the other keeps working.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from localcluster.layout import BUSYBOX, Layout
from localcluster.node import BINDS, binds_in_use

from tests.cluster import _free_subnet, sh
from tests.conftest import needs_criu
from tests.kube import Kubectl
from tests.requirements import needs

REPO = Path(__file__).resolve().parent.parent


def local_cluster_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "scripts" / "local-cluster"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_one_line(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("local-cluster: ") and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """A --dir that holds a cluster (for `up`, and for `demo` in DIR/demo): should a check below ever
    let a bad option through, `up` still refuses the dir, and no test here starts a cluster."""
    for d in (tmp_path, tmp_path / "demo"):
        Layout(d).save()
    return tmp_path


@pytest.mark.parametrize("net", ["10.300.0", "10.0.0", "10.96.0", "10.5.1", "192.168.1", "10.5.0.0/24", "x"])
def test_a_bad_net_is_refused_in_one_line(recorded: Path, net: str) -> None:
    for verb in ("up", "demo"):
        r = local_cluster_cli(verb, "--dir", str(recorded), "--net", net)
        assert_one_line(r, 2, f"--net {net!r}", "10.N.0", "--net 10.201.0")


@pytest.mark.parametrize("verb", ["down", "status"])
def test_net_is_refused_where_the_dir_names_the_cluster(tmp_path: Path, verb: str) -> None:
    r = local_cluster_cli(verb, "--dir", str(tmp_path), "--net", "10.201.0")
    assert_one_line(r, 2, "--net is for up and demo", "--dir")


@pytest.mark.parametrize("nodes", ["a,a", "A,b", "a,,b", "averyverylongname,b", "a;b"])
def test_bad_node_names_are_refused_in_one_line(recorded: Path, nodes: str) -> None:
    r = local_cluster_cli("up", "--dir", str(recorded), "--nodes", nodes)
    assert_one_line(r, 2, "--nodes", "e.g. --nodes a,b")


def test_two_clusters_share_no_name_with_the_host() -> None:
    """Everything a cluster shares with the host is named from its net: two nets, no common name."""

    def names(lay: Layout) -> set[str]:
        out = {lay.bridge, lay.host_ip, lay.etcd_url, lay.etcd_peer_url}
        for n in map(lay.node, lay.nodes):
            out |= {n.ns, n.veth, n.ip, n.pod_cidr, n.cgroup_root}
        return out

    user = Layout(Path("/var/lib/criuctl-local-cluster"))
    test = Layout(Path("/tmp/t"), net="10.100.0")
    assert not names(user) & names(test), names(user) & names(test)
    assert (user.prefix, test.prefix) == ("k200", "k100")
    assert test.etcd_url.startswith("http://127.100.0.1:")  # loopback only, as before
    assert max(len(lay.node(n).veth) for lay in (user, test) for n in lay.nodes) <= 15  # IFNAMSIZ
    assert Layout(Path("/x"), prefix="kb", net="10.201.0").prefix == "kb"  # an explicit one stays


@pytest.fixture
def routed_net():
    """A free 10.N.0/24, routed here by a bridge named as that net's cluster bridge would be."""
    net = _free_subnet(31)
    link = Layout(Path("/nonexistent"), net=net).bridge
    sh("ip", "link", "add", link, "type", "bridge")
    try:
        sh("ip", "addr", "add", f"{net}.1/24", "dev", link)
        sh("ip", "link", "set", link, "up")
        yield net, link
    finally:
        sh("ip", "link", "del", link, check=False)


@needs("root", "kubernetes")
def test_a_taken_net_is_refused_and_left_alone(tmp_path: Path, routed_net) -> None:
    """`up` and `demo` say which option to pass, and start (and take down) nothing: the demo's own
    clean-up must not remove what holds the net, though its name is the one the demo's bridge has."""
    net, link = routed_net
    for verb in ("up", "demo"):
        r = local_cluster_cli(verb, "--dir", str(tmp_path / "c"), "--net", net)
        assert_one_line(r, 1, f"{net}.0/24 is already routed here", "pass --net 10.N.0 with a free N")
        assert sh("ip", "link", "show", link, check=False).returncode == 0, f"{verb} removed {link}"
    assert not (tmp_path / "c").exists()


@needs("root", "kubernetes")
def test_a_dir_holding_a_cluster_is_refused(recorded: Path) -> None:
    r = local_cluster_cli("up", "--dir", str(recorded), "--net", _free_subnet(57))
    assert_one_line(
        r, 1, f"already recorded in {recorded}", f"down --dir {recorded}", "its own --dir and --net"
    )
    assert json.loads((recorded / "state.json").read_text())["pids"] == {}


@needs("root", "util-linux")
def test_down_sees_the_folders_a_node_of_another_cluster_has_mounts_on(tmp_path: Path) -> None:
    """`down` must not remove such a folder on the host: that would detach the other node's mount."""
    target = next((t for t in BINDS.values() if os.path.isdir(t)), "/run/containerd")
    created = not os.path.isdir(target)
    script = f"mkdir -p {target} && mount --bind {tmp_path} {target} && echo bound && exec sleep 60"
    node = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "bound"
        assert target in binds_in_use()
    finally:
        node.kill()
        node.wait()
        if created and target not in binds_in_use():  # a cluster started meanwhile may use it
            os.rmdir(target)


def _mount_points(pid: int) -> set[str]:
    return {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}


@needs_criu
@pytest.mark.slow
def test_a_users_cluster_beside_the_tests(local_cluster, tmp_path: Path) -> None:
    """A user's cluster (the CLI, its own --dir and --net) beside the session's: both work, each with
    its own API server and data, and taking one down leaves the other whole (its nodes' mounts, a new
    pod runs)."""
    test_lay, test_k = local_cluster
    user_dir, net = tmp_path / "user", _free_subnet(11)
    r = local_cluster_cli("up", "--dir", str(user_dir), "--net", net)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        user_lay = Layout.load(user_dir)
        assert (user_lay.net, user_lay.api_url) == (net, f"https://{net}.1:6443")
        user_k = Kubectl(user_lay)
        for k in (user_k, test_k):
            ready = json.loads(k("get", "nodes", "-o", "json").stdout)["items"]
            assert sorted(n["metadata"]["name"] for n in ready) == ["a", "b"]
        # two API servers, two etcds: what one is told, the other never hears of
        user_k("create", "namespace", "only-in-users")
        assert test_k("get", "namespace", "only-in-users", check=False).returncode != 0
        status = local_cluster_cli("status", "--dir", str(user_dir))
        assert status.returncode == 0 and "DOWN" not in status.stdout, status.stdout
    finally:
        down = local_cluster_cli("down", "--dir", str(user_dir))
    assert down.returncode == 0, down.stderr
    assert sh("ip", "route", "show", f"{net}.0/24").stdout.strip() == ""
    # the test's nodes keep every folder bound over the host's paths, and run a new pod
    for name in test_lay.nodes:
        kubelet = test_lay.pids[f"node-{name}"]
        assert set(BINDS.values()) <= _mount_points(kubelet), f"node {name} lost its binds"
    sleeper = {"name": "s", "image": BUSYBOX, "imagePullPolicy": "Never", "command": ["sleep", "600"]}
    spec = {"nodeName": "b", "terminationGracePeriodSeconds": 1, "containers": [sleeper]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "after-the-other-went"}, "spec": spec}
    test_k.apply(pod)
    try:
        test_k.wait_running("after-the-other-went")
    finally:
        test_k("delete", "pod", "after-the-other-went", "--wait=false", check=False)


def test_the_dns_stand_in_serves_what_corednss_kubernetes_plugin_does() -> None:
    from localcluster import dns

    services = [
        {"metadata": {"namespace": "ml", "name": "web"}, "spec": {"clusterIP": "10.96.0.7"}},
        {"metadata": {"namespace": "ml", "name": "ddp-master-0"}, "spec": {"clusterIP": "None"}},
        {"metadata": {"namespace": "ml", "name": "tj"}, "spec": {"clusterIP": "None"}},
    ]
    endpoints = [
        {
            "metadata": {"namespace": "ml", "name": "ddp-master-0"},
            "subsets": [{"addresses": [{"ip": "10.1.100.4"}]}],
        },
        {
            "metadata": {"namespace": "ml", "name": "tj"},
            "subsets": [
                {
                    "addresses": [{"ip": "10.1.101.5", "hostname": "tj-node-0-0"}],
                    "notReadyAddresses": [{"ip": "10.1.101.9"}],
                }
            ],
        },
        {"metadata": {"namespace": "ml", "name": "web"}, "subsets": [{"addresses": [{"ip": "10.1.100.8"}]}]},
    ]
    pods = [
        {"metadata": {"namespace": "ml"}, "spec": {}, "status": {"podIP": "10.1.100.4"}},
        {
            "metadata": {"namespace": "kube-system"},
            "spec": {"hostNetwork": True},
            "status": {"podIP": "10.1.0.2"},
        },
    ]
    recs = dns.records(services, endpoints, pods)
    assert recs == {
        "web.ml.svc.cluster.local": {"10.96.0.7"},  # a Service with a cluster IP: that IP only
        "ddp-master-0.ml.svc.cluster.local": {"10.1.100.4"},  # headless: its ready pods
        "tj.ml.svc.cluster.local": {"10.1.101.5"},
        "tj-node-0-0.tj.ml.svc.cluster.local": {"10.1.101.5"},  # hostname + subdomain (JobSet's pods)
        "10-1-100-4.ml.pod.cluster.local": {"10.1.100.4"},
    }
    assert dns.hosts_text(recs).splitlines()[0] == "10.1.100.4 10-1-100-4.ml.pod.cluster.local"
