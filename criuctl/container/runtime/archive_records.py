"""What a checkpoint archive's own records say about its container: the runtime's `config.dump`,
the OCI `spec.dump`, `descriptors.json`, `deleted.files`, and the whiteouts of `rootfs-diff.tar`.

Read without extracting anything and without trusting anything: each record is bounded in size,
must be the JSON type the runtimes write, and a value of another type reads as "not said". The
runtimes disagree on where they put a fact (containerd's annotations, CRI-O's, the kubelet's
container name), so each fact is taken from the first place that has it.
"""

from __future__ import annotations

import json
import re
import tarfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from criuctl.container.runtime.archive_members import MEMBERS_MAX, ArchiveError, Member, bad, one_line

# The archive's layout (a runtime's CheckpointContainer, the kubelet, `podman container checkpoint`).
CHECKPOINT_DIR = "checkpoint"
ROOTFS_DIFF = "rootfs-diff.tar"
DELETED_FILES = "deleted.files"
DESCRIPTORS = "descriptors.json"

RECORD_MAX = 16 << 20  # a config/spec/descriptors file: a few KiB in practice
DELETED_MAX = 100_000
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


@dataclass
class OciMount:
    """One mount of the container's OCI spec (`spec.dump`), as the runtime set it up."""

    destination: str
    type: str = ""
    source: str = ""
    options: list[str] = field(default_factory=list)


@dataclass
class ArchiveFacts:
    """What a checkpoint archive says about its container, read without extracting the images."""

    container_id: str
    name: str  # the container's name in its pod ("counter"), else the runtime's full name
    runtime_name: str = ""  # the runtime's own name for it ("counter_trainer-0_ml_<uid>_0")
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    sandbox_id: str = ""
    image: str = ""
    image_ref: str = ""
    cgroup: str = ""  # the OCI spec's cgroupsPath
    oci_runtime: str = ""  # "io.containerd.runc.v2", "runc", "crun"
    command: list[str] = field(default_factory=list)
    mounts: list[OciMount] = field(default_factory=list)
    rootfs_diff: bool = False
    deleted: list[str] = field(default_factory=list)
    stdio: list[str] = field(default_factory=list)  # descriptors.json: what fds 0, 1, 2 were
    checkpointed: float = 0.0  # epoch seconds, 0 when the archive does not say
    images: list[str] = field(default_factory=list)  # file names under checkpoint/
    other: list[str] = field(default_factory=list)  # top-level members criuctl does not use

    @property
    def stdio_pipes(self) -> dict[str, str]:
        """stdout/stderr that were pipes ("pipe:[N]"): restore hands the placeholder's over them."""
        return {
            which: self.stdio[i]
            for i, which in ((1, "stdout"), (2, "stderr"))
            if i < len(self.stdio) and re.fullmatch(r"pipe:\[\d+\]", self.stdio[i])
        }


def read_small(path: Path, m: Member) -> bytes:
    """The bytes of a record, refused when larger than any runtime writes one."""
    if m.size > RECORD_MAX:
        raise bad(
            path, f"{m.name} is {m.size} bytes, larger than any runtime writes ({RECORD_MAX >> 20} MiB)"
        )
    with m.open() as f:
        return f.read(RECORD_MAX + 1)[:RECORD_MAX]


def _json(path: Path, name: str, raw: bytes | None, want: type) -> Any:
    if raw is None:
        return want()
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ArchiveError(f"{path}: {name} is not JSON ({one_line(exc)})", "the archive is damaged") from exc
    if not isinstance(value, want):
        raise ArchiveError(f"{path}: {name} is not a JSON {want.__name__}", "the archive is damaged")
    return value


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _time(value: Any) -> float:
    """RFC 3339 with nanoseconds ("2026-11-30T11:11:13.282355023Z") as epoch seconds, 0 if unknown."""
    if not isinstance(value, str) or value.startswith("0001-"):
        return 0.0
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", value)
    if not m:
        return 0.0
    try:
        base = datetime.fromisoformat(m[1] + ("+00:00" if m[3] == "Z" else m[3])).timestamp()
    except ValueError:
        return 0.0
    return base + (float(f"0.{m[2]}") if m[2] else 0.0)


def facts(
    path: Path,
    records: dict[str, bytes],
    images: list[str],
    other: list[str],
    diff: bool,
    whiteouts: list[str],
) -> ArchiveFacts:
    """The archive's facts from its records (member name -> bytes) and what its scan found."""
    config = _json(path, "config.dump", records.get("config.dump"), dict)
    spec = _json(path, "spec.dump", records.get("spec.dump"), dict)
    raw_desc = records.get(f"{CHECKPOINT_DIR}/{DESCRIPTORS}") or records.get(DESCRIPTORS)
    stdio = _json(path, DESCRIPTORS, raw_desc, list)
    deleted = _json(path, DELETED_FILES, records.get(DELETED_FILES), list)
    if not config and not spec:
        raise ArchiveError(
            f"{path} is not a checkpoint archive (no config.dump or spec.dump)",
            "pass the archive the kubelet or the runtime's CheckpointContainer wrote",
        )
    if not images:
        raise ArchiveError(
            f"{path} has no CRIU images (nothing under {CHECKPOINT_DIR}/)",
            "pass a complete checkpoint archive",
        )
    for p in deleted:
        if not isinstance(p, str) or "\0" in p or ".." in PurePosixPath(p).parts:
            raise bad(path, f"{DELETED_FILES} lists {str(p)[:80]!r}, not a path inside the container")
    if len(deleted) > DELETED_MAX:
        raise bad(path, f"{DELETED_FILES} lists more than {DELETED_MAX} paths")
    annotations = spec.get("annotations") if isinstance(spec.get("annotations"), dict) else {}
    ann = {k: v for k, v in annotations.items() if isinstance(k, str) and isinstance(v, str)}
    runtime_name = _str(config.get("name"))
    # The kubelet names a CRI container NAME_POD_NAMESPACE_UID_ATTEMPT (no part holds "_").
    from_name = runtime_name.split("_") if runtime_name.count("_") == 4 else ["", "", "", "", ""]
    name = (
        ann.get("io.kubernetes.cri.container-name")  # containerd
        or ann.get("io.kubernetes.container.name")  # CRI-O
        or from_name[0]
        or runtime_name
    )
    linux = spec.get("linux") if isinstance(spec.get("linux"), dict) else {}
    process = spec.get("process") if isinstance(spec.get("process"), dict) else {}
    args = process.get("args") if isinstance(process.get("args"), list) else []
    mounts = []
    for mt in spec.get("mounts") or []:
        if isinstance(mt, dict) and isinstance(mt.get("destination"), str):
            opts = mt.get("options") if isinstance(mt.get("options"), list) else []
            mounts.append(
                OciMount(
                    mt["destination"], _str(mt.get("type")), _str(mt.get("source")), [_str(o) for o in opts]
                )
            )
    return ArchiveFacts(
        container_id=_str(config.get("id")) or ann.get("io.kubernetes.cri.container-id", ""),
        name=name,
        runtime_name=runtime_name,
        pod_name=ann.get("io.kubernetes.cri.sandbox-name")
        or ann.get("io.kubernetes.pod.name")
        or from_name[1],
        pod_namespace=ann.get("io.kubernetes.cri.sandbox-namespace")
        or ann.get("io.kubernetes.pod.namespace")
        or from_name[2],
        pod_uid=ann.get("io.kubernetes.cri.sandbox-uid") or ann.get("io.kubernetes.pod.uid") or from_name[3],
        sandbox_id=ann.get("io.kubernetes.cri.sandbox-id") or ann.get("io.kubernetes.cri-o.SandboxID", ""),
        image=_str(config.get("rootfsImageName"))
        or _str(config.get("rootfsImage"))
        or ann.get("io.kubernetes.cri.image-name", ""),
        image_ref=_str(config.get("rootfsImageRef")),
        oci_runtime=_str(config.get("runtime")) or _str(config.get("ociRuntime")),
        command=[a for a in args if isinstance(a, str)],
        cgroup=_str(linux.get("cgroupsPath")),
        mounts=mounts,
        rootfs_diff=diff,
        deleted=list(dict.fromkeys([*deleted, *whiteouts])),
        stdio=[_str(s) for s in stdio],
        checkpointed=_time(config.get("checkpointedTime")),
        images=sorted(images),
        other=sorted(other),
    )


def scan_diff(source: Path, f: IO[bytes]) -> list[str]:
    """Check rootfs-diff.tar (read as a stream from `f`); the paths its whiteouts delete.

    Refused: names outside the container's root, and hard links out of it. Symbolic links inside
    it are the container's own files (absolute targets are normal there and mean the container's
    root): whoever applies the diff must extract it confined to the rootfs. containerd writes a
    deletion as an overlay whiteout (`bin/.wh.cat`), CRI-O and podman list them in deleted.files;
    both end up in ContainerFacts.deleted ("/bin/cat"). An opaque folder (`.wh..wh..opq`) is kept
    in the tar only: it means "nothing of the image below this folder", not one path.
    """
    deleted: list[str] = []
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for count, info in enumerate(tar, 1):
                if count > 10 * MEMBERS_MAX:
                    raise bad(source, f"{ROOTFS_DIFF} has more than {10 * MEMBERS_MAX} members")
                name = info.name
                if name.startswith("/") or ".." in PurePosixPath(name).parts or "\0" in name:
                    raise bad(source, f"{ROOTFS_DIFF} member {name[:120]!r} points outside the container")
                if info.islnk():
                    target = info.linkname
                    if target.startswith("/") or ".." in PurePosixPath(target).parts:
                        raise bad(source, f"{ROOTFS_DIFF} hard-links {name[:80]!r} outside the container")
                path = PurePosixPath("/", name)
                if path.name.startswith(_WHITEOUT) and path.name != _OPAQUE:
                    deleted.append(str(path.parent / path.name[len(_WHITEOUT) :]))
    except (tarfile.TarError, EOFError) as exc:
        raise ArchiveError(
            f"{source}: {ROOTFS_DIFF} is not a tar ({one_line(exc)})", "the archive is damaged"
        ) from exc
    return deleted
