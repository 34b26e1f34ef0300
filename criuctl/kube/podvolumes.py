"""Whether a pod's volumes can follow it to a node, from what the API server says of them.

The agents see mounts and decide what a dump carries of each (criuctl.container.volumes); only the API server
knows what a volume *is*: which PersistentVolume a claim is bound to, which nodes a local PV lives
on, whether a disk is attached to one node at a time. `criuctl migrate POD NODE` asks here before
anything changes, and a preStop checkpoint that picks the node itself passes over the nodes a volume
cannot reach. What follows (docs/containers.md, "Volumes"):

    emptyDir, hostPath, configMap, secret,      yes: carried, or made on the target (the agents
    projected, downwardAPI, nfs, cephfs, …      check what they can)
    persistentVolumeClaim                       when Bound, its PV reachable from NODE (node affinity)
                                                and not a ReadWriteOnce disk attached to one node
    ephemeral, gitRepo, inline disks and csi,   no: the target would get other files, or none
    anything else
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from criuctl.kube.cluster import Cluster, NotFound, call

# what the agents move or the target's kubelet makes alike (criuctl.container.volumes decides which)
FOLLOWS = frozenset({"emptyDir", "hostPath", "configMap", "secret", "projected", "downwardAPI"})
# network filesystems: every node mounting them sees the same files
SHARED = frozenset({"nfs", "cephfs", "glusterfs", "azureFile", "quobyte"})
# disks attached to one node at a time unless their claim allows many (ReadWriteMany, ReadOnlyMany)
ATTACHED = frozenset(
    {
        "awsElasticBlockStore",
        "gcePersistentDisk",
        "azureDisk",
        "cinder",
        "rbd",
        "iscsi",
        "fc",
        "vsphereVolume",
        "photonPersistentDisk",
        "portworxVolume",
        "scaleIO",
        "storageos",
        "flocker",
        "csi",
    }
)
# what no node but this pod's own sees alike
NEVER = {
    "ephemeral": (
        "is a generic ephemeral volume: its claim belongs to this pod, is deleted with it, and a "
        "new pod gets a new, empty one",
        "keep what the job must not lose in an emptyDir (carried) or a PersistentVolumeClaim",
    ),
    "gitRepo": (
        "is a gitRepo volume, cloned anew for each pod (maybe at another commit)",
        "clone it in an init container into an emptyDir, which moves with the job",
    ),
}
MANY_NODES = frozenset({"ReadWriteMany", "ReadOnlyMany"})
NOT_KINDS = frozenset({"name"})  # the keys of a pod volume (and a PV spec) that are not its source
PV_NOT_KINDS = frozenset(
    {
        "accessModes",
        "capacity",
        "claimRef",
        "mountOptions",
        "nodeAffinity",
        "volumeMode",
        "persistentVolumeReclaimPolicy",
        "storageClassName",
    }
)


@dataclass(frozen=True)
class Refusal:
    """Why volume `volume` (its name in the pod spec) cannot follow the pod, and what to do."""

    volume: str
    what: str
    hint: str


def kind(volume: dict[str, Any], not_kinds: frozenset[str] = NOT_KINDS) -> str:
    """The source a pod volume (or a PV spec) names: `emptyDir`, `persistentVolumeClaim`, …"""
    return next((k for k in volume if k not in not_kinds), "unknown")


def check(pod: dict, node: dict, claims: dict[str, dict], pvs: dict[str, dict]) -> Refusal | None:
    """The first volume of `pod` that cannot follow it to `node`, given the claims of its namespace
    and the PVs they are bound to (by name; a missing one is absent); None when all can."""
    target = node["metadata"]["name"]
    for v in pod["spec"].get("volumes") or []:
        name, k = v["name"], kind(v)
        if k in FOLLOWS or k in SHARED:
            continue
        if k == "persistentVolumeClaim":
            why = _claim(v[k]["claimName"], target, node, claims, pvs)
            if why is not None:
                return Refusal(name, *why)
            continue
        if k in NEVER:
            return Refusal(name, *NEVER[k])
        if k in ATTACHED:
            what = f"an inline {k} disk"
            if k == "csi":
                what = f"an inline csi volume (driver {v[k].get('driver', '?')})"
            return Refusal(
                name,
                f"is {what}, made or attached for one pod on one node: nothing says node {target} would see "
                "the same files",
                "use a PersistentVolumeClaim of storage every node reaches (ReadWriteMany)",
            )
        return Refusal(
            name,
            f"is a {k} volume, which criuctl does not know how to move",
            "docs/containers.md lists the kinds of volumes that move",
        )
    return None


def _claim(
    claim: str, target: str, node: dict, claims: dict[str, dict], pvs: dict[str, dict]
) -> tuple[str, str] | None:
    pvc = claims.get(claim)
    if pvc is None:
        return f"names PersistentVolumeClaim {claim}, which does not exist", "create it, or fix the pod"
    phase = (pvc.get("status") or {}).get("phase") or "not bound"
    if phase != "Bound":
        return f"is PersistentVolumeClaim {claim}, which is {phase}", "wait until it is Bound"
    pv_name = pvc["spec"].get("volumeName", "")
    pv = pvs.get(pv_name)
    if pv is None:
        return (
            f"is PersistentVolumeClaim {claim}, bound to PersistentVolume {pv_name}, which is gone",
            "see `kubectl get pv`",
        )
    terms = ((((pv["spec"].get("nodeAffinity") or {}).get("required")) or {}).get("nodeSelectorTerms")) or []
    if terms and not any(_term_matches(t, node) for t in terms):
        return (
            f"is PersistentVolumeClaim {claim}, bound to PersistentVolume {pv_name}, which node {target} "
            "cannot reach (its node affinity leaves it out: a local disk of another node)",
            f"pick a node the PV allows (`kubectl get pv {pv_name} -o yaml`), or keep the job's data on "
            "storage every node reaches",
        )
    source = kind(pv["spec"], PV_NOT_KINDS)
    modes = set((pvc.get("status") or {}).get("accessModes") or pvc["spec"].get("accessModes") or [])
    if source in ATTACHED and not modes & MANY_NODES:
        return (
            f"is PersistentVolumeClaim {claim}, a ReadWriteOnce {source} volume: attached to one node at "
            f"a time, it cannot be mounted on node {target} while the job runs where it is",
            "use a ReadWriteMany storage class for data a job keeps across nodes",
        )
    return None


def _term_matches(term: dict, node: dict) -> bool:
    """A NodeSelectorTerm (its expressions ANDed) against `node`'s labels and name."""
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    exprs = [(e, labels) for e in term.get("matchExpressions") or []]
    exprs += [(e, fields) for e in term.get("matchFields") or []]
    return bool(exprs) and all(_expr_matches(e, have) for e, have in exprs)


def _expr_matches(e: dict, have: dict[str, str]) -> bool:
    key, op, values = e["key"], e["operator"], e.get("values") or []
    if op == "In":
        return have.get(key) in values
    if op == "NotIn":
        return have.get(key) not in values
    if op == "Exists":
        return key in have
    if op == "DoesNotExist":
        return key not in have
    if op in ("Gt", "Lt") and key in have and values:
        try:
            a, b = int(have[key]), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def fetch(c: Cluster, pod: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """The claims the pod's volumes name and the PVs they are bound to (what `check` takes)."""
    namespace = pod["metadata"]["namespace"]
    claims: dict[str, dict] = {}
    pvs: dict[str, dict] = {}
    for v in pod["spec"].get("volumes") or []:
        if "persistentVolumeClaim" not in v:
            continue
        name = v["persistentVolumeClaim"]["claimName"]
        read = c.core.read_namespaced_persistent_volume_claim
        try:
            claims[name] = c.serialize(call(f"claim {namespace}/{name}", read, name, namespace))
        except NotFound:
            continue
        pv = claims[name]["spec"].get("volumeName")
        if pv and pv not in pvs:
            try:
                pvs[pv] = c.serialize(call(f"PersistentVolume {pv}", c.core.read_persistent_volume, pv))
            except NotFound:
                continue
    return claims, pvs
