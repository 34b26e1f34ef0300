"""Kubernetes Events and the provenance annotation a migration leaves on the pods it touches, so that
`kubectl describe pod` and `kubectl get events` tell the story without criuctl."""

from __future__ import annotations

import contextlib
import datetime
import os
from enum import StrEnum

from criuctl.kube.cluster import Cluster

MIGRATED_FROM = "criuctl.io/migrated-from"  # on the new pod: "NAMESPACE/POD@NODE"
MIGRATED_AT = "criuctl.io/migrated-at"  # on the new pod: RFC 3339, when it took over


class Reason(StrEnum):
    STARTED = "MigrationStarted"
    PHASE = "MigrationPhase"  # on a PodMigration: the phase it entered
    MIGRATED = "Migrated"
    FAILED = "MigrationFailed"
    THAW_INCOMPLETE = "ThawIncomplete"  # the job runs on its node again; part of its thaw is still undone


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def record(c: Cluster, obj: dict, reason: Reason, message: str) -> None:
    """One Event on `obj` (a pod, or a PodMigration: its apiVersion and kind say); never fails the
    migration it reports on (an Event is a courtesy)."""
    meta = obj["metadata"]
    body = {
        "metadata": {"name": f"{meta['name']}.{os.urandom(8).hex()}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion") or "v1",
            "kind": obj.get("kind") or "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "reason": reason.value,
        "message": message[:1000],
        "type": "Warning" if reason in (Reason.FAILED, Reason.THAW_INCOMPLETE) else "Normal",
        "source": {"component": "criuctl"},
        "firstTimestamp": now(),
        "lastTimestamp": now(),
        "count": 1,
    }
    # an Event that cannot be written changes nothing; one the API server does not answer waits no
    # longer than any call (c.core is bounded: criuctl.kube.api)
    with contextlib.suppress(Exception):
        c.core.create_namespaced_event(meta["namespace"], body)
