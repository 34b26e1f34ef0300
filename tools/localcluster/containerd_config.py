"""containerd configurations: test nodes (format 2 for Debian 12's 1.6, format 3 for 2.x) and the
local cluster's kubelet nodes (format 2 at the standard paths, with CNI).

Standard library only (tests/test_cri_archive.py imports it before knowing the CRI stubs exist).
Every setting is one /work/shared/design.md §2 found necessary here: own root, state and sockets;
`restrict_oom_score_adj` (root lacks CAP_SYS_RESOURCE), no AppArmor, network namespaces under the
state dir, empty CNI folders (pods use the node's network), runc v2 with cgroupfs and its own root.
"""

from __future__ import annotations

from pathlib import Path


def _runc(plugin: str, root: Path, criu: str | None, systemd: bool = False) -> str:
    """The runc runtime section under `plugin` (the CRI plugin's name differs between formats).
    `systemd`: runc's systemd cgroup driver (every kubeadm and managed node's default on cgroup v2),
    which asks systemd over D-Bus for a scope per container; needs systemd as PID 1."""
    criu_line = f'        CriuPath = "{criu}"\n' if criu else ""  # 2.x dropped it: runc takes PATH's
    return (
        f"  [{plugin}.containerd]\n"
        '    default_runtime_name = "runc"\n'
        f"    [{plugin}.containerd.runtimes.runc]\n"
        '      runtime_type = "io.containerd.runc.v2"\n'
        f"      [{plugin}.containerd.runtimes.runc.options]\n"
        f"        SystemdCgroup = {str(systemd).lower()}\n"
        f"{criu_line}"
        f'        Root = "{root}/runc"\n'
    )


_CRI_COMMON = (
    "  restrict_oom_score_adj = true\n  disable_apparmor = true\n  netns_mounts_under_state_dir = true\n"
)


def _head(version: int, root: Path, state: Path | None = None, sock: Path | None = None) -> str:
    sock = sock or root / "containerd.sock"
    return (
        f'version = {version}\nroot = "{root if state else root / "root"}"\n'
        f'state = "{state or root / "state"}"\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
    )


def v2(root: Path, sandbox_image: str, criu: str) -> str:
    """containerd 1.6/1.7."""
    plugin = '''plugins."io.containerd.grpc.v1.cri"'''
    return (
        _head(2, root)
        + f'[{plugin}]\n  sandbox_image = "{sandbox_image}"\n'
        + _CRI_COMMON
        + f'  [{plugin}.cni]\n    bin_dir = "{root}/cni-bin"\n    conf_dir = "{root}/cni-conf"\n'
        + _runc(plugin, root, criu)
    )


def v3(root: Path, sandbox_image: str, systemd: bool = False, cdi_dirs: tuple[Path, ...] = ()) -> str:
    """containerd 2.x: the CRI plugin split into images and runtime; NRI off. As a node of the GPU
    Operator runs it where asked: the systemd cgroup driver (`systemd`), and CDI on with its specs in
    `cdi_dirs` (devices named by a container's `cdi.k8s.io/*` annotations or its CDI devices)."""
    cdi = f"  enable_cdi = true\n  cdi_spec_dirs = {[str(d) for d in cdi_dirs]!r}\n" if cdi_dirs else ""
    plugin = "plugins.'io.containerd.cri.v1.runtime'"
    return (
        _head(3, root)
        + f"[plugins.'io.containerd.internal.v1.opt']\n  path = \"{root}/opt\"\n"
        + "[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n"
        + f"[plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = \"{sandbox_image}\"\n"
        + f"[{plugin}]\n"
        + _CRI_COMMON
        + (cdi or "  enable_cdi = false\n")
        + f'  [{plugin}.cni]\n    bin_dirs = ["{root}/cni-bin"]\n    conf_dir = "{root}/cni-conf"\n'
        + _runc(plugin, root, None, systemd)
    )


def node_v2(sandbox_image: str, criu: str) -> str:
    """A kubelet node's containerd 1.6 at the standard paths (the local cluster binds a folder of
    its own over each, in the node's mount namespace), with Debian's CNI plugins."""
    plugin = '''plugins."io.containerd.grpc.v1.cri"'''
    run = Path("/run/containerd")
    return (
        _head(2, Path("/var/lib/containerd"), run, run / "containerd.sock")
        + f'[{plugin}]\n  sandbox_image = "{sandbox_image}"\n'
        + _CRI_COMMON
        + f'  [{plugin}.cni]\n    bin_dir = "/usr/lib/cni"\n    conf_dir = "/etc/cni/net.d"\n'
        + _runc(plugin, run, criu)
    )
