"""The agent image (`make image`, scripts/build-image.sh, the Dockerfile): the build sees exactly the
inputs its content key hashes, the machine's package configuration never lands in a layer, and the
script refuses bad input in one line. The image running in pods (doctor, agent --help, contents) is
tests/test_kube.py's `test_agent_image_runs_doctor_and_agent_help`."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from localcluster.layout import IMAGES, REPO

from tests import requirements

BUILD = REPO / "scripts" / "build-image.sh"


def _inputs() -> set[str]:
    """build-image.sh's INPUTS: what its content key hashes."""
    m = re.search(r"^INPUTS=\(([^)]*)\)", BUILD.read_text(), re.M)
    assert m, "no INPUTS=(...) in build-image.sh"
    return set(m[1].split())


def _copied() -> set[str]:
    """Every source path the Dockerfile COPYs from the build context (not --from a stage)."""
    out: set[str] = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not parts[1].startswith("--from"):
            out |= set(parts[1:-1])
    return out


def _admitted(path: str) -> bool:
    """Whether .dockerignore lets `path` into the build context (its last matching rule wins)."""
    keep = True
    for rule in (REPO / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or pattern == "*":
            keep = negate
    return keep


def test_the_build_sees_what_the_key_hashes() -> None:
    """Each file the Dockerfile copies is let in by .dockerignore (the first build here stopped at
    once on scripts/lib.sh, left out) and hashed into the content key, so a change to any of them
    makes a new image; the key hashes nothing the build cannot see."""
    copied = _copied()
    assert {"scripts/lib.sh", "criuctl", "hooks", "pyproject.toml"} <= copied, copied
    refused = sorted(p for p in copied if not _admitted(p))
    assert not refused, f".dockerignore leaves out what the Dockerfile copies: {refused}"
    inputs = _inputs()
    assert copied <= inputs, f"copied but not in the content key: {sorted(copied - inputs)}"
    assert inputs - copied == {"Dockerfile", ".dockerignore"}, sorted(inputs - copied)
    assert all((REPO / p).exists() for p in inputs), [p for p in inputs if not (REPO / p).exists()]


@pytest.mark.parametrize("args", [["--bogus"], ["--push"], ["--base"]])
def test_bad_arguments_are_refused_in_one_line(args: list[str]) -> None:
    r = subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and "usage" not in r.stdout.lower()
    assert "build-image.sh" in r.stderr and "--archive-dir" in r.stderr, r.stderr


@pytest.mark.timeout(900)
def test_no_build_secret_lands_in_a_layer() -> None:
    """The machine's CA bundle, pip configuration and apt sources reach the build as secrets: no
    layer of the built image holds a file under /run/secrets, the build's apt sources file, or the
    bytes of the pip configuration the build was given."""
    requirements.require("image-builder")
    r = subprocess.run(
        ["bash", str(BUILD), "--archive-dir", str(IMAGES)], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-2000:]
    _key, tag, archive = r.stdout.strip().splitlines()[-1].split()
    assert re.fullmatch(r"\d+\.\d+\.\d+-g[0-9a-f]{12}(-dirty-[0-9a-f]{16})?", tag), tag
    pip_conf = Path("/etc/pip.conf").read_bytes() if Path("/etc/pip.conf").is_file() else None
    names: list[str] = []
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert manifest[0]["RepoTags"][0].endswith(f"criuctl-agent:{tag}"), manifest[0]["RepoTags"]
        for layer in manifest[0]["Layers"]:
            with tarfile.open(fileobj=outer.extractfile(layer)) as inner:
                for m in inner:
                    names.append(m.name)
                    if pip_conf and m.isfile() and m.name.endswith("pip.conf"):
                        data = inner.extractfile(m).read()  # type: ignore[union-attr]
                        assert data != pip_conf, f"{layer}: {m.name} is the machine's pip.conf"
    assert names, "no layer members read"
    leaked = [n for n in names if n.lstrip("./").startswith("run/secrets/") or n.endswith("build.sources")]
    assert not leaked, leaked
    assert any(n.lstrip("./") == "opt/criuctl/venv/bin/criuctl" for n in names)
