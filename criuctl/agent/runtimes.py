"""The agent's view of the node's container runtime: containers as workloads.

    GET /v1/containers      every container on the node, and whether criuctl can checkpoint it

A container becomes a workload the first time it is listed or named (`ctr-<12 hex>`, or its ID):
from then on `migrate`, `checkpoint` and `logs` treat it like a `criuctl run` job. The runtime is
asked on every call, never cached: containers come and go with the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING

from aiohttp import web

from criuctl.container import containers, runtime
from criuctl.core import workloads
from criuctl.core.errors import CriuctlError

if TYPE_CHECKING:
    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.agent")


class Runtimes:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.endpoint = agent.opts.runtime_endpoint or runtime.endpoint()

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/containers", self.list_containers)

    def connect(self) -> runtime.Runtime:
        return runtime.connect(self.endpoint)

    async def list_containers(self, _r: web.Request) -> web.Response:
        try:
            return web.json_response(await asyncio.to_thread(lambda: containers.rows(self.connect())))
        except CriuctlError as exc:
            return self.agent.error_response(exc)

    def resolve(self, name: str) -> workloads.Workload:
        """A workload by name or PID, or a container by `ctr-<id>` or ID (registered on the way)."""
        return containers.resolve(name, self.endpoint)

    def register_all(self) -> list[workloads.WorkloadRow]:
        """Register every checkpointable container; rows for the others (why they are not workloads).
        A node without a runtime has no containers: not an error."""
        sock = self.endpoint.removeprefix("unix://")
        if self.endpoint != "procfs" and not os.path.exists(sock):
            return []
        with contextlib.suppress(runtime.RuntimeUnavailable):
            return containers.unsupported_rows(self.connect())
        return []

    def prepare_inject_dir(self) -> None:
        """The files checkpointable containers mount (criuctl's init and hook), fresh at every start."""
        try:
            path = containers.write_inject_dir(self.agent.opts.inject_dir or containers.INJECT_DIR)
            log.info("inject dir ready", extra={"path": str(path)})
        except OSError as exc:
            log.warning("cannot write the inject dir", extra={"error": str(exc)})
