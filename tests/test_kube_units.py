"""`criuctl migrate POD NODE`'s pure parts: names it gives and accepts, and when NAME means a pod."""

from __future__ import annotations

import pytest

from criuctl.core.errors import CriuctlError
from criuctl.kube import cluster
from criuctl.kube.podplan import check_name, next_name


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
