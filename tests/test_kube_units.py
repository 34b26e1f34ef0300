"""`criuctl migrate POD NODE`'s and the controller's pure parts: names they give and accept, when
NAME means a pod, the PodMigration's body and conditions, the controller's options and progress."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from criuctl.core.errors import CriuctlError
from criuctl.kube import cluster
from criuctl.kube.podplan import check_name, next_name
from tests.jobs import CRIUCTL


@pytest.mark.parametrize(
    "name, new",
    [
        ("train", "train-m1"),
        ("train-m1", "train-m2"),
        ("train-m9", "train-m10"),
        ("m1", "m1-m1"),
        ("x" * 63, "x" * 60 + "-m1"),
        ("job-m-1", "job-m-1-m1"),
    ],
)
def test_placeholder_names_keep_the_lineage_and_fit(name: str, new: str) -> None:
    assert next_name(name) == new
    assert len(next_name(name)) <= 63


@pytest.mark.parametrize("name", ["train", "train-m1", "a.b-c", "0abc"])
def test_kubernetes_names_pass(name: str) -> None:
    check_name("pod", name)


@pytest.mark.parametrize("name", ["", "Train", "../etc", "a/b", "b;rm", "-a", "a-", "a" * 254, "a b", "ä"])
def test_hostile_names_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(CriuctlError) as e:
        check_name("node", name)
    assert "not a valid node name" in e.value.line()
    assert "\n" not in e.value.line()


def test_a_name_is_a_pod_only_with_a_kubernetes_configuration(monkeypatch, tmp_path) -> None:
    for var in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not cluster.wanted(None, None)
    assert cluster.wanted(None, "default") and cluster.wanted("/x/kubeconfig", None)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "k"))
    assert cluster.wanted(None, None)


# ---------------------------------------------------------------- PodMigration and the controller


def test_a_podmigration_body_is_what_the_schema_takes() -> None:
    """Generated names fit (253 with the API server's 5 characters); the spec has only its fields;
    a drain's record is named after the pod and its UID, annotated as the preStop's."""
    import re

    from criuctl.kube import podmigrations as pm

    long_pod, long_node = "p" * 253, "n" * 253
    obj = pm.body("ml", long_pod, long_node, "stop-and-copy", dry_run=True)
    assert len(obj["metadata"]["generateName"]) + 5 <= 253
    assert obj["spec"] == {"pod": long_pod, "node": long_node, "mode": "stop-and-copy", "dryRun": True}
    assert pm.body("ml", "t", "b")["spec"] == {"pod": "t", "node": "b"}
    named = pm.body("ml", "t", "b", name="move-t", origin="criuctl migrate")
    assert named["metadata"] == {
        "namespace": "ml",
        "name": "move-t",
        "annotations": {pm.ORIGIN: "criuctl migrate"},
    }
    crd = (Path(__file__).resolve().parent.parent / "manifests" / "podmigration-crd.yaml").read_text()
    phases = re.search(r'enum: \[("Pending".*)\]', crd)
    assert phases and [p.strip(' "') for p in phases[1].split(",")] == [str(p) for p in pm.Phase]


def test_a_condition_keeps_when_it_became_true() -> None:
    from criuctl.kube import podmigrations as pm

    obj = {"status": {"conditions": [{"type": "Checked", "status": "True", "lastTransitionTime": "T0"}]}}
    (again,) = pm.condition(obj, "Checked", "ChecksPassed", "m")
    assert again["lastTransitionTime"] == "T0" and again["reason"] == "ChecksPassed"
    assert {c["type"] for c in pm.condition(obj, "Committed", "TargetRunning", "m")} == {
        "Checked",
        "Committed",
    }


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lease-seconds", "5", "--renew-seconds", "10"], "do not fit"),
        (["--retry-seconds", "0"], "do not fit"),
        (["--lease", "Bad_Name"], "not a valid lease name"),
        (["--health", "nowhere"], "is not HOST:PORT"),
    ],
)
def test_bad_controller_options_are_one_line(args: list[str], says: str, tmp_path: Path) -> None:
    """Refused before anything starts (the client's election would sys.exit with its own words)."""
    r = subprocess.run(
        [*CRIUCTL, "controller", "--state-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and says in lines[0], r.stderr


def test_progress_is_written_newest_only_and_never_after_close() -> None:
    """The migration hands its progress over and goes on; the writer sends the newest and, once
    closed (the final status is next), nothing more."""
    import threading

    from criuctl.kube import controller

    written: list[dict] = []
    gate = threading.Event()

    def write(facts: dict) -> None:
        gate.wait(5)
        written.append(facts)

    latest = controller._Latest(write)
    latest.start()
    latest.put({"step": "freeze"})
    time.sleep(0.1)  # the writer took "freeze" and waits on the gate
    for n in range(5):
        latest.put({"step": "transfer", "stepDone": n})
    gate.set()
    time.sleep(controller.PROGRESS_EVERY + 0.3)
    latest.close()
    latest.put({"step": "late"})
    time.sleep(0.2)
    assert written == [{"step": "freeze"}, {"step": "transfer", "stepDone": 4}]


@pytest.mark.parametrize(
    "args",
    [
        ["get", "../etc"],
        ["get", "-n", "a/b"],
        ["migrate", "train", "b", "--as", "../x"],
        ["migrate", "train", "b", "-n", "ns/../kube-system"],
    ],
)
def test_hostile_names_are_refused_before_any_request(args: list[str], tmp_path: Path) -> None:
    """A name that is not a Kubernetes name never reaches a URL: refused in one line, before the
    kubeconfig is even read (this one does not exist)."""
    cfg = tmp_path / "no-such-kubeconfig"
    r = subprocess.run(
        [*CRIUCTL, *args, "--kubeconfig", str(cfg), "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "is not a valid" in lines[0], r.stderr
