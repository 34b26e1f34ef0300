"""What the test suite needs from this machine, and why: the one table every skip for a missing
tool, package or kernel feature goes through.

`make test` installs what can be installed (scripts/bootstrap.sh, scripts/test-fixtures.sh) and then
runs pytest with CRIUCTL_TESTS_REQUIRE_ALL=1. Under that variable a missing requirement that make
test installs or checks is an error, never a skip: a suite that skips the containerd modules, or the
post-copy test, because an install quietly failed would pass while testing far less than it says.
The session stops before collecting anything, with one line per missing requirement. Without the
variable (a bare `pytest` on a developer's machine) each test that needs something missing is
skipped with the reason and how to get it. Only what no install can give (a GPU) is a skip either way.

Tests ask with `needs(NAME, ...)` (a mark) or, inside a fixture, `require(NAME)`. The probes run at
most once per session, and only when a test (or make test's variable) asks.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
from localcluster.layout import BUSYBOX_TAR, CACHE, K8S_BIN

from criuctl.core.env import CRIU, TESTS_REQUIRE_ALL

ENV_REQUIRE_ALL = TESTS_REQUIRE_ALL  # set by `make test` (Makefile), so by .ci/run
MARK = "requires"
CONTAINERD2 = Path(os.environ.get("CRIUCTL_CONTAINERD2", CACHE / "containerd-2"))
INSTALL_CRIU = Path(__file__).parents[1] / "scripts" / "install-criu.sh"
OLD_CRIU = CACHE / "criu-3.17" / "usr" / "sbin" / "criu"  # unpacked by scripts/test-fixtures.sh


class Source(Enum):
    """How `make test` provides a requirement: what its absence means there."""

    MAKE_TEST = "make test installs it (or refuses to start without it: root)"  # absent: an error
    KERNEL = "make test checks it"  # a kernel feature: a kernel without it fails make test
    HARDWARE = "no install provides it"  # a GPU: a skip with its reason, even under make test


class Outcome(Enum):
    RUN = "run"
    SKIP = "skip"
    ERROR = "error"


@dataclass(frozen=True)
class Requirement:
    name: str
    why: str  # what in the suite needs it
    source: Source
    probe: Callable[[], str | None]  # None when present, else what is missing and how to get it

    def outcome(self, missing: str | None, require_all: bool) -> Outcome:
        """Run when present; when absent, an error under make test unless no install can provide it."""
        if missing is None:
            return Outcome.RUN
        if require_all and self.source is not Source.HARDWARE:
            return Outcome.ERROR
        return Outcome.SKIP

    def line(self, missing: str) -> str:
        return f"{self.name} ({self.why}): {missing}"


def _tool(*names: str, install: str) -> Callable[[], str | None]:
    """A probe for a command on PATH (any of `names`)."""

    def probe() -> str | None:
        if any(shutil.which(n) for n in names):
            return None
        return f"no {' or '.join(names)} on PATH: {install}"

    return probe


def _import(module: str, install: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            __import__(module)
        except ImportError as exc:
            return f"cannot import {module} ({exc}): {install}"
        return None

    return probe


def _all(*probes: Callable[[], str | None]) -> Callable[[], str | None]:
    """The first thing missing among several probes."""
    return lambda: next((why for p in probes if (why := p()) is not None), None)


def _file(path: Path, install: str) -> Callable[[], str | None]:
    return lambda: None if path.exists() else f"no {path}: {install}"


def _root() -> str | None:
    return None if os.geteuid() == 0 else "not root: run the tests as root (CI does; make test insists)"


def _criu() -> str | None:
    criu = CRIU.get()
    if shutil.which(criu) is None:
        return f"no {criu} on PATH (CRIU >= 4.2.1): run `make install` (scripts/install-criu.sh)"
    return None


def _kernel(feature: str, lacks: str) -> Callable[[], str | None]:
    """A probe asking CRIU (over its RPC) whether the kernel has `feature` (a criu.Features field).
    A CRIU that cannot answer is missing too: every test that runs CRIU then fails on its own."""

    def probe() -> str | None:
        if (why := _CRIU()) is not None:
            return f"cannot ask CRIU: {why}"
        from criuctl.core.errors import CriuctlError
        from criuctl.engine import criu

        try:
            return None if getattr(criu.features(), feature) else lacks
        except CriuctlError as exc:
            return f"CRIU cannot say whether this kernel has it: {exc.line()}"

    return probe


def _gpu() -> str | None:
    from criuctl.gpu import cuda

    if ctypes.util.find_library("cuda") is None and not cuda.probe().loaded:
        return "no CUDA driver (libcuda.so.1) on this host; run on a GPU node (tests/gpu/check.sh)"
    return None


GPU_RECORD = Path(__file__).parent.parent / "bench" / "results" / "gpu-check.json"


def _gpu_record() -> str | None:
    if not GPU_RECORD.exists():
        return "none recorded yet; run tests/gpu/check.sh on an NVIDIA host (r580+) and commit its results"
    return None


def installed_criu() -> str:
    """The CRIU release `make install` builds (scripts/install-criu.sh's CRIU_VERSION)."""
    lines = INSTALL_CRIU.read_text().splitlines()
    (v,) = [ln.partition("=")[2] for ln in lines if ln.startswith("CRIU_VERSION=")]
    return v


_MAKE_INSTALL = "run `make install`"
_FIXTURES = "run `make test` (scripts/test-fixtures.sh installs it)"


def _fixture_pkg(package: str) -> str:
    return f"run `make test` (scripts/test-fixtures.sh installs Debian's {package})"


_PYCRIU = _import("pycriu", "run `make install` (scripts/install-criu.sh puts it in the venv)")
_CRIU = _all(_root, _criu, _PYCRIU)
_CRI_STUBS = _import("criuctl_cri.api_pb2_grpc", f"{_MAKE_INSTALL} (criuctl's build makes them: setup.py)")
_RUNC = _tool("runc", install=f"{_MAKE_INSTALL} (apt-get install runc)")
_BUSYBOX = _file(BUSYBOX_TAR, f"{_MAKE_INSTALL} (scripts/install-containerd.sh builds it)")


def _tcp_rto_max() -> str | None:
    import socket

    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, 44, 1000)  # TCP_RTO_MAX_MS
        except OSError:
            return f"this kernel ({os.uname().release}) has no TCP_RTO_MAX_MS: use Linux >= 6.15"
    return None


REQUIREMENTS: dict[str, Requirement] = {
    r.name: r
    for r in (
        Requirement(
            "root",
            "CRIU freezes processes with ptrace; run, dump and the agents refuse "
            "to start without root; mounts",
            Source.MAKE_TEST,
            _root,
        ),
        Requirement("criu", "CRIU >= 4.0 and pycriu: every freeze and restore", Source.MAKE_TEST, _CRIU),
        Requirement("pycriu", "reading and writing CRIU image files", Source.MAKE_TEST, _PYCRIU),
        Requirement(
            "criu-3.17", "checking that a CRIU < 4.0 is refused", Source.MAKE_TEST, _file(OLD_CRIU, _FIXTURES)
        ),
        Requirement(
            "containerd",
            "containers of a real runtime over the CRI (two whole modules)",
            Source.MAKE_TEST,
            _all(
                _tool("containerd", install=f"{_MAKE_INSTALL} (apt-get install containerd)"),
                _tool("ctr", install=f"{_MAKE_INSTALL} (apt-get install containerd)"),
                _RUNC,
                _CRI_STUBS,
                _BUSYBOX,
            ),
        ),
        Requirement(
            "containerd-2",
            "the CRI CheckpointContainer call (containerd 1.6 lacks it)",
            Source.MAKE_TEST,
            _all(
                _file(
                    CONTAINERD2 / "bin" / "containerd",
                    "run `make test` (scripts/install-containerd2.sh extracts it)",
                ),
                _RUNC,
                _CRI_STUBS,
                _BUSYBOX,
            ),
        ),
        Requirement(
            "kubernetes",
            "the local Kubernetes (v1.20.2 built from Debian's source)",
            Source.MAKE_TEST,
            _all(
                *(
                    _file(K8S_BIN / b, "run `make test` (scripts/install-kubernetes.sh builds it)")
                    for b in ("kube-apiserver", "kubelet", "kube-proxy")
                ),
                _tool("etcd", install=_FIXTURES),
                _tool("kubectl", install=_FIXTURES),
            ),
        ),
        Requirement(
            "kubectl",
            "rendering manifests/ with kustomize",
            Source.MAKE_TEST,
            _tool("kubectl", install=_FIXTURES),
        ),
        Requirement(
            "kubernetes-validate",
            "offline schema checks of manifests/",
            Source.MAKE_TEST,
            _all(
                _import("kubernetes_validate", "pip install -e '.[dev]' (make install does)"),
                _import("yaml", "pip install -e '.[dev]' (make install does)"),
            ),
        ),
        Requirement(
            "cc",
            "compiling the stand-ins for libcuda and NVML (tests/fakes/*.c)",
            Source.MAKE_TEST,
            _tool(os.environ.get("CC", "cc"), "gcc", install=_fixture_pkg("gcc")),
        ),
        Requirement(
            "image-builder",
            "building the agent image (scripts/build-image.sh: buildah, and mmdebstrap for its base)",
            Source.MAKE_TEST,
            _all(
                _tool("buildah", install=_fixture_pkg("buildah")),
                _tool("mmdebstrap", install=_fixture_pkg("mmdebstrap")),
            ),
        ),
        Requirement(
            "docker-registry",
            "a registry for the agent image's push and pull (Debian's docker-registry, on loopback)",
            Source.MAKE_TEST,
            _tool("docker-registry", install=_fixture_pkg("docker-registry")),
        ),
        Requirement(
            "zstd",
            "CRI-O and podman archives compressed with zstd",
            Source.MAKE_TEST,
            _tool("zstd", install=_fixture_pkg("zstd")),
        ),
        Requirement(
            "openssl", "TLS certificates for agents", Source.MAKE_TEST, _tool("openssl", install=_FIXTURES)
        ),
        Requirement(
            "util-linux",
            "nodes as namespaces (unshare, nsenter)",
            Source.MAKE_TEST,
            _all(_tool("unshare", install=_FIXTURES), _tool("nsenter", install=_FIXTURES)),
        ),
        Requirement(
            "userfaultfd",
            "post-copy, the default migration mode (CRIU lazy pages)",
            Source.KERNEL,
            _kernel(
                "lazy_pages",
                "this kernel has no userfaultfd: post-copy, criuctl's default "
                "mode, cannot be tested here; use a kernel with CONFIG_USERFAULTFD=y "
                "(Debian 12's has it)",
            ),
        ),
        Requirement(
            "tcp-rto-max",
            "bounding the staying ranks' retransmission backoff (criuctl.net.rto)",
            Source.KERNEL,
            _tcp_rto_max,
        ),
        Requirement("gpu", "the real CUDA driver's checkpoint API", Source.HARDWARE, _gpu),
        Requirement(
            "gpu-record",
            "what the real CUDA driver answered, recorded by the GPU check (bench/results/gpu-check.json)",
            Source.HARDWARE,
            _gpu_record,
        ),
    )
}


@functools.cache
def missing(name: str) -> str | None:
    """What is missing for requirement `name`, or None; probed once per session."""
    return REQUIREMENTS[name].probe()


def require_all() -> bool:
    return os.environ.get(ENV_REQUIRE_ALL) == "1"


def needs(*names: str) -> pytest.MarkDecorator:
    """Mark a test (or `pytestmark` a module) as needing `names` from REQUIREMENTS."""
    unknown = set(names) - set(REQUIREMENTS)
    assert not unknown, f"not in tests/requirements.py: {sorted(unknown)}"
    return getattr(pytest.mark, MARK)(*names)


def require(name: str) -> None:
    """Inside a test or fixture: return if `name` is present; else skip, or fail under make test."""
    req = REQUIREMENTS[name]
    why = missing(name)
    outcome = req.outcome(why, require_all())
    if outcome is Outcome.ERROR:
        pytest.fail(f"make test provides this, yet: {req.line(why or '')}", pytrace=False)
    if outcome is Outcome.SKIP:
        pytest.skip(f"needs {req.line(why or '')}")


# ------------------------------------------------------------------ hooks (bound in tests/conftest.py)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(*names): needs these of tests/requirements.py's REQUIREMENTS")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under make test: everything it installs or checks is here, or the run stops now, one line each."""
    if not require_all():
        return
    lines = [
        req.line(why)
        for req in REQUIREMENTS.values()
        if req.outcome(why := missing(req.name), True) is Outcome.ERROR
    ]
    if lines:
        raise pytest.UsageError(
            f"{ENV_REQUIRE_ALL}=1 (make test): missing what make test installs or checks, so nothing "
            "runs:\n  " + "\n  ".join(lines)
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(MARK):
        for name in mark.args:
            require(name)
