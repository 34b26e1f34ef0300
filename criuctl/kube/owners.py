"""Which controllers recreate a deleted pod under the same name, and whether they want it back.

A StatefulSet recreates ordinal N while N < replicas; the training operator recreates a
PyTorchJob's replica (the local cluster's stand-in does the same). For those, a migrated pod keeps
its name by being recreated as the placeholder (criuctl.kube.moves). A ReplicaSet's or a Job's
pods get new names: nothing could tell their successor from any other pod, so they are not moved.
"""

from __future__ import annotations

from dataclasses import dataclass

from criuctl.kube.cluster import Cluster, NotFound, call

SAME_NAME = ("StatefulSet", "PyTorchJob")


@dataclass
class Owner:
    kind: str
    name: str
    replicas: int  # of the whole job (PyTorchJob) or the set
    wants_back: bool  # it exists, is not being deleted, and still counts this pod among its own
    why: str = ""  # when not wants_back


def controller_ref(pod: dict) -> dict | None:
    return next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def owner(c: Cluster, pod: dict) -> Owner | None:
    """The pod's controller, if it is one that recreates by name; None for a bare pod.

    Raises nothing for a controller of another kind: the caller refuses it with its kind named."""
    ref = controller_ref(pod)
    if ref is None or ref["kind"] not in SAME_NAME:
        return None
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    try:
        if ref["kind"] == "StatefulSet":
            obj = c.serialize(
                call(f"StatefulSet {ref['name']}", c.apps.read_namespaced_stateful_set, ref["name"], ns)
            )
            replicas = int(obj["spec"].get("replicas", 1))
            ordinal = int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[-1].isdigit() else 0
            counted, why = ordinal < replicas, f"the StatefulSet now has {replicas} replica(s)"
        else:
            obj = call(
                f"PyTorchJob {ref['name']}",
                c.custom.get_namespaced_custom_object,
                "kubeflow.org",
                "v1",
                ns,
                "pytorchjobs",
                ref["name"],
            )
            specs = obj.get("spec", {}).get("pytorchReplicaSpecs", {})
            replicas = sum(int(s.get("replicas", 1)) for s in specs.values())
            done = any(
                c_["type"] in ("Succeeded", "Failed") and c_["status"] == "True"
                for c_ in obj.get("status", {}).get("conditions") or []
            )
            counted, why = not done, "the PyTorchJob has finished"
    except NotFound:
        return Owner(ref["kind"], ref["name"], 0, False, f"its {ref['kind']} is gone")
    if obj["metadata"].get("uid") != ref.get("uid"):
        return Owner(ref["kind"], ref["name"], 0, False, f"its {ref['kind']} was replaced")
    if obj["metadata"].get("deletionTimestamp"):
        return Owner(ref["kind"], ref["name"], replicas, False, f"its {ref['kind']} is being deleted")
    return Owner(ref["kind"], ref["name"], replicas, counted, "" if counted else why)
