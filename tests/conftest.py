import ast
import collections
import contextlib
import gc
import os
import subprocess

import pytest

from criuctl.core.env import STATE_DIR
from tests import requirements
from tests.requirements import needs

# What the suite needs and what `make test` does when it is missing: tests/requirements.py
pytest_configure = requirements.pytest_configure
pytest_sessionstart = requirements.pytest_sessionstart
pytest_runtest_setup = requirements.pytest_runtest_setup

needs_criu = needs("criu")


def parse_python(source: str) -> ast.Module:
    """`ast.parse`, with the garbage collector held off: CPython 3.11.7 raises "SystemError: AST
    constructor recursion depth mismatch" when a finalizer runs Python code while the tree is
    built (CI, 2026-12-06: an asyncio future's __del__ logging in the middle of a parse)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(script, *args)`: an uninterrupted run's losses and weights, run once per session."""
    from tests.jobs import Ref, undelayed

    cache: dict[tuple[str, ...], Ref] = {}

    def get(script: str, *args: str) -> Ref:
        key = (script, *undelayed(script, *args))  # one run for any pace of the same job
        if key not in cache:
            cache[key] = Ref(tmp_path_factory.mktemp("ref"), script, *args)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two nodes, each with its own containerd and criuctl agent (tests/containerd.py)."""
    from tests.containerd import two_nodes

    yield from two_nodes(tmp_path_factory)


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    """Each test gets its own criuctl state dir (registry, signing key), like its own node."""
    d = tmp_path / "state"
    monkeypatch.setenv(STATE_DIR, str(d))
    return d


@pytest.fixture(autouse=True)
def no_leaked_workloads(state_dir):
    """Fail a test that leaves a workload process behind; then kill it."""
    yield
    from criuctl.core import workloads

    if not state_dir.exists():
        return
    leaked = [w for w in workloads.all_workloads() if w.alive()]
    for w in leaked:
        subprocess.run(["kill", "-9", str(w.root_pid)], check=False)
    assert not leaked, f"test left workloads running: {[w.name for w in leaked]}"


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory):
    """A real Kubernetes on this machine (localcluster): apiserver, etcd, scheduler,
    controller-manager, two kubelet nodes with containerd, criuctl's agent as the DaemonSet running
    the image built from the Dockerfile (checked before any test uses the cluster), the webhook
    registered by URL. Up once per session (~25 s, the image built once per content of its inputs
    and cached), down at its end, leaving nothing."""
    from localcluster import __main__ as lc
    from localcluster.layout import Layout

    from tests.cluster import _free_subnet
    from tests.kube import Kubectl, criuctl_runs_the_built_image

    for name in ("criu", "kubernetes", "image-builder"):
        requirements.require(name)
    lay = Layout(tmp_path_factory.mktemp("kube"), net=_free_subnet(123))  # beside a user's cluster
    lc.check_free(lay)  # outside the `finally`: a taken net is another cluster's, not ours to take down
    try:
        lc.up(lay)
        criuctl_runs_the_built_image(lay, Kubectl(lay))
        yield lay, Kubectl(lay)
    finally:
        _keep_logs(lay, tmp_path_factory.mktemp("kube-logs"))
        lc.down(lay)


def _keep_logs(lay, into) -> None:
    """What explains a failed move after the cluster is gone (`down` removes its folder; the
    session's folder is kept when a test failed): the control plane's logs, each node's criuctl
    pods' logs (every restart's) and the CRIU logs in the agents' state."""
    import shutil

    def small(src: str, names: list[str]) -> set[str]:  # no images, bundles or job files
        return {
            n
            for n in names
            if os.path.isfile(f"{src}/{n}")
            and (not n.endswith(".log") or os.path.getsize(f"{src}/{n}") > 20 << 20)
        }

    with contextlib.suppress(OSError):
        shutil.copytree(lay.dir / "logs", into / "control-plane")
    for node in lay.nodes:
        here = lay.node_dir(node)
        for pods in (here / "var-log-pods").glob("criuctl-system_*"):
            with contextlib.suppress(OSError):
                shutil.copytree(pods, into / node / "pods" / pods.name)
        with contextlib.suppress(OSError):
            shutil.copytree(here / "var-lib-criuctl", into / node / "criuctl", ignore=small, symlinks=True)


_MODULE_SECONDS: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report) -> None:
    _MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Seconds each module took (setup, call and teardown): what `scripts/run-tests.sh` balances
    its sessions by, and where CI's time goes (a session's module-scoped fixtures, the local
    cluster's start among them, count in the module that first used them)."""
    if not _MODULE_SECONDS:
        return
    terminalreporter.write_sep("=", "seconds per module")
    for module, seconds in _MODULE_SECONDS.most_common():
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
