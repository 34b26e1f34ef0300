import os
import shutil
import subprocess

import pytest

from criuctl.workloads import ENV_STATE_DIR

# `make test` sets this: there, a missing CRIU is a failure, never a skip (it installed CRIU itself)
ENV_REQUIRE = "CRIUCTL_TESTS_REQUIRE_CRIU"


def _missing_for_criu() -> str | None:
    if os.geteuid() != 0:
        return "needs root: CRIU freezes processes with ptrace (CI runs as root)"
    missing = None
    if shutil.which(os.environ.get("CRIUCTL_CRIU", "criu")) is None:
        missing = "needs CRIU >= 4.0 on PATH: run `make test`, which installs it"
    else:
        try:
            import pycriu  # noqa: F401
        except ImportError:
            missing = "needs pycriu in this Python: run `make test`, which installs it"
    if missing and os.environ.get(ENV_REQUIRE) == "1":
        raise pytest.UsageError(f"make test installed CRIU, yet the tests cannot use it: {missing}")
    return missing


REASON = _missing_for_criu()
needs_criu = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(script, *args)`: an uninterrupted run's losses and weights, run once per session."""
    from tests.jobs import Ref

    cache: dict[tuple[str, ...], Ref] = {}

    def get(script: str, *args: str) -> Ref:
        key = (script, *args)
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
    monkeypatch.setenv(ENV_STATE_DIR, str(d))
    return d


@pytest.fixture(autouse=True)
def no_leaked_workloads(state_dir):
    """Fail a test that leaves a workload process behind; then kill it."""
    yield
    from criuctl import workloads

    if not state_dir.exists():
        return
    leaked = [w for w in workloads.all_workloads() if w.alive()]
    for w in leaked:
        subprocess.run(["kill", "-9", str(w.root_pid)], check=False)
    assert not leaked, f"test left workloads running: {[w.name for w in leaked]}"


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory):
    """A real Kubernetes on this machine (criuctl.localcluster): apiserver, etcd, scheduler,
    controller-manager, two kubelet nodes with containerd, criuctl's agent as the DaemonSet, the
    webhook registered by URL. Up once per session (~25 s), down at its end, leaving nothing."""
    from criuctl.localcluster import __main__ as lc
    from criuctl.localcluster.layout import K8S_BIN, Layout
    from tests.cluster import _free_subnet
    from tests.kube import Kubectl

    missing = REASON or (
        None if (K8S_BIN / "kube-apiserver").exists() else
        f"needs Kubernetes v1.20.2 in {K8S_BIN}: run `make test`, which builds it "
        "(scripts/install-kubernetes.sh)"
    )  # fmt: skip
    if missing:
        if os.environ.get(ENV_REQUIRE) == "1":
            raise pytest.UsageError(f"make test installed everything, yet: {missing}")
        pytest.skip(missing)
    net = _free_subnet(123)
    lay = Layout(tmp_path_factory.mktemp("kube"), prefix=f"k{net.split('.')[1]}", net=net)
    try:
        lc.up(lay)
        yield lay, Kubectl(lay)
    finally:
        lc.down(lay)
