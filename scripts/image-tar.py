#!/usr/bin/env python3
"""Pack a folder as a one-layer image in `docker save` format, for `ctr images import`.

Tests need container images without a registry or a Docker engine: the host's static busybox (the
pause image and the placeholder's shell) is all they need inside; Python and the project come
from read-only host mounts. Standard library only.

    image-tar.py ROOTFS_DIR NAME:TAG OUT.tar [--cmd ARG ...] [--entrypoint ARG ...]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rootfs", type=Path)
    p.add_argument("ref")
    p.add_argument("out", type=Path)
    p.add_argument("--cmd", nargs="*", default=["/bin/sh"])
    p.add_argument("--entrypoint", nargs="*", default=None)
    a = p.parse_args()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        for path in sorted(a.rootfs.rglob("*")):
            info = t.gettarinfo(str(path), str(path.relative_to(a.rootfs)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            with path.open("rb") if info.isreg() else io.BytesIO() as f:
                t.addfile(info, f if info.isreg() else None)
    raw = layer.getvalue()
    diff = hashlib.sha256(raw).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": a.cmd, **({"Entrypoint": a.entrypoint} if a.entrypoint else {}), "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff}"]},
        }
    ).encode()
    cfg = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{cfg}.json", "RepoTags": [a.ref], "Layers": [f"{diff}/layer.tar"]}])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as out:
        _add(out, f"{diff}/layer.tar", raw)
        _add(out, f"{cfg}.json", config)
        _add(out, "manifest.json", manifest.encode())
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
