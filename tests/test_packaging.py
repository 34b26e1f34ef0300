"""criuctl as a user installs it: the sdist and the wheel built from this tree (`python -m build`, as
a release would), installed into an empty venv with its runtime dependencies only.

That venv has no torch, numpy or matplotlib (the `demo` and `dev` extras), so every command run here
checks that the CLI, the node agent and the webhook never need them. Every command runs outside the
checkout, so the hook tree and the CRI client stubs can only come from the wheel (setup.py builds
both in). One venv per module: building and installing costs about a minute, the checks seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.jobs import criuctl
from tests.requirements import needs
from tests.test_errors import assert_error_line
from tests.test_webhook import (
    SIDECAR,
    TRAIN,
    admission,
    call,
    client_context,
    free_port,
    listening,
    make_certs,
    pod,
    service_name,
)

REPO = Path(__file__).resolve().parent.parent
HOOK_FILES = sorted(
    str(p.relative_to(REPO / "hooks")) for p in (REPO / "hooks").rglob("*.py") if "__pycache__" not in p.parts
)
NOT_INSTALLED = ("torch", "numpy", "matplotlib")  # the extras' packages: never a runtime dependency
DOCTOR_LINE = re.compile(r"^(?P<mark>ok|warn|FAIL) +(?P<name>[^:]+): ")


@dataclass(frozen=True)
class Installed:
    """The venv the wheel went into, and a folder outside the checkout where its commands run."""

    venv: Path
    sdist: Path
    work: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, cwd=self.work, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def python(self, code: str) -> object:
        """What `code` prints as JSON on its last line, run by the venv's Python."""
        r = self.run(self.bin("python"), "-c", code)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])


def _source_tree(dest: Path) -> Path:
    """What a fresh clone holds (tracked files, and new ones git does not ignore): no venv, no build/."""
    git = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(git, cwd=REPO, capture_output=True, check=True, timeout=60).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the work tree is not part of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    return dest


def _step(argv: list[str], what: str, timeout: float) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{what} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    src, dist, venv, work = root / "src", root / "dist", root / "venv", root / "work"
    work.mkdir()
    # the sdist, then the wheel from it (so that the sdist must hold everything the build reads)
    _step([sys.executable, "-m", "build", "--outdir", str(dist), str(_source_tree(src))], "building", 600)
    (wheel,) = dist.glob("criuctl-*.whl")
    (sdist,) = dist.glob("criuctl-*.tar.gz")
    _step([sys.executable, "-m", "venv", str(venv)], "creating a venv", 120)
    # its runtime dependencies from the package index pip is configured with, as a user installs it
    _step([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], "pip install", 600)
    return Installed(venv, sdist, work)


def test_the_wheel_carries_the_hook_tree_and_the_cri_stubs_and_no_extra_is_installed(installed):
    with tarfile.open(installed.sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    assert "hooks/sitecustomize.py" in names and "setup.py" in names
    assert not [n for n in names if n.startswith(("build/", "criuctl_cri/"))], "generated files in the sdist"
    absent = installed.python(
        "import importlib, json\n"
        "def absent(m):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError:\n"
        "        return True\n"
        "    return False\n"
        f"print(json.dumps([m for m in {list(NOT_INSTALLED)!r} if absent(m)]))"
    )
    assert absent == list(NOT_INSTALLED), "the venv has what only the extras should bring"
    found = installed.python(
        "import importlib.util, json, criuctl\n"
        "from criuctl_hook.contract import HOOKS_DIR\n"
        "cri = importlib.util.find_spec('criuctl_cri')\n"
        "if cri:\n"
        "    importlib.import_module('criuctl_cri.api_pb2_grpc')  # with the grpcio and protobuf installed\n"
        "files = sorted(str(p.relative_to(HOOKS_DIR)) for p in HOOKS_DIR.rglob('*.py')"
        " if '__pycache__' not in p.parts)\n"
        "print(json.dumps({'criuctl': criuctl.__file__, 'cri': cri and cri.origin, 'hooks': str(HOOKS_DIR),"
        " 'files': files}))"
    )
    site = Path(found["criuctl"]).parent.parent
    assert site.is_relative_to(installed.venv), f"criuctl imported from {found['criuctl']}, not the venv"
    assert found["cri"] == str(site / "criuctl_cri" / "__init__.py"), "no CRI stubs: run scripts/cri-proto.sh"
    # the folder a workload gets on PYTHONPATH, and the inject dir copies: the hook files and nothing else
    assert found["hooks"] == str(site / "criuctl" / "hooks")
    assert found["files"] == HOOK_FILES


def test_every_module_imports_without_the_extras(installed):
    """Not only what the commands below reach: every module, lazily imported or not (the demo's
    training script is the one that is torch, and runs only as the demo's job)."""
    failed = installed.python(
        "import importlib, json, pkgutil, criuctl\n"
        "failed = {}\n"
        "for m in pkgutil.walk_packages(criuctl.__path__, 'criuctl.'):\n"
        "    if m.name.endswith('__main__') or m.name == 'criuctl.cli.examples.train_demo':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as exc:\n"
        "        failed[m.name] = str(exc)\n"
        "print(json.dumps(failed))"
    )
    assert failed == {}


def test_help_and_the_demo_without_its_extra(installed):
    r = installed.run(installed.bin("criuctl"), "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: criuctl"), r.stderr
    r = installed.run(installed.bin("criuctl"), "--version")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert r.returncode == 0 and r.stdout.startswith(f"criuctl {version}, Python "), r
    r = installed.run(installed.bin("criuctl"), "demo")
    assert_error_line(r, "lacks torch and matplotlib", "pip install 'criuctl[demo]'")
    assert r.returncode == 1


@needs("root", "criu")
def test_doctor_before_and_after_the_node_install_of_pycriu(installed):
    """`pip install` then `criuctl doctor`: one line per check and the status that says whether a
    required one failed; pycriu, which no package index has (it comes from CRIU's build), is named as
    missing. After scripts/install-criu.sh VENV, as a node's install runs it: the checkout's report."""
    r = installed.run(installed.bin("criuctl"), "doctor")
    assert r.stderr == "" and r.returncode == 1, r
    assert _doctor_lines(r.stdout)["CRIU"] == "FAIL" and "pycriu is not installed" in r.stdout, r.stdout
    _step(["bash", str(REPO / "scripts" / "install-criu.sh"), str(installed.venv)], "install-criu.sh", 300)
    r, checkout = installed.run(installed.bin("criuctl"), "doctor"), criuctl("doctor")
    assert r.stderr == "", r.stderr
    assert _doctor_lines(r.stdout) == _doctor_lines(checkout.stdout), (r.stdout, checkout.stdout)
    assert r.returncode == checkout.returncode == (1 if "FAIL" in _doctor_lines(r.stdout).values() else 0)


def _doctor_lines(stdout: str) -> dict[str, str]:
    """check name -> ok, warn or FAIL, asserting that every line is one check."""
    lines = [DOCTOR_LINE.match(line) for line in stdout.splitlines()]
    assert lines and all(lines), stdout
    return {m["name"]: m["mark"] for m in lines if m}


@needs("root")
def test_the_agent_serves_and_writes_the_inject_dir_from_the_wheel(installed, tmp_path):
    port, token = free_port(), tmp_path / "token"
    token.write_text("packaging-test-token\n")
    token.chmod(0o600)
    listen = ["--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--insecure", "--name", "wheel"]
    dirs = ["--state-dir", str(tmp_path / "state"), "--inject-dir", str(tmp_path / "inject")]
    argv = [installed.bin("criuctl"), "agent", *listen, *dirs]
    with listening(argv, port, tmp_path / "agent.log"):
        url = f"http://127.0.0.1:{port}"
        assert requests.get(f"{url}/healthz", timeout=30).ok
        auth = {"Authorization": "Bearer packaging-test-token"}
        r = requests.get(f"{url}/v1/workloads", headers=auth, timeout=30)
        assert r.status_code == 200, r.text
    hooks = tmp_path / "inject" / "hooks"
    copied = sorted(str(p.relative_to(hooks)) for p in hooks.rglob("*") if p.is_file())
    assert copied == HOOK_FILES, (tmp_path / "agent.log").read_text()[-2000:]
    assert (tmp_path / "inject" / "nsinit.py").is_file()


@needs("openssl")
def test_the_webhook_serves_from_the_wheel(installed, tmp_path):
    certs, port = make_certs(tmp_path / "tls"), free_port()
    tls = ["--tls-cert", str(certs / "tls.crt"), "--tls-key", str(certs / "tls.key")]
    argv = [installed.bin("criuctl"), "webhook", "--listen", f"127.0.0.1:{port}", *tls]
    with listening(argv, port, tmp_path / "webhook.log"):
        ctx, name = client_context(certs / "ca.crt"), service_name()
        assert asyncio.run(call(port, ctx, name)) == (200, "ok\n")
        status, answer = asyncio.run(call(port, ctx, name, admission(pod(TRAIN, SIDECAR))))
        assert status == 200 and answer["response"]["allowed"] is True and answer["response"]["patch"]


@needs("root")
def test_a_workload_gets_the_hook_from_the_wheel(installed):
    """`criuctl run` puts the wheel's hook tree on the job's PYTHONPATH: its sitecustomize loads the
    hook into the job's Python before the job's first line."""
    code = (
        "import json, os, sys; m = sys.modules.get('criuctl_hook'); "
        "print(json.dumps([m and m.__file__, os.environ.get('CRIUCTL_HOOKS_DIR')]))"
    )
    r = installed.run(
        installed.bin("criuctl"), "run", "--name", "hooked", "--", installed.bin("python"), "-c", code
    )
    assert r.returncode == 0, r.stderr
    hook, hooks_dir = json.loads(r.stdout.strip().splitlines()[-1])
    assert hooks_dir is not None and Path(hooks_dir).is_relative_to(installed.venv), hooks_dir
    assert hook == str(Path(hooks_dir) / "criuctl_hook" / "__init__.py")
