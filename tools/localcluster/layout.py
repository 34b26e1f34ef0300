"""Where the local cluster keeps everything, and its addresses: one dataclass every part reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("CRIUCTL_CACHE", "/usr/local/lib/criuctl"))
K8S_BIN = CACHE / "kubernetes-1.20.2" / "bin"
IMAGES = CACHE / "images"
REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_DIR = Path("/var/lib/criuctl-local-cluster")
BUSYBOX = "criuctl.test/busybox:1"
BUSYBOX_TAR = IMAGES / "busybox.tar"  # built by scripts/install-containerd.sh
AGENT_PORT = 7070
# What training pods of the local cluster mount read-only to run the host's Python and the project
# (a torch image would be gigabytes per node here); criuctl's own pods run the built image.
HOST_PYTHON = ("/usr", "/lib", "/lib64", "/root/.pyenv")


SERVICE_NET = "10.96.0"  # the API server's --service-cluster-ip-range (10.96.0.0/24)


class ClusterError(RuntimeError):
    """The local cluster could not be started or stopped; the message says what and where to look."""


def parse_net(text: str) -> str:
    """`--net 10.N.0`: the cluster's bridge /24 (its pods get 10.N.100+i.0/24). Everything of a cluster
    that the host shares is named from N (see Layout), so clusters on different nets never collide."""
    m = re.fullmatch(r"10\.(\d{1,3})\.0", text)
    if m is None or not 1 <= int(m[1]) <= 254 or text == SERVICE_NET:
        raise ValueError(
            f"--net {text[:40]!r} is not 10.N.0 with N from 1 to 254 (not {SERVICE_NET}, the Service range): "
            "pass e.g. --net 10.201.0"
        )
    return text


def parse_nodes(text: str) -> list[str]:
    """`--nodes a,b`: node names, which also name host network devices (at most 15 characters)."""
    names = text.split(",")
    bad = next((n for n in names if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", n)), None)
    if bad is not None or len(set(names)) != len(names):
        what = f"{bad[:20]!r} is not a node name" if bad is not None else "a node name repeats"
        raise ValueError(
            f"--nodes {text[:60]!r}: {what}: give distinct names of 1-8 lowercase letters and digits, "
            "starting with a letter, e.g. --nodes a,b"
        )
    return names


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()[-800:]}")
    return r


@dataclass
class NodeInfo:
    name: str
    index: int
    prefix: str  # names of this cluster's netns, links and cgroups begin with it
    net: str  # "10.N.0": the cluster bridge's /24

    @property
    def ns(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def veth(self) -> str:
        return f"{self.prefix}-{self.name}-h"

    @property
    def ip(self) -> str:
        return f"{self.net}.{10 + self.index}"

    @property
    def pod_cidr(self) -> str:
        a, b, _ = self.net.split(".")  # outside the bridge's /24, routed to the node
        return f"{a}.{b}.{100 + self.index}.0/24"

    @property
    def cgroup_root(self) -> str:
        return f"/{self.prefix}-{self.name}"


@dataclass
class Layout:
    """One cluster. What it shares with the host is named from its net's N: network namespaces, links
    and cgroup roots begin with `prefix` (k<N> unless given), etcd listens on 127.N.0.1, the API server
    on 10.N.0.1; the rest lives in `dir` or, per node, in the node's namespaces. So two
    clusters on different nets (and dirs) run side by side; `up` refuses a net already routed here."""

    dir: Path
    nodes: list[str] = field(default_factory=lambda: ["a", "b"])
    prefix: str = ""
    net: str = "10.200.0"
    api_port: int = 6443
    etcd_port: int = 23790
    agent_lease: float = 20.0  # the agents' --lease (seconds a frozen source waits for its client)
    # the agent image `up` built (or found built) from the Dockerfile: its reference as the pods name
    # it, its ID (the config digest the runtime reports) and the archive the nodes import
    agent_image: str = ""
    agent_image_id: str = ""
    agent_archive: str = ""
    pids: dict[str, int] = field(default_factory=dict)  # part → PID of its process (group leader)
    mnt_ns: dict[str, int] = field(default_factory=dict)  # node → inode of its mount namespace

    def __post_init__(self) -> None:
        self.prefix = self.prefix or f"k{self.n}"

    @property
    def n(self) -> str:
        """N of the cluster's 10.N.0 net: what keeps its names and loopback addresses its own."""
        return self.net.split(".")[1]

    @property
    def etcd_url(self) -> str:
        """Loopback only (nothing but the API server may reach it), an address of this cluster's own."""
        return f"http://127.{self.n}.0.1:{self.etcd_port}"

    @property
    def etcd_peer_url(self) -> str:
        return f"http://127.{self.n}.0.1:{self.etcd_port + 10}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def host_ip(self) -> str:
        return f"{self.net}.1"

    @property
    def api_url(self) -> str:
        return f"https://{self.host_ip}:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    def node(self, name: str) -> NodeInfo:
        return NodeInfo(name, self.nodes.index(name), self.prefix, self.net)

    def node_dir(self, name: str) -> Path:
        return self.dir / "nodes" / name

    def node_socket(self, name: str) -> Path:
        """The node's containerd socket as the host sees it (its /run/containerd, bound)."""
        return self.node_dir(name) / "run-containerd" / "containerd.sock"

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        d = asdict(self)
        d["dir"] = str(self.dir)
        (self.dir / "state.json").write_text(json.dumps(d, indent=1))

    @classmethod
    def load(cls, directory: Path) -> Layout:
        d = json.loads((directory / "state.json").read_text())
        d["dir"] = Path(d["dir"])
        return cls(**d)
