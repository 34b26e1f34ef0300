"""The writable layer carried in a bundle: `rootfsdiff.write` tars an overlay upperdir, `apply` unpacks
a diff into a placeholder's rootfs, chrooted, with the overlay's deletions: the `deleted` list, and
the whiteout entries a runtime's rootfs-diff.tar holds (`.wh.NAME`, `.wh..wh..opq`).

Runs as root (chroot, mknod, trusted.* xattrs); the rootfs is a plain folder built here.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

from criuctl.container import rootfsdiff
from tests.requirements import needs

pytestmark = needs("root")  # apply chroots, write reads whiteouts

# A name no host has in /run: the file the diff writes through the image's `var/run -> /run`.
THROUGH_LINK = f"criuctl-rootfsdiff-test-{os.getpid()}"


def _files(root: Path) -> dict[str, str]:
    """Every entry under `root` as "rel": "file <bytes>" / "dir" / "link <target>"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = f"file {p.read_text()}"
    return out


def _rootfs(root: Path, entries: dict[str, str]) -> Path:
    """A fake placeholder rootfs: "rel": "text" makes a file, "rel": "-> target" a symlink."""
    for rel, what in entries.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if what.startswith("-> "):
            p.symlink_to(what[3:])
        else:
            p.write_text(what)
    return root


def _tar(path: Path, entries: list[tuple[str, str | None]]) -> Path:
    """A diff tar, in order: (name, None) a folder, (name, "-> target") a symlink, else a file."""
    with tarfile.open(path, "w") as tar:
        for name, what in entries:
            info = tarfile.TarInfo(name)
            if what is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif what.startswith("-> "):
                info.type, info.linkname = tarfile.SYMTYPE, what[3:]
                tar.addfile(info)
            else:
                data = what.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_apply_deletes_empties_opaque_folders_and_never_extracts_whiteouts(tmp_path: Path) -> None:
    rootfs = _rootfs(
        tmp_path / "rootfs",
        {
            "etc/keep": "k",
            "etc/gone": "g",
            "var/cache/old": "o",
            "var/cache/sub/old2": "o2",
            "var/run": "-> /run",
            "run/pid": "1",
            "opt/link": "-> /etc",  # the image's link, where the diff has an opaque folder
        },
    )
    diff = _tar(
        tmp_path / "rootfs-diff.tar",
        [
            ("etc", None),
            ("etc/.wh.gone", ""),  # the archive reader turned it into deleted "/etc/gone"
            ("var/cache", None),
            ("var/cache/.wh..wh..opq", ""),
            ("var/cache/new", "n"),
            (f"var/run/{THROUGH_LINK}", "hello"),
            ("opt/link", None),
            ("opt/link/.wh..wh..opq", ""),
            ("opt/link/y", "y"),
            ("usr/bin/py", "-> /usr/bin/python3"),
        ],
    )
    rootfsdiff.apply(diff, ["/etc/gone"], rootfs)
    assert not Path("/run", THROUGH_LINK).exists(), "the diff wrote through the link into the host"
    assert _files(rootfs) == {
        "etc": "dir",
        "etc/keep": "file k",  # not emptied through opt/link
        "var": "dir",
        "var/cache": "dir",
        "var/cache/new": "file n",  # all the image had below var/cache is gone
        "var/run": "link /run",
        "run": "dir",
        "run/pid": "file 1",
        f"run/{THROUGH_LINK}": "file hello",
        "opt": "dir",
        "opt/link": "dir",  # the link replaced by the diff's folder
        "opt/link/y": "file y",
        "usr": "dir",
        "usr/bin": "dir",
        "usr/bin/py": "link /usr/bin/python3",
    }


def test_an_opaque_run_keeps_the_placeholders_control_files(tmp_path: Path) -> None:
    rootfs = _rootfs(
        tmp_path / "rootfs",
        {"run/criuctl/ctl": "c", "run/old": "o", "etc/keep": "k"},
    )
    diff = _tar(
        tmp_path / "d.tar",
        [
            ("run", None),
            ("run/.wh..wh..opq", ""),
            ("run/new", "n"),
            (".wh..wh..opq", ""),  # at the top: ignored, never the whole rootfs emptied
            ("./.wh.nothing", ""),
        ],
    )
    rootfsdiff.apply(diff, [], rootfs)
    assert _files(rootfs) == {
        "run": "dir",
        "run/criuctl": "dir",
        "run/criuctl/ctl": "file c",
        "run/new": "file n",
        "etc": "dir",
        "etc/keep": "file k",
    }


def test_write_tars_an_upperdir_and_lists_its_deletions(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    for d in ("etc", "var/cache", "tmp", "run/criuctl"):
        (upper / d).mkdir(parents=True)
    os.mknod(upper / "etc/gone", stat.S_IFCHR, 0)  # the overlay's whiteout: a 0:0 character device
    os.setxattr(upper / "var/cache", "trusted.overlay.opaque", b"y")
    (upper / "var/cache/new").write_text("n")
    (upper / "tmp/log").write_text("l")
    os.mkfifo(upper / "tmp/fifo")
    (upper / "lnk").symlink_to("/run")
    (upper / "run/criuctl/ctl").write_text("c")  # the placeholder's own: never carried

    out = tmp_path / "rootfs-diff.tar"
    deleted = rootfsdiff.write(upper, out)

    assert sorted(deleted) == ["etc/gone", "var/cache"]
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["etc", "lnk", "run", "tmp", "tmp/log", "var", "var/cache", "var/cache/new"]
    assert members["lnk"].issym() and members["lnk"].linkname == "/run"

    rootfs = _rootfs(
        tmp_path / "rootfs",
        {"etc/gone": "g", "etc/keep": "k", "var/cache/old": "o", "run/x": "x"},
    )
    rootfsdiff.apply(out, deleted, rootfs)
    files = _files(rootfs)
    assert "etc/gone" not in files and "var/cache/old" not in files
    assert files["var/cache/new"] == "file n" and files["tmp/log"] == "file l"
    assert files["etc/keep"] == "file k" and files["lnk"] == "link /run"
