"""Where the local cluster keeps everything, and its addresses: one dataclass every part reads."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("CRIUCTL_CACHE", "/usr/local/lib/criuctl"))
K8S_BIN = CACHE / "kubernetes-1.20.2" / "bin"
IMAGES = CACHE / "images"
REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_DIR = Path("/var/lib/criuctl-local-cluster")
BUSYBOX = "criuctl.test/busybox:1"
AGENT_IMAGE = "criuctl.local/agent:dev"
AGENT_PORT = 7070
# What pods of the local cluster mount read-only to run the host's Python and the project.
HOST_PYTHON = ("/usr", "/lib", "/lib64", "/root/.pyenv")


class ClusterError(RuntimeError):
    """The local cluster could not be started or stopped; the message says what and where to look."""


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
    dir: Path
    nodes: list[str] = field(default_factory=lambda: ["a", "b"])
    prefix: str = "ck"
    net: str = "10.200.0"
    api_port: int = 6443
    etcd_port: int = 23790
    webhook_port: int = 9443
    agent_lease: float = 20.0  # the agents' --lease (seconds a frozen source waits for its client)
    pids: dict[str, int] = field(default_factory=dict)  # part → PID of its process (group leader)
    mnt_ns: dict[str, int] = field(default_factory=dict)  # node → inode of its mount namespace

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
