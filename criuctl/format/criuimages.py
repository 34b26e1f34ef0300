"""Facts read back out of CRIU's image files: the process tree, open files, external mounts and the
network namespace of a checkpoint that criuctl did not take itself (a kubelet/CRI archive).

criuctl's own bundles record these at dump time, from /proc; a checkpoint written by someone else
has only its images, so they are parsed here with pycriu. The images may be hostile: each is
refused above a size CRIU never writes for it, and anything pycriu raises on a crafted file becomes
one ImageError line. The PIDs are those of the container's PID namespace; the host's are gone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criuctl.core.errors import CriuctlError
from criuctl.format import bundle

IMAGE_PARSE_MAX = 64 << 20  # an image parsed here (pstree, core, fs, files, mountpoints, pagemap)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PE_PARENT, _PE_PRESENT = 1 << 0, 1 << 2  # CRIU's pagemap entry flags (images/pagemap.proto)
_ARGS_MAX = 64 << 10
STATS_DUMP = "stats-dump"


class ImageError(CriuctlError):
    """A CRIU image is missing, damaged, or not CRIU's: the checkpoint cannot be described (the
    message names the image, not where the checkpoint came from: the caller says that)."""


@dataclass
class ImageFacts:
    """What the CRIU images themselves say: the process tree, files, mounts and network."""

    processes: list[bundle.ProcessInfo]
    open_files: list[str]
    external_mounts: list[str]
    netns_external: bool


def image_facts(root: Path) -> ImageFacts:
    """Read the process tree, open files, external mounts and network namespace of the CRIU images
    under `root/images` (a bundle being imported)."""
    present = {p.name for p in (root / bundle.IMAGES_DIR).iterdir()}
    if "pstree.img" not in present:
        raise ImageError("the images have no pstree.img", "the checkpoint is incomplete")
    files: dict[int, dict[str, Any]] = {}
    if "files.img" in present:
        files = {e.get("id", 0): e for e in _load(root, "files.img")}
    processes = []
    for e in _load(root, "pstree.img"):
        pid = int(e.get("pid", 0))
        ppid = int(e.get("ppid", 0))
        comm = ""
        if f"core-{pid}.img" in present:
            core = _load(root, f"core-{pid}.img")
            comm = _str((core[0].get("tc") or {}).get("comm")) if core else ""
        cwd = ""
        if f"fs-{pid}.img" in present:
            fs = _load(root, f"fs-{pid}.img")
            cwd = _file_name(files.get(fs[0].get("cwd_id", -1))) if fs else ""
        rss, cmdline = 0, []
        if f"pagemap-{pid}.img" in present:
            pagemap = _load(root, f"pagemap-{pid}.img")
            rss = sum(int(p.get("nr_pages", 0)) for p in pagemap[1:]) * _PAGE
            cmdline = _cmdline(root, pid, pagemap, present)
        # The images hold PIDs of the container's PID namespace only; the host PIDs are gone.
        processes.append(
            bundle.ProcessInfo(
                pid=pid,
                ns_pid=pid,
                ppid=ppid,
                name=comm,
                cmdline=cmdline,
                cwd=cwd,
                rss_bytes=rss,
                threads=len(e.get("threads") or [pid]),
            )
        )
    open_files = sorted({n for f in files.values() if (n := _file_name(f))})
    external: list[str] = []
    netns_external = False
    for name in sorted(present):
        if re.fullmatch(r"mountpoints-\d+\.img", name):
            for mnt in _load(root, name):
                key = _str(mnt.get("ext_key")) or (
                    _str(mnt.get("mountpoint")) if mnt.get("ext_mount") else ""
                )
                if key and key not in external:
                    external.append(key)
        elif re.fullmatch(r"netns-\d+\.img", name):
            netns_external = netns_external or any(_str(n.get("ext_key")) for n in _load(root, name))
    return ImageFacts(processes, open_files, external, netns_external)


def dump_log_facts(root: Path) -> tuple[str, str, str]:
    """(CRIU version, host, kernel) from the head of the bundle's dump.log, "" for what it does not
    say: CRIU writes them there before the first image, and nowhere in the images."""
    version = host = kernel = ""
    try:
        with (root / bundle.DUMP_LOG).open("rb") as f:
            head = f.read(8192).decode(errors="replace")
    except OSError:
        return version, host, kernel
    if m := re.search(r"\) Version: (\S+)", head):
        version = m[1]
    if m := re.search(r"\) Running on (\S+) Linux (\S+)", head):
        host, kernel = m[1], m[2]
    return version, host, kernel


def pages_written(*dirs: Path) -> int:
    """How many memory pages CRIU's dump wrote, here or to a page server: its `stats-dump`, which
    CRIU writes into its working folder once the images are closed (the first of `dirs` that has it)."""
    path = next((d / STATS_DUMP for d in dirs if (d / STATS_DUMP).is_file()), dirs[0] / STATS_DUMP)
    entries = _load_file(path)
    dump = entries[0].get("dump") if entries else None
    if not isinstance(dump, dict) or not isinstance(dump.get("pages_written"), int):
        raise ImageError("stats-dump has no count of the pages written", "the dump did not complete")
    return int(dump["pages_written"])


@dataclass(frozen=True)
class ExitWords:
    """What a dumped thread's death would write to: its clear_child_tid and its robust list."""

    clear_tid: int
    robust_head: int
    robust_len: int


def thread_exit_words(images_dir: Path) -> dict[int, ExitWords]:
    """Each dumped thread's `ExitWords`, by its ID in its PID namespace (its `core-ID.img`)."""
    out: dict[int, ExitWords] = {}
    for path in images_dir.glob("core-*.img"):
        core = _load_file(path)[0]
        info, tc = core.get("thread_info") or {}, core.get("thread_core") or {}
        out[int(path.stem.removeprefix("core-"))] = ExitWords(
            int(info.get("clear_tid_addr", 0)), int(tc.get("futex_rla", 0)), int(tc.get("futex_rla_len", 0))
        )
    return out


def pagemap_pages(path: Path) -> int:
    """How many pages a pagemap image says its pages image holds (its entries marked present)."""
    entries = _load_file(path)
    return sum(int(e.get("nr_pages", 0)) for e in entries[1:] if int(e.get("flags", 0)) & _PE_PRESENT)


def _load(root: Path, name: str) -> list[dict[str, Any]]:
    """Entries of one CRIU image in the bundle, parsed by pycriu; ImageError when it is not one."""
    return _load_file(root / bundle.IMAGES_DIR / name)


def _load_file(path: Path) -> list[dict[str, Any]]:
    name = path.name
    try:
        import pycriu.images
    except ImportError as exc:
        raise ImageError(
            "pycriu is not installed in this Python", "run `make install` (it installs CRIU and pycriu)"
        ) from exc
    try:
        size = path.stat().st_size
        if size > IMAGE_PARSE_MAX:
            raise ImageError(
                f"{name} is {size} bytes, larger than CRIU writes for it",
                "CRIU never writes that; refusing these images (nothing was restored)",
            )
        with path.open("rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except ImageError:
        raise
    except Exception as exc:  # pycriu raises anything on a crafted file: magic, protobuf, struct
        raise ImageError(
            f"{name} is not a CRIU image pycriu can read ({type(exc).__name__}: {_one_line(exc)})",
            "the images are damaged or were not written by CRIU; refusing them",
        ) from exc
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ImageError(f"{name} has no entries", "the images are damaged")
    return entries


def _cmdline(root: Path, pid: int, pagemap: list[dict[str, Any]], present: set[str]) -> list[str]:
    """A process's argv read back from its dumped memory ([] when it cannot be): a checkpoint from
    elsewhere keeps no command line but its spec's, which is only PID 1's, and only before any exec.

    `mm-PID.img` says where argv lies (mm_arg_start..mm_arg_end, on the stack, always dumped); the
    pagemap lists the dumped ranges in the order their pages follow each other in `pages-ID.img`.
    """
    if f"mm-{pid}.img" not in present or not pagemap:
        return []
    mm = _load(root, f"mm-{pid}.img")
    if not mm:
        return []
    start, end = int(mm[0].get("mm_arg_start", 0)), int(mm[0].get("mm_arg_end", 0))
    if not 0 < end - start <= _ARGS_MAX:
        return []
    pages = root / bundle.IMAGES_DIR / f"pages-{pagemap[0].get('pages_id', -1)}.img"
    out = bytearray()
    offset = 0  # bytes into the pages file
    try:
        with pages.open("rb") as f:
            for entry in pagemap[1:]:
                flags, vaddr, n = (
                    int(entry.get("flags", 0)),
                    int(entry.get("vaddr", 0)),
                    int(entry.get("nr_pages", 0)),
                )
                if flags & _PE_PARENT or not flags & _PE_PRESENT:
                    continue
                lo, hi = max(start + len(out), vaddr), min(end, vaddr + n * _PAGE)
                if lo < hi and lo == start + len(out):
                    f.seek(offset + lo - vaddr)
                    out += f.read(hi - lo)
                offset += n * _PAGE
                if start + len(out) >= end:
                    break
    except OSError:
        return []
    if start + len(out) != end:
        return []
    return [a.decode(errors="replace") for a in bytes(out).rstrip(b"\0").split(b"\0")]


def _file_name(f: dict[str, Any] | None) -> str:
    """A files.img entry as `inspect` lists open files: a path, or "pipe:[N]", "unixsk", ..."""
    if not f:
        return ""
    kind = _str(f.get("type"))
    if kind == "REG":
        return _str((f.get("reg") or {}).get("name"))
    if kind == "PIPE":
        return f"pipe:[{(f.get('pipe') or {}).get('pipe_id', '?')}]"
    return kind.lower()


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _one_line(exc: BaseException) -> str:
    """An exception's text as one short line (pycriu's can hold a whole protobuf dump)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:200]
