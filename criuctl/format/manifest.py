"""What a bundle says about itself: manifest.json's types, and its strict parsing.

A manifest's fields become paths, numbers and argv later, so `Manifest.from_json` checks every field
against its annotation and stops at the first thing that is wrong. The files, digests and signature
around it live in `criuctl.format.bundle` and `criuctl.format.signing`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import types
import typing
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

from criuctl.core.errors import CriuctlError
from criuctl.core.procinfo import ProcessInfo

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
_UNSIGNED = {MANIFEST, SIGNATURE}  # the two files no digest covers


class BundleError(CriuctlError):
    """The bundle is missing, unreadable, altered or signed with another key."""


@dataclass
class ContainerFacts:
    """What a restore into a placeholder container needs besides the images
    (`criuctl.container.containers`)."""

    id: str  # the source container's ID
    name: str = ""  # container name in its pod
    pod_name: str = ""
    pod_namespace: str = ""
    image: str = ""
    runtime: str = ""  # "containerd 1.6.20", or "cri-archive" for an imported kubelet/CRI checkpoint
    external_mounts: list[str] = field(default_factory=list)  # CRIU's external mount keys (mount points)
    netns_external: bool = False  # the job's network namespace was the pod's, not the node's
    rootfs_diff: str | None = None  # tar of the writable layer's changes, in the bundle
    deleted: list[str] = field(default_factory=list)  # paths the writable layer removed from the image
    # mount point -> tar of what goes with the job from that volume, in the bundle (criuctl.container.volumes)
    volumes: dict[str, str] = field(default_factory=dict)
    # mount point -> digest of a ConfigMap's or Secret's files as the job saw them: the target's must match
    volume_digests: dict[str, str] = field(default_factory=dict)
    cgroup: str = ""  # the source container's cgroup (for the record)
    # its CDI devices (`vendor/class=name`): a placeholder needs as many of each kind (container.cdi)
    cdi_devices: list[str] = field(default_factory=list)


@dataclass
class StepBoundary:
    """Where the trainers stood when frozen (`criuctl.local.stepboundary`): at a step's end, or not."""

    request_id: str
    trainers: int  # processes that had run optimizer steps
    held: int  # of them, those stopped at a step boundary (the rest were caught inside a step)
    step: int | None  # optimizer steps done by the first trainer
    waited_s: float
    cuda_bytes: int = 0  # device memory the held trainers still had allocated
    why: str = ""  # why not every trainer stopped at a boundary
    nccl_suspended: int = 0  # NCCL communicators the held trainers suspended (hooks/criuctl_hook/nccl.py)
    cuda_reserved: int = 0  # device memory torch's caching allocator still held after empty_cache()


@dataclass
class GpuDevice:
    index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str  # the model, e.g. "NVIDIA H200"
    memory_total: int  # bytes


@dataclass
class GpuFacts:
    """The GPUs the job used, for the target's check and the driver's UUID map (`criuctl.gpu.gpus`)."""

    driver: str  # e.g. "580.65.06"
    devices: list[GpuDevice]  # every GPU of the node the job could see
    pids: list[int]  # host PIDs whose CUDA state the driver checkpointed
    ns_pids: list[int]  # the same processes' PIDs in the job's namespace (stable across restore)
    checkpoint_s: float = 0.0  # lock + checkpoint (device memory to host)
    device_bytes: int = 0  # what the checkpoint moved into host memory (the processes' RSS growth)


@dataclass
class StateFacts:
    """A state bundle (the CUDA-aware pre-dump): no CRIU images; the command starts again and loads these."""

    files: dict[str, str]  # rank -> state file in the bundle
    bytes: int
    step: int | None
    env: dict[str, str]  # the job's environment, to start it again the same way
    cwd: str


@dataclass
class DirectPages:
    """Memory pages that went from the source's dump straight to the target's CRIU page server
    (`criuctl.net.directpages`): they are not among `files`, which the source signs; the session
    they came over is. Only the agent whose page server wrote them can vouch for them (`Vouched`)."""

    pages: int  # how many pages the dump sent (CRIU's count)
    source_cert: str  # sha256 fingerprints of the two certificates made for that TLS session
    target_cert: str


@dataclass(frozen=True)
class Vouched:
    """What a target's own page server wrote, over a session pinned to these two certificates:
    each file's digest (relative path in the bundle) and the pages the pagemaps list."""

    files: dict[str, str]
    pages: int
    source_cert: str
    target_cert: str


DIRECT_PAGE_FILES = ("images/pagemap-*.img", "images/pages-*.img")  # what a page server writes


@dataclass
class Manifest:
    """Everything a reader (inspect, restore, an agent) needs to know before touching the images."""

    workload: str
    command: list[str]
    processes: list[ProcessInfo]
    open_files: list[str]
    uses_gpu: bool
    criu_version: str
    stdio_pipes: dict[str, str] = field(default_factory=dict)  # "stdout" -> "pipe:[inode]"
    freeze_seconds: float = 0.0
    lazy_pages: bool = False  # post-copy: memory pages are not in the bundle, a page server has them
    direct_pages: DirectPages | None = None  # stop-and-copy straight to the target's page server
    container: ContainerFacts | None = None  # a container's tree: restore only into a placeholder
    control_dir: str = ""  # where the job's hook looks for criuctl's requests (its environment says)
    boundary: StepBoundary | None = None  # None: no step boundary was asked for
    gpu: GpuFacts | None = None  # set when the driver checkpointed CUDA state
    state: StateFacts | None = None  # set for a state bundle (no CRIU images)
    format_version: int = FORMAT_VERSION
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    kernel: str = field(default_factory=lambda: os.uname().release)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> digest, all but manifest/sig

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and type-check `raw`; MalformedManifest saying the first thing that is wrong.

        Every field is checked against its annotation, because what a manifest holds is used as
        paths, numbers and argv later: a wrong type must stop here, not as a traceback there.
        """
        try:
            data = json.loads(raw)
        except RecursionError as exc:
            raise MalformedManifest("nested too deeply") from exc
        except ValueError as exc:  # UnicodeDecodeError included
            raise MalformedManifest(f"not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise MalformedManifest(f"{_json_type(data)}, not a JSON object")
        if "format_version" not in data:
            raise MalformedManifest("it has no format_version")
        version = data["format_version"]
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedManifest(f"format_version is {_json_type(version)}, not an integer")
        if version not in READABLE_VERSIONS:
            raise BundleError(
                f"bundle format {version} is not supported",
                f"this criuctl reads formats {READABLE_VERSIONS}; use a matching criuctl",
            )
        manifest = _conform(data, cls, "manifest")
        assert isinstance(manifest, cls)  # what `_conform` makes of a dataclass
        for rel in manifest.files:
            if not _inside(rel):
                raise MalformedManifest(f"files lists {rel[:80]!r}, which is not a file inside the bundle")
        return manifest


class MalformedManifest(ValueError):
    """What is wrong with a manifest's bytes; the reader turns it into a BundleError naming the file."""


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _conform(value: object, tp: object, where: str) -> object:
    """`value` (parsed JSON) as type `tp` — str, int, float, bool, list[X], dict[str, X], X | None,
    or a dataclass of these — or MalformedManifest naming `where` it went wrong."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _conform(value, tp, where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not an object")
        fields = {f.name: f for f in dataclasses.fields(tp)}
        for key in value:
            if key not in fields:
                raise MalformedManifest(f"{where} has an unknown field {key[:40]!r}")
        hints = typing.get_type_hints(tp)
        kw = {}
        for name, f in fields.items():
            if name in value:
                kw[name] = _conform(value[name], hints[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MalformedManifest(f"{where} has no field {name!r}")
        return tp(**kw)
    if origin is list:
        if not isinstance(value, list):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not a list")
        return [_conform(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not an object")
        return {k: _conform(v, args[1], f"{where}[{k[:40]!r}]") for k, v in value.items()}
    checks: dict[object, Callable[[object], bool]] = {
        str: lambda v: isinstance(v, str),
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63,
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    }
    if not checks[tp](value):
        wants: dict[object, str] = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
        want = wants[tp]
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            raise MalformedManifest(f"{where} is an integer out of range")
        raise MalformedManifest(f"{where} is {_json_type(value)}, not {want}")
    return value


def _inside(rel: str) -> bool:
    """A manifest's file name is a plain relative path in the bundle, never `..`, `/x` or itself."""
    p = PurePosixPath(rel)
    return (
        bool(rel)
        and not p.is_absolute()
        and ".." not in p.parts
        and p.as_posix() == rel
        and rel not in _UNSIGNED
        and "\0" not in rel
    )
