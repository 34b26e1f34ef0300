"""The agent image (`make image`, scripts/build-image.sh, the Dockerfile): the build sees exactly the
inputs its content key hashes, the machine's package configuration never lands in a layer, and the
script refuses bad input in one line. The image running in pods (doctor, agent --help, contents) is
tests/test_kube.py's `test_agent_image_runs_doctor_and_agent_help`."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
from localcluster.layout import IMAGES, REPO

from tests import requirements
from tests.test_webhook import free_port

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
    bytes of the pip configuration the build was given. A second call with the same content builds
    nothing (same key, same archive): the base made here is found again, not made anew."""
    requirements.require("image-builder")
    r = subprocess.run(
        ["bash", str(BUILD), "--archive-dir", str(IMAGES)], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-2000:]
    key, tag, archive = r.stdout.strip().splitlines()[-1].split()
    again = subprocess.run(
        ["bash", str(BUILD), "--archive-dir", str(IMAGES)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and "reusing" in again.stderr, again.stderr[-1500:]
    assert again.stdout.split()[-3:] == [key, tag, archive], "the same content had another key: no reuse"
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
    build_sources = ("sources.list.d/build.sources", "sources.list.d/build.list")
    leaked = [n for n in names if n.lstrip("./").startswith("run/secrets/") or n.endswith(build_sources)]
    assert not leaked, leaked
    assert any(n.lstrip("./") == "opt/criuctl/venv/bin/criuctl" for n in names)


@pytest.fixture
def registry(tmp_path: Path):
    """A real registry (Debian's docker-registry, the CNCF distribution server) on loopback, and a
    registries.conf that makes it docker.io's mirror: the machine as it is where a registry answers."""
    requirements.require("docker-registry")
    port = free_port()
    cfg = tmp_path / "registry.yml"
    cfg.write_text(
        "version: 0.1\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    conf = tmp_path / "registries.conf"
    conf.write_text(
        "unqualified-search-registries = []\n"
        f'[[registry]]\nprefix = "docker.io"\nlocation = "127.0.0.1:{port}"\ninsecure = true\n'
        f'[[registry]]\nlocation = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    url = f"http://127.0.0.1:{port}/v2/"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "the registry did not start"
            time.sleep(0.2)
    env = {**os.environ, "CONTAINERS_REGISTRIES_CONF": str(conf)}
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        proc.kill()
        proc.wait()
        # the mirror's base must not outlive the test as this machine's "pulled" base
        subprocess.run(["buildah", "rmi", "docker.io/library/debian:bookworm-slim"], capture_output=True)


def _manifest(registry: str, repo: str, tag: str) -> dict:
    req = urllib.request.Request(
        f"http://{registry}/v2/{repo}/manifests/{tag}",
        headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json, "
            "application/vnd.docker.distribution.manifest.v2+json"
        },
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


@pytest.mark.timeout(900)
def test_with_a_registry_the_base_is_pulled_and_the_image_pushed(registry) -> None:
    """Where a registry answers, `make image` pulls debian:bookworm-slim instead of making a base,
    and `--push REPO` puts the image there under its version-and-commit tag, config digest and all.
    The registry is this machine's own (Debian's docker-registry as docker.io's mirror): no public
    registry is reachable here; its content is the base this machine made with mmdebstrap."""
    address, env = registry
    first = subprocess.run(
        ["bash", str(BUILD), "--archive-dir", str(IMAGES)], capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stderr[-2000:]
    local_base = re.search(r"base image: (\S+)", first.stderr)
    assert local_base and "criuctl-base" in local_base[1], first.stderr[-800:]
    subprocess.run(
        ["buildah", "push", "-q", local_base[1], f"docker://{address}/library/debian:bookworm-slim"],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    r = subprocess.run(
        ["bash", str(BUILD), "--refresh-base", "--push", f"{address}/criuctl-agent"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "base image: docker.io/library/debian:bookworm-slim" in r.stderr, r.stderr[-800:]
    assert "mmdebstrap" not in r.stderr, "a base was made although the registry answered"
    _key, tag = r.stdout.strip().splitlines()[-1].split()[:2]
    pushed = _manifest(address, "criuctl-agent", tag)
    local = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", f"criuctl-agent:{tag}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert pushed["config"]["digest"] == f"sha256:{local}", (pushed["config"], local)
