"""Multi-node jobs without running one: re-addressing real image files, joining ranks into jobs,
planning a move (maps, cuts, redirects, refusals), the agent's redirect bookkeeping, and the
nftables rule sets in a network namespace of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from criuctl.agent.redirects import parse_rules
from criuctl.client import agents, jobmove, jobs
from criuctl.net import readdress
from criuctl.net.peers import Endpoints
from tests.requirements import needs

A, B, C = "10.9.0.2", "10.9.0.3", "10.9.0.4"


def _files_img(path, sockets: list[tuple[int, str, int, str, int]]) -> None:
    """A files.img with one inet socket per (family, src, sport, dst, dport), as CRIU writes it."""
    import pycriu

    entries = []
    for i, (family, src, sport, dst, dport) in enumerate(sockets, 1):
        isk = {
            "id": i,
            "ino": 1000 + i,
            "family": family,
            "type": 1,
            "proto": 6,
            "state": 1,
            "src_port": sport,
            "dst_port": dport,
            "flags": 2,
            "backlog": 0,
            "src_addr": readdress._encode(src),
            "dst_addr": readdress._encode(dst),
            "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
            "opts": {
                "so_sndbuf": 1,
                "so_rcvbuf": 1,
                "so_snd_tmo_sec": 0,
                "so_snd_tmo_usec": 0,
                "so_rcv_tmo_sec": 0,
                "so_rcv_tmo_usec": 0,
            },
        }
        entries.append({"type": "INETSK", "id": i, "isk": isk})
    with open(path, "wb") as f:
        pycriu.images.dump({"magic": "FILES", "entries": entries}, f)


def _sockets(path) -> list[tuple[str, int, str, int]]:
    import pycriu

    with open(path, "rb") as f:
        img = pycriu.images.load(f)
    isks = [e["isk"] for e in img["entries"]]
    return [
        (readdress._decode(k["src_addr"]), k["src_port"], readdress._decode(k["dst_addr"]), k["dst_port"])
        for k in isks
    ]


@needs("pycriu")
def test_readdress_moves_only_the_moved_endpoints(tmp_path):
    img = tmp_path / "files.img"
    _files_img(
        img,
        [
            (2, B, 40000, A, 29500),  # the moved rank's connection to the store on a
            (10, f"::ffff:{B}", 41000, f"::ffff:{C}", 50000),  # a dual-stack socket, v4-mapped
            (2, "0.0.0.0", 45000, "0.0.0.0", 0),  # a wildcard listener: stays
            (2, A, 29500, B, 40000),  # the store's side of the same connection (its rank stays)
        ],
    )
    moves = readdress.EndpointMap.from_json([[B, 40000, C], [B, 41000, C]])
    assert readdress.apply(tmp_path, moves) == 3
    got = _sockets(img)
    assert got[0] == (C, 40000, A, 29500)
    assert (
        readdress.canonical(got[1][0]) == C
        and got[1][0].startswith("::ffff:")
        and readdress.canonical(got[1][2]) == C
    )
    assert got[2] == ("0.0.0.0", 45000, "0.0.0.0", 0)
    assert got[3] == (A, 29500, C, 40000)
    assert readdress.apply(tmp_path, moves) == 0  # idempotent: nothing left at the old address


@pytest.mark.parametrize("raw", [{}, [["x", 1, C]], [[B, 0, C]], [[B, "1", C]], [[B, 1]], [[B, 1, "host"]]])
def test_endpoint_map_refuses_anything_else(raw):
    with pytest.raises(ValueError):
        readdress.EndpointMap.from_json(raw)


def _rank(node: str, name: str, conns, listening=()) -> jobs.Rank:
    return jobs.Rank(node, name, Endpoints(list(listening), list(conns)))


def _ddp() -> list[jobs.Rank]:
    """rank 0 on a (store on 29500, its own client), rank 1 on b, rank 2 on c; gloo pairs."""
    return [
        _rank(
            "a",
            "ddp-0",
            [
                (A, 29500, B, 40001),
                (A, 29500, C, 40002),
                (A, 40000, A, 29500),
                (A, 29500, A, 40000),
                (A, 50000, B, 51000),
                (A, 50001, C, 52000),
            ],
            [("0.0.0.0", 29500), (A, 49000)],
        ),
        _rank("b", "ddp-1", [(B, 40001, A, 29500), (B, 51000, A, 50000), (B, 51001, C, 52001)], [(B, 49001)]),
        _rank("c", "ddp-2", [(C, 40002, A, 29500), (C, 52000, A, 50001), (C, 52001, B, 51001)], [(C, 49002)]),
        _rank("a", "other", []),
    ]


def test_ranks_join_into_jobs_by_their_connections():
    found = jobs.group(_ddp())
    ddp = next(j for j in found if len(j.ranks) > 1)
    assert ddp.name == "ddp" and sorted(r.workload for r in ddp.ranks) == ["ddp-0", "ddp-1", "ddp-2"]
    assert not ddp.foreign
    assert [j.name for j in found if len(j.ranks) == 1] == ["other"]
    lone = jobs.group([_rank("a", "talker", [(A, 1234, "10.9.9.9", 5432)])])[0]
    assert [link.conn[2] for link in lone.foreign] == ["10.9.9.9"]


def test_loopback_endpoints_are_per_node():
    """127.0.0.1:5000 on node a is not 127.0.0.1:5000 on node b."""
    found = jobs.group(
        [
            _rank("a", "x", [("127.0.0.1", 6000, "127.0.0.1", 5000)]),
            _rank("b", "y", [("127.0.0.1", 5000, "127.0.0.1", 6000)]),
        ]
    )
    assert len(found) == 2 and all(j.foreign for j in found)


@pytest.fixture
def nodes(state_dir):
    state_dir.mkdir(parents=True, exist_ok=True)
    token = state_dir / "t"
    token.write_text("x" * 32)
    token.chmod(0o600)
    for name, addr in (("a", A), ("b", B), ("c", C), ("d", "10.9.0.5")):
        agents.add_node(agents.Node(name, f"http://{addr}:7070", str(token)))


def test_plan_maps_cuts_and_redirects(nodes):
    job = next(j for j in jobs.group(_ddp()) if len(j.ranks) > 1)
    p = jobmove.plan(job, {"ddp-1": "d"})
    d = "10.9.0.5"
    assert p.endpoints.moves == {(B, 40001): d, (B, 51000): d, (B, 51001): d, (B, 49001): d}
    (move,) = p.moves
    assert move.old == B and move.new == d
    assert sorted(map(tuple, move.cut)) == [(d, 40001, A, 29500), (d, 51000, A, 50000), (d, 51001, C, 52001)]
    rules = {r.node.name: sorted(map(tuple, r.rules)) for r in p.redirects}
    assert rules == {"a": [(A, 29500, B, 40001, d), (A, 50000, B, 51000, d)], "c": [(C, 52001, B, 51001, d)]}
    # the staying ranks' connections to it, braced before the freeze (criuctl.net.rto)
    braced = {(b.node.name, b.workload): sorted(map(tuple, b.connections)) for b in p.braces}
    assert braced == {
        ("a", "ddp-0"): [(A, 29500, B, 40001), (A, 50000, B, 51000)],
        ("c", "ddp-2"): [(C, 52001, B, 51001)],
    }
    both = jobmove.plan(job, {"ddp-1": "d", "ddp-2": "b"})  # a connection between two moved ranks
    m2 = next(m for m in both.moves if m.rank.workload == "ddp-2")
    assert [d, 51001, B, 52001] in both.moves[0].cut and [B, 52001, d, 51001] in m2.cut
    assert {r.node.name for r in both.redirects} == {"a"}  # only rank 0 stays
    assert [b.workload for b in both.braces] == ["ddp-0"]


def test_plan_refusals_are_one_line(nodes):
    job = next(j for j in jobs.group(_ddp()) if len(j.ranks) > 1)
    with pytest.raises(jobmove.MigrationFailed, match="not a rank of job ddp"):
        jobmove.plan(job, {"nosuch": "d"})
    with pytest.raises(agents.UnknownNode):
        jobmove.plan(job, {"ddp-1": "zz"})
    with pytest.raises(jobmove.MigrationFailed, match="already runs on node b"):
        jobmove.plan(job, {"ddp-1": "b"})
    with pytest.raises(jobmove.MigrationFailed, match=r"node d \(http://10\.9\.0\.5:7070\) did not answer"):
        jobmove.plan(job, {"ddp-1": "d"}, silent=["d"])
    foreign = jobs.group([_rank("a", "talker", [(A, 1234, "10.9.9.9", 5432)])])[0]
    with pytest.raises(jobmove.MigrationFailed, match=r"10\.9\.9\.9:5432, which is not a criuctl workload"):
        jobmove.plan(foreign, {"talker": "b"})
    pair = jobs.group(
        [
            _rank("a", "x", [("127.0.0.1", 6000, "127.0.0.1", 5000), (A, 1, B, 2)]),
            _rank("a", "y", [("127.0.0.1", 5000, "127.0.0.1", 6000)]),
            _rank("b", "z", [(B, 2, A, 1)]),
        ]
    )
    with pytest.raises(jobmove.MigrationFailed, match="talk over loopback"):
        jobmove.plan(next(j for j in pair if len(j.ranks) == 3), {"x": "c"})


@pytest.mark.parametrize("raw", [None, [], [[A, 1, B, 2]], [[A, 1, B, 2, "::1"]], [[A, 0, B, 2, C]], "x"])
def test_redirect_rules_refuse_anything_else(raw):
    with pytest.raises((ValueError, TypeError)):
        parse_rules(raw)


NETNS_SCRIPT = """
import json, sys
from criuctl.net import netcut
netcut.cut("t1", [("10.9.0.4", 40001, "10.9.0.2", 29500)])
netcut.cut("t1", [("10.9.0.4", 40001, "10.9.0.2", 29500)])  # asked again: the same rules, once
netcut.redirect("r1", [("10.9.0.2", 29500, "10.9.0.3", 40001, "10.9.0.4")])
netcut.redirect("r2", [("10.9.0.2", 29500, "10.9.0.4", 40001, "10.9.0.5")])
out = {"cut": netcut.tables(netcut.CUT), "nat": netcut.tables(netcut.NAT)}
from criuctl.net.netlock import Nft
with Nft() as nft:
    out["ruleset"] = nft.run("list ruleset")[1]
out["removed"] = [netcut.remove(t) for t in ("criuctl-cut-t1", "criuctl-nat-r1", "criuctl-nat-r1")]
out["left"] = netcut.tables(netcut.NAT)
print(json.dumps(out))
"""


@needs("util-linux")
def test_rule_sets_in_a_network_namespace_of_their_own():
    r = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", NETNS_SCRIPT], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cut"] == ["criuctl-cut-t1"] and out["nat"] == ["criuctl-nat-r1", "criuctl-nat-r2"]
    rules = out["ruleset"]
    assert "ip daddr set 10.9.0.4" in rules and "ip saddr set 10.9.0.3" in rules
    assert rules.count(" drop") == 2, rules  # the cut's two rules, not doubled by its second call
    # the second redirect acts after the first on the way out, before it on the way in
    assert "type route hook output priority mangle + 1" in rules and "mangle + 2" in rules
    assert "priority raw - 1" in rules and "priority raw - 2" in rules
    assert out["removed"] == [True, True, False] and out["left"] == ["criuctl-nat-r2"]
    with pytest.raises(ValueError):
        from criuctl.net import netcut

        netcut.remove("CRIU-123")


def test_a_rank_listening_on_another_address_of_its_node_takes_that_endpoint_along(nodes):
    """Rank 1 also listens on a second address of its node (as a rank moved once does on its new
    node's own address, its connections keeping their first one), and rank 0 reaches it there: that
    endpoint moves with rank 1 and rank 0's node redirects it (it was a KeyError traceback, seen in
    CI on a rank's second move)."""
    ranks = _ddp()
    ranks[1].tcp.listening.append(("10.9.0.99", 49555))
    ranks[0].tcp.connections.append((A, 50009, "10.9.0.99", 49555))
    job = next(j for j in jobs.group(ranks) if len(j.ranks) > 1)
    p = jobmove.plan(job, {"ddp-1": "d"})
    d = "10.9.0.5"
    assert p.endpoints.moves[("10.9.0.99", 49555)] == d
    rules = {r.node.name: sorted(map(tuple, r.rules)) for r in p.redirects}
    assert (A, 50009, "10.9.0.99", 49555, d) in rules["a"]


POD_SCRIPT = """
import socket, subprocess, sys, time
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
s = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(s.getsockname())
a, _ = s.accept()
six = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
print(s.getsockname()[1], c.getsockname()[1], six.getsockname()[1], flush=True)
time.sleep(60)
"""


@needs("util-linux")
def test_endpoints_are_read_in_the_workloads_own_network_namespace():
    """A pod's process has its own network namespace: its sockets are in that namespace's table,
    never in the agent's (psutil reads the agent's, and saw nothing of a pod)."""
    from criuctl.net import peers

    p = subprocess.Popen(
        ["unshare", "--net", sys.executable, "-c", POD_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        listen, client, six = map(int, p.stdout.readline().split())
        ends = peers.of_tree(p.pid)
        assert ends.listening == sorted([("127.0.0.1", listen), ("::", six)])
        assert ends.connections == sorted(
            [("127.0.0.1", client, "127.0.0.1", listen), ("127.0.0.1", listen, "127.0.0.1", client)]
        )
        # none of them is in this process's namespace
        assert not [s for s in peers.sockets([os.getpid()]) if s.local[1] in (listen, client, six)]
    finally:
        p.kill()
        p.wait()


@needs("pycriu")
def test_a_restore_readdresses_a_copy_and_leaves_the_verified_images_alone(tmp_path):
    """A pod's rank is re-addressed where it is restored: on a copy of files.img beside hard links
    to the other images, so the bundle stays as signed (a fallback restore elsewhere reads it again)."""
    from criuctl.local import restoring

    images, work = tmp_path / "images", tmp_path / "work"
    images.mkdir()
    work.mkdir()
    _files_img(images / "files.img", [(2, B, 40000, A, 29500)])
    (images / "pages-1.img").write_bytes(b"\0" * 4096)
    original = (images / "files.img").read_bytes()
    out = restoring._readdressed(images, work, readdress.EndpointMap.from_json([[B, 40000, C]]))
    assert _sockets(out / "files.img") == [(C, 40000, A, 29500)]
    assert (images / "files.img").read_bytes() == original, "the verified image was changed"
    assert os.path.samefile(out / "pages-1.img", images / "pages-1.img")
    assert not (out / "pages-1.img").is_symlink()  # CRIU opens some images in the restored mount ns


@needs("util-linux")
def test_rules_go_into_another_processs_network_namespace():
    """A pod's cut and redirects are made in the pod's namespace (a forked child enters it), never
    in the caller's, and are listed and removed there."""
    from criuctl.net import netcut

    p = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        time.sleep(0.3)
        ours = set(netcut.tables(netcut.CUT))
        assert netcut.cut("podcut", [("10.9.0.4", 40001, "10.9.0.2", 29500)], p.pid) == "criuctl-cut-podcut"
        netcut.redirect("podnat", [("10.9.0.2", 29500, "10.9.0.3", 40001, "10.9.0.4")], p.pid)
        assert netcut.tables(netcut.CUT, p.pid) == ["criuctl-cut-podcut"]
        assert netcut.tables(netcut.NAT, p.pid) == ["criuctl-nat-podnat"]
        assert set(netcut.tables(netcut.CUT)) == ours, "a rule went into the caller's namespace"
        assert netcut.remove("criuctl-cut-podcut", p.pid) is True
        assert netcut.tables(netcut.CUT, p.pid) == []
    finally:
        p.kill()
        p.wait()
    from criuctl.net import netns

    with pytest.raises(netns.NetnsError, match="network namespace cannot be opened"):
        netcut.tables(netcut.CUT, p.pid)


@needs("util-linux")
def test_a_pods_addresses_are_read_from_its_own_namespace():
    """What a rank is re-addressed to before the kubelet writes the pod's IP (criuctl.kube.successors):
    the pod namespace's own addresses, from its /proc, never loopback nor link-local, never the
    caller's; none once the process is gone."""
    from criuctl.net import netns

    script = (
        "ip link add p0 type veth peer name p1 && ip link set p1 up && ip link set lo up && "
        "ip link set p0 up && "
        "ip addr add 10.9.0.7/24 dev p0 && ip addr add fd00:9::7/64 dev p0 nodad && echo up && sleep 60"
    )
    p = subprocess.Popen(["unshare", "--net", "sh", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert sorted(netns.addresses(p.pid)) == ["10.9.0.7", "fd00:9::7"]
        assert not set(netns.addresses(os.getpid())) & {"10.9.0.7", "fd00:9::7"}
    finally:
        p.kill()
        p.wait()
    assert netns.addresses(p.pid) == []


@needs("util-linux")
def test_a_socket_made_in_a_pods_namespace_listens_there_and_a_taken_port_is_said():
    """The preStop hook's listener in a pod (criuctl.kube.nodeside.PodHooks): made in the pod's
    namespace by a forked child, served from here; reachable in the pod, not in the caller's
    namespace; a port a process of the pod holds is PortTaken, in one line."""
    import socket

    from criuctl.net import netns

    script = "ip link set lo up && echo up && sleep 60"
    p = subprocess.Popen(["unshare", "--net", "sh", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        sock = netns.listen_in(p.pid, 7391)
        try:
            inside = ["nsenter", f"--net=/proc/{p.pid}/ns/net", sys.executable, "-c"]
            probe = "import socket; socket.create_connection(('127.0.0.1', 7391), 2); print('ok')"
            got = subprocess.run([*inside, probe], capture_output=True, text=True, timeout=30)
            assert got.stdout.strip() == "ok", got.stderr
            conn, _ = (sock.setblocking(True), sock.accept())[1]
            conn.close()
            with pytest.raises(OSError), socket.create_connection(("127.0.0.1", 7391), 1):
                pass  # the caller's own namespace has no such listener
            with pytest.raises(netns.PortTaken, match=r"port 7391 .* is taken"):
                netns.listen_in(p.pid, 7391)
        finally:
            sock.close()
    finally:
        p.kill()
        p.wait()
    with pytest.raises(netns.NetnsError, match="cannot be opened"):
        netns.listen_in(p.pid, 7391)
