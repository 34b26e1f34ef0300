"""`criuctl doctor`: can this host checkpoint and restore training jobs, and what is missing.

Each check is one line: ok, or what is wrong and what to do. `required` checks make doctor fail;
the others only limit what criuctl can do here (post-copy, GPU).
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from criuctl.cli import version
from criuctl.container import cgroups
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.gpu import cuda, gpus
from criuctl.local import exitwrites

CAP_CHECKPOINT_RESTORE = 40


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _criuctl() -> Check:
    """What runs (criuctl.cli.version)."""
    return Check("criuctl", True, version.describe())


def _criu_version() -> Check:
    try:
        v = criu.require_version()
    except CriuctlError as exc:
        return Check("CRIU", False, exc.what, exc.hint)
    shown, kernel = ".".join(map(str, v)), criu.kernel_release()
    missing = criu.missing_fixes(v, kernel)
    if not missing:
        return Check("CRIU", True, f"{shown} at {criu.binary()}")
    need = ".".join(map(str, max(f.criu for f in missing)))
    on = "{}.{}".format(*kernel)
    return Check(
        "CRIU",
        False,
        f"{shown} at {criu.binary()} lacks what kernel {on} needs: {'; '.join(f.what for f in missing)}",
        f"install CRIU >= {need} with scripts/install-criu.sh",
    )


def _criu_check() -> Check:
    try:
        criu.check()
        return Check("criu check", True, "kernel has what CRIU needs")
    except CriuctlError as exc:
        return Check("criu check", False, exc.what, exc.hint)


def _features() -> list[Check]:
    try:
        f = criu.features()
    except CriuctlError as exc:
        return [Check("CRIU features", False, exc.what, exc.hint, required=False)]
    return [
        Check(
            "userfaultfd (post-copy)",
            f.lazy_pages,
            "lazy pages work" if f.lazy_pages else "userfaultfd is unavailable",
            "post-copy migration is unavailable; use stop-and-copy",
            required=False,
        ),
        *([_page_pull(), _post_copy_risk()] if f.lazy_pages else []),
    ]


def _post_copy_risk() -> Check:
    """Post-copy is the default; what it trades for its short stall is worth saying where it runs
    (docs/kubernetes.md, "The risk, plainly")."""
    how = (
        "until its last page is pulled, a moved job's memory is on two nodes: the source's death, or "
        "its link cut for 30 s, ends the job (it starts over; never twice)"
    )
    if not exitwrites.supported():
        how += f"; a pod's move through its successor goes by stop-and-copy on {platform.machine()}"
    return Check("post-copy's window", True, how, required=False)


def _page_pull() -> Check:
    """Post-copy on a CRIU without criuctl's patch works, at a fraction of the link: worth a line,
    not a failure (docs/benchmarks.md, "Post-copy's tail")."""
    try:
        build = criu.build()
    except CriuctlError as exc:
        return Check("post-copy page pull", False, exc.what, exc.hint, required=False)
    if build.startswith(criu.OUR_BUILD):
        return Check("post-copy page pull", True, f"8 requests in flight (build {build})", required=False)
    return Check(
        "post-copy page pull",
        False,
        f"CRIU at {criu.binary()} (build {build or 'unnamed'}) pulls one request at a time: post-copy's "
        "pages reach the target at 0.06-0.4 GB/s, not at the link's speed",
        "build CRIU with scripts/install-criu.sh (it applies scripts/criu-patches/)",
        required=False,
    )


def _root() -> Check:
    ok = os.geteuid() == 0
    return Check(
        "root", ok, "running as root" if ok else f"running as uid {os.geteuid()}", "run criuctl with sudo"
    )


def _cap_checkpoint_restore() -> Check:
    cap_eff = next(
        (
            int(line.split()[1], 16)
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("CapEff:")
        ),
        0,
    )
    ok = bool(cap_eff >> CAP_CHECKPOINT_RESTORE & 1)
    return Check(
        "CAP_CHECKPOINT_RESTORE",
        ok,
        "held" if ok else "not held",
        "run as root, or grant cap_checkpoint_restore (and cap_sys_ptrace) to criuctl",
    )


def _pid_namespaces() -> Check:
    ok = Path("/proc/self/ns/pid").exists() and Path("/proc/self/ns/pid_for_children").exists()
    return Check(
        "PID namespaces",
        ok,
        "supported" if ok else "not supported by this kernel",
        "criuctl run needs CONFIG_PID_NS to give restored trees their own PIDs",
    )


def _cgroups() -> Check:
    try:
        found = cgroups.layout()
    except OSError as exc:
        return Check("cgroups", False, f"cannot read the cgroup layout: {exc}", required=False)
    return Check(
        "cgroups",
        found.ok,
        found.describe(),
        "run the agent privileged in the node's PID namespace (hostPID: true, as manifests/daemonset.yaml)",
        required=False,
    )


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def _pipe_max_size() -> Check:
    v = int(_sysctl("fs.pipe-max-size") or 0)
    ok = v >= criu.POSTCOPY_PIPE_SIZE
    return Check(
        "fs.pipe-max-size",
        ok,
        f"{v} bytes",
        f"post-copy needs sysctl fs.pipe-max-size={criu.POSTCOPY_PIPE_SIZE} "
        "(CRIU's page server fails without CAP_SYS_RESOURCE)",
        required=False,
    )


def _nftables() -> Check:
    ok = shutil.which("nft") is not None or Path("/usr/lib/x86_64-linux-gnu/libnftables.so.1").exists()
    return Check(
        "network lock",
        ok,
        "nftables available" if ok else "nftables not found",
        "apt-get install nftables (CRIU locks TCP connections with it while frozen)",
        required=False,
    )


def _io_uring() -> Check:
    v = _sysctl("kernel.io_uring_disabled")
    detail = f"kernel.io_uring_disabled={v}; `criuctl run` blocks io_uring per workload (seccomp)"
    return Check("io_uring", True, detail, required=False)


def _cuda() -> Check:
    info = cuda.probe()
    if not info.loaded:
        return Check(
            "CUDA checkpoint API",
            False,
            f"no CUDA driver ({cuda.library_path()}) on this host",
            "GPU jobs cannot be checkpointed here; CPU jobs are unaffected",
            required=False,
        )
    try:
        nvidia = gpus.driver_version()
    except CriuctlError:
        nvidia = None
    api = f"CUDA {cuda.version_text(info.driver_version)}" if info.driver_version else "CUDA ?"
    driver = f"driver {nvidia} ({api})" if nvidia else f"driver {api}"
    if info.has_checkpoint_api:
        remap = (
            "restore onto other GPUs (UUID remap) available"
            if info.supports_remap
            else "restore only onto the same GPUs: remapping them needs driver r580+ (CUDA 13.0)"
        )
        return Check("CUDA checkpoint API", True, f"{driver} exports cuCheckpointProcess*; {remap}")
    missing = [s for s in cuda.CHECKPOINT_SYMBOLS if s not in info.checkpoint_symbols]
    return Check(
        "CUDA checkpoint API",
        False,
        f"{driver} lacks {', '.join(missing)}",
        "upgrade to driver r570+; until then GPU jobs fall back to the hook's host copy",
        required=False,
    )


def _container_runtime() -> Check:
    """Optional: criuctl moves containers only where it can ask their runtime (docs/containers.md)."""
    from criuctl.container import runtime

    where = runtime.endpoint()
    try:
        rt = runtime.connect(where)
        n = len(rt.containers())
        version = rt.version() if hasattr(rt, "version") else where
    except CriuctlError as exc:
        return Check("container runtime", False, exc.what, exc.hint, required=False)
    return Check("container runtime", True, f"{version} at {where}: {n} containers")


def _node_tls() -> Check:
    """Optional: the nodes this host migrates between (`criuctl node add`), and which are plain HTTP."""
    from criuctl.client import agents

    try:
        nodes = agents.all_nodes()
    except (OSError, ValueError, TypeError) as exc:
        return Check(
            "agents' TLS",
            False,
            f"cannot read the node list: {exc}",
            "criuctl node add again",
            required=False,
        )
    plain = sorted(n.name for n in nodes.values() if not n.tls)
    if plain:
        return Check(
            "agents' TLS",
            False,
            f"node {', '.join(plain)}: plain HTTP (agents run --insecure): token and bundles cross the "
            "network unencrypted",
            "serve HTTPS (--tls-cert/--tls-key) and add them again as https://",
            required=False,
        )
    return Check("agents' TLS", True, f"{len(nodes)} node(s), all HTTPS" if nodes else "no nodes added")


CHECKS: list[Callable[[], Check | list[Check]]] = [
    _criuctl,
    _root,
    _criu_version,
    _criu_check,
    _features,
    _cap_checkpoint_restore,
    _pid_namespaces,
    _cgroups,
    _pipe_max_size,
    _nftables,
    _io_uring,
    _cuda,
    _container_runtime,
    _node_tls,
]


def run_checks() -> list[Check]:
    out: list[Check] = []
    for fn in CHECKS:
        r = fn()
        out.extend(r if isinstance(r, list) else [r])
    return out
