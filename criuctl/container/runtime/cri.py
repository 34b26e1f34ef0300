"""The CRI backend: containerd and CRI-O over the Container Runtime Interface (gRPC, `runtime.v1`).

This is the API the kubelet itself speaks, so what criuctl sees is what Kubernetes sees. The Python
stubs (`criuctl_cri`) are generated when criuctl is built (setup.py) from the `api.proto` vendored in
the runtime's source (scripts/cri-proto.sh fetches it), never copied into this repository.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from criuctl.container.runtime import (
    Container,
    RuntimeUnavailable,
    UnknownContainer,
    Unsupported,
    pick,
)
from criuctl.core import env

_STATES = {0: "created", 1: "running", 2: "exited", 3: "unknown"}
_CALL_TIMEOUT = 10.0


def _stubs() -> tuple[Any, Any, Any]:
    # gRPC's C core prints its own errors on stderr; ours say the same in one line
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        import grpc
        from criuctl_cri import api_pb2, api_pb2_grpc
    except ImportError as exc:
        raise RuntimeUnavailable(
            "the CRI client stubs are not installed in this Python",
            "run scripts/cri-proto.sh, then install criuctl again: its build makes them (make install does)",
        ) from exc
    return grpc, api_pb2, api_pb2_grpc


class CRIRuntime:
    def __init__(self, endpoint: str) -> None:
        path = endpoint.removeprefix("unix://")
        if "://" in path or not path.startswith("/"):
            raise RuntimeUnavailable(
                f"{endpoint[:100]!r} is not a runtime socket",
                "give the CRI socket's absolute path, e.g. unix:///run/containerd/containerd.sock",
            )
        self.endpoint = f"unix://{path}"
        grpc, self.pb, rpc = _stubs()
        self._grpc = grpc
        self._channel = grpc.insecure_channel(self.endpoint)
        self._rt = rpc.RuntimeServiceStub(self._channel)
        self._version: str | None = None

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any, timeout: float = _CALL_TIMEOUT, what: str = "") -> Any:
        """One CRI call; gRPC failures become one-line errors that say what to do."""
        grpc = self._grpc
        try:
            return getattr(self._rt, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            code, detail = exc.code(), (exc.details() or "").splitlines()[0:1]
            detail = detail[0] if detail else ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RuntimeUnavailable(
                    f"the container runtime at {self.endpoint} does not answer ({code.name.lower()})",
                    f"check that containerd or CRI-O runs and listens there, or set {env.RUNTIME_ENDPOINT}",
                ) from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise UnknownContainer(
                    f"{what or 'the container'} is not known to the runtime at {self.endpoint}",
                    "see `criuctl ps --node` for the containers on this node",
                ) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise Unsupported(
                    f"the runtime at {self.endpoint} ({self.version()}) does not implement {method}",
                    "use containerd >= 2.0 or CRI-O for runtime checkpoints; criuctl's own dump works anyway",
                ) from None
            raise RuntimeUnavailable(
                f"the container runtime refused {method}: {detail or code.name}", "see the runtime's log"
            ) from None

    def version(self) -> str:
        if self._version is None:
            v = self._call("Version", self.pb.VersionRequest())
            self._version = f"{v.runtime_name} {v.runtime_version}"
        return self._version

    def _sandboxes(self) -> dict[str, Any]:
        found = self._call("ListPodSandbox", self.pb.ListPodSandboxRequest()).items
        return {s.id: s.metadata for s in found}

    def containers(self) -> list[Container]:
        listed = self._call("ListContainers", self.pb.ListContainersRequest()).containers
        pods = self._sandboxes() if listed else {}
        out = []
        for c in listed:
            try:
                out.append(self._describe(c.id, pods))
            except UnknownContainer:
                continue  # removed between the list and the status
        return out

    def container(self, ident: str) -> Container:
        listed = self._call("ListContainers", self.pb.ListContainersRequest()).containers
        brief = [Container(id=c.id, pid=0, state=_STATES.get(c.state, "unknown")) for c in listed]
        return self._describe(pick(ident, brief).id, self._sandboxes())

    def _describe(self, cid: str, pods: dict[str, Any]) -> Container:
        resp = self._call(
            "ContainerStatus", self.pb.ContainerStatusRequest(container_id=cid, verbose=True), what=cid[:12]
        )
        st = resp.status
        info: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            info = json.loads(resp.info.get("info", "{}"))
        sandbox_id = info.get("sandboxID", "")
        pod = pods.get(sandbox_id)
        labels = dict(st.labels)
        return Container(
            id=st.id,
            pid=int(info.get("pid") or 0),
            state=_STATES.get(st.state, "unknown"),
            name=st.metadata.name,
            pod_name=pod.name if pod else labels.get("io.kubernetes.pod.name", ""),
            pod_namespace=pod.namespace if pod else labels.get("io.kubernetes.pod.namespace", ""),
            pod_uid=pod.uid if pod else labels.get("io.kubernetes.pod.uid", ""),
            sandbox_id=sandbox_id,
            image=st.image.image,
            log_path=st.log_path,
            runtime=self.version(),
            labels=labels,
            annotations=dict(st.annotations),
        )

    def checkpoint(self, ident: str, location: str, timeout: float = 300.0) -> None:
        """CRI CheckpointContainer: the runtime writes its checkpoint archive to `location`."""
        c = self.container(ident)
        self._call(
            "CheckpointContainer",
            self.pb.CheckpointContainerRequest(container_id=c.id, location=location, timeout=int(timeout)),
            timeout=timeout + 30,
            what=c.short_id,
        )
