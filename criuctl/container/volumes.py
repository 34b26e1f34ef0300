"""A job's volumes across a move: what kind each external mount is, and what a dump takes of it.

The kind is read from where the node sees the mount (criuctl.container.nodeview): the kubelet keeps a pod's
volumes under `…/pods/UID/volumes/kubernetes.io~PLUGIN/NAME` (subPaths under `volume-subpaths/NAME/`),
and hands a hostPath or a hostPath PersistentVolume over by its own path. What each kind means for a
move (docs/containers.md, "Volumes"):

    kind        what it is                                 dump (tree frozen)         restore
    EMPTY_DIR   emptyDir, on disk or medium: Memory        its files, whole           unpacked into the
    POD_MEMORY  the pod's own /dev/shm (the sandbox's)     its files, whole           placeholder's
    API         ConfigMap, Secret                          a digest of its files      the target's must match
    PER_POD     projected, downwardAPI                     nothing: each pod's own (tokens, its name)
    SHARED      nfs, cephfs, … (hostPath, PVC)             nothing: the same files on the target
    NODE_LOCAL  any other filesystem (hostPath, local PV)  files open for writing     written unless equal
    RUNTIME     cgroups, /etc/hosts, the termination log   nothing: the placeholder's own

A node-local volume on another node is other storage: a file the job writes (its log, a checkpoint
being saved) would be missing there, or stale, and CRIU refuses a file whose size changed. So those
files go with the job, and overwrite the target's copy only when it differs (on storage both nodes
share, it is the same file: left alone). Files it only reads (a dataset) are not carried: datasets are
large and are expected on every node that runs the job; CRIU checks their size at restore.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from criuctl.container import mounts, rootfsdiff
from criuctl.container.nodeview import NodeView
from criuctl.core.errors import CriuctlError
from criuctl.core.retry import Backoff
from criuctl.format.bundle import ContainerFacts

# filesystems whose files every node mounting them sees alike (fuse: the CSI drivers of object
# stores and network filesystems)
SHARED_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "orangefs",
        "gfs2",
        "ocfs2",
    }
)
# the kubelet's folders of a pod (its UID; the CRI tests' stand-in names the pod instead)
_KUBELET_VOLUME = re.compile(r"/pods/[^/]+/volumes/kubernetes\.io~([^/]+)/([^/]+)(?:/|$)")
_KUBELET_SUBPATH = re.compile(r"/pods/[^/]+/volume-subpaths/([^/]+)/")
_KUBELET_POD = re.compile(r"/pods/[0-9a-f-]{36}/")  # anything else of the pod: the runtime's files


class Kind(enum.Enum):
    EMPTY_DIR = "emptyDir"
    POD_MEMORY = "the pod's /dev/shm"
    API = "ConfigMap or Secret"
    PER_POD = "projected or downwardAPI"
    SHARED = "shared storage"
    NODE_LOCAL = "node-local storage"
    RUNTIME = "the runtime's"


CARRIED_WHOLE = frozenset({Kind.EMPTY_DIR, Kind.POD_MEMORY})
_PLUGINS = {
    "empty-dir": Kind.EMPTY_DIR,
    "configmap": Kind.API,
    "secret": Kind.API,
    "projected": Kind.PER_POD,
    "downward-api": Kind.PER_POD,
}


@dataclass(frozen=True)
class Volume:
    """One external mount of the job's container, as the node sees it."""

    point: str  # where the job sees it
    kind: Kind
    node_path: str  # where the node sees it
    name: str = ""  # the pod spec's volume name, where the kubelet's path says it

    def label(self) -> str:
        """How a message names it: by the pod spec's name where known, else by the node's path."""
        what = f"volume {self.name}" if self.name else self.node_path
        return f"{what} ({self.kind.value})"


def classify(m: mounts.Mount, paths: list[str], node_shm: set[str] | None = None) -> Volume | None:
    """The kind of container mount `m`, from every node path that shows it (`NodeView.paths`);
    None when the node has none (then it is not external). `node_shm`: the devices of the node's
    own /dev/shm (a hostPath of it is node-local, not the pod's)."""
    if not paths:
        return None
    name = next((s[1] for p in paths if (s := _KUBELET_SUBPATH.search(p))), "")
    for p in paths:
        if v := _KUBELET_VOLUME.search(p):
            plugin, name = v[1], name or v[2]
            kind = _PLUGINS.get(plugin) or (Kind.SHARED if _shared(m.fstype) else Kind.NODE_LOCAL)
            return Volume(m.point, kind, paths[0], name)
    if m.fstype in mounts.CGROUP_TYPES or (_KUBELET_POD.search(paths[0]) and not name):
        return Volume(m.point, Kind.RUNTIME, paths[0])
    if m.point == "/dev/shm" and m.fstype == "tmpfs" and m.device not in (node_shm or set()):
        return Volume(m.point, Kind.POD_MEMORY, paths[0])
    return Volume(m.point, Kind.SHARED if _shared(m.fstype) else Kind.NODE_LOCAL, paths[0], name)


def _shared(fstype: str) -> bool:
    return fstype in SHARED_FS or fstype.startswith("fuse.")


def of_container(inside: list[mounts.Mount], view: NodeView) -> list[Volume]:
    """The job's external mounts that are volumes, one per mount point (the one the job sees)."""
    node_shm = {m.device for m in view.table if m.point == "/dev/shm"}
    seen = mounts.by_point(inside)
    out = []
    for point in dict.fromkeys(view.externals(inside)):
        v = classify(seen[point], view.paths(seen[point]), node_shm)
        if v is not None and v.kind is not Kind.RUNTIME:
            out.append(v)
    return out


def open_for_writing(pids: list[int], points: list[str]) -> dict[str, set[str]]:
    """Files under `points` that the processes hold open for writing or map shared and writable:
    mount point → paths relative to it. Paths as the processes see them (/proc/PID/fd names them
    from the container's root); a deleted file is CRIU's to carry (a ghost file), not ours."""
    found: dict[str, set[str]] = {}
    deepest = sorted(points, key=len, reverse=True)

    def note(path: str) -> None:
        if not path.startswith("/") or path.endswith(" (deleted)"):
            return
        for point in deepest:
            rel = os.path.relpath(path, point)
            if rel != "." and not rel.startswith(".."):
                found.setdefault(point, set()).add(rel)
                return

    for pid in pids:
        for fd, path in _fds(pid):
            if _writable_fd(pid, fd):
                note(path)
        for line in _read(f"/proc/{pid}/maps").splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[1][1] == "w" and parts[1][3] == "s":
                note(parts[5])
    return found


def _fds(pid: int) -> list[tuple[str, str]]:
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in names:
        try:
            out.append((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            continue
    return out


def _writable_fd(pid: int, fd: str) -> bool:
    for line in _read(f"/proc/{pid}/fdinfo/{fd}").splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def write_files(base: str, rels: set[str], out: Path) -> None:
    """Tar the regular files `rels` (relative to `base`) and the folders above them."""
    folders = sorted({str(p) for r in rels for p in PurePosixPath(r).parents if str(p) != "."})
    with tarfile.open(out, "w") as tar:
        for rel in folders:
            tar.add(os.path.join(base, rel), arcname=rel, recursive=False)
        for rel in sorted(rels):
            full = os.path.join(base, rel)
            if os.path.isfile(full) and not os.path.islink(full):
                tar.add(full, arcname=rel, recursive=False)


def digest(base: str) -> str:
    """sha256 over the names and contents of the files a ConfigMap or Secret volume shows (its
    keys, followed through the kubelet's `..data` links; the `..` folders themselves left out, as
    their names carry the time the kubelet wrote them), or of the one file a subPath mounts."""
    h = hashlib.sha256()
    if os.path.isfile(base):
        h.update(Path(base).read_bytes())
        return h.hexdigest()

    def walk(folder: str, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(folder)):
            if name.startswith("..") or depth > 16:
                continue
            full, rel = os.path.join(folder, name), f"{prefix}{name}"
            if os.path.isdir(full):
                walk(full, rel + "/", depth + 1)
            elif os.path.isfile(full):
                h.update(rel.encode() + b"\0" + Path(full).read_bytes() + b"\0")

    walk(base, "", 0)
    return h.hexdigest()


def seen_digest(pid: int, point: str, label: str) -> str:
    """`digest` of the volume at `point` as process `pid` sees it (through its root: a subPath's
    file stays readable there after the kubelet replaced it on the node). The kubelet swaps a
    ConfigMap's `..data` link while it updates it: a read in that instant is tried again."""
    backoff = Backoff(cap=0.4, first=0.05)
    for _ in range(_DIGEST_TRIES - 1):
        try:
            return digest(f"/proc/{pid}/root{point}")
        except OSError:
            backoff.sleep()
    try:
        return digest(f"/proc/{pid}/root{point}")
    except OSError as exc:
        raise CriuctlError(
            f"cannot read {label} at {point}: {exc.strerror or exc}",
            "is the kubelet updating it? try the move again",
        ) from exc


_DIGEST_TRIES = 5


def carry(
    vols: list[Volume],
    view: NodeView,
    inside: list[mounts.Mount],
    pids: list[int],
    bundle_dir: Path,
    folder: str,
    facts: ContainerFacts,
) -> None:
    """Take what goes with the job (the table above) into `bundle_dir/folder`, recording it in
    `facts`; the tree must be frozen, so that every file has the size CRIU records."""
    seen = mounts.by_point(inside)
    writing = open_for_writing(pids, [v.point for v in vols if v.kind is Kind.NODE_LOCAL])
    for i, v in enumerate(sorted(vols, key=lambda v: v.point)):
        source = view.reach(seen[v.point])
        if source is None:
            continue
        rel = f"{folder}/{i}.tar"
        if v.kind is Kind.API:
            facts.volume_digests[v.point] = seen_digest(pids[0], v.point, v.label())
            continue
        if v.kind in CARRIED_WHOLE and not os.path.isdir(source):
            continue  # a subPath of one file: the volume it is cut from carries it, when mounted too
        if v.kind not in CARRIED_WHOLE and not writing.get(v.point):
            continue
        (bundle_dir / folder).mkdir(mode=0o700, exist_ok=True)
        if v.kind in CARRIED_WHOLE:
            rootfsdiff.write(Path(source), bundle_dir / rel)
        else:
            write_files(source, writing[v.point], bundle_dir / rel)
        facts.volumes[v.point] = rel
