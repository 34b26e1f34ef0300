"""criuctl's Kubernetes side inside the node agent's process (`criuctl agent --prestop-port`):

- a plain-HTTP listener on 127.0.0.1:PORT for the preStop hook the webhook adds to migratable
  pods (GET /v1/prestop/NAMESPACE/POD; criuctl.kube.prestop). Loopback only: the kubelet of this
  node is its one caller (its hooks run in the node's network namespace, like the agent's);
- the loop that restores kept bundles into their pods' successors (criuctl.kube.successors), and
  puts a Job's tracking finalizer back on a pod of this node untracked for a deletion that did not
  come (criuctl.kube.jobfailures.retrack_stale).

The agent's layer knows nothing of Kubernetes: the CLI hands it `extension(...)`, which it calls
with itself and its application at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from criuctl.core.errors import CriuctlError
from criuctl.kube import cluster, jobfailures, prestop, successors

if TYPE_CHECKING:
    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.kube")

TICK = 2.0  # one list of the move records per node per tick: cheap on a cluster of many nodes
TICK_BUSY = 0.2  # while this node is to restore a move: only the holder's (or target's) agent
RETRACK_EVERY = 10.0  # s between two looks for pods untracked for a deletion that did not come


def extension(port: int, kubeconfig: str | None) -> Callable[[Agent, web.Application], None]:
    """What `criuctl agent --prestop-port PORT` adds to the agent; the cluster is reached at start-up
    (a bad configuration stops the agent with one line, before it serves)."""
    c = cluster.connect(kubeconfig)

    def attach(agent: Agent, app: web.Application) -> None:
        runner: list[web.AppRunner] = []

        async def handle(r: web.Request) -> web.Response:
            return await _prestop(r, c, agent.name)

        async def start(_app: web.Application) -> None:
            hook = web.Application()
            # Kubernetes 1.20's kubelet asks for "http://HOST:PORT/" + path: "//v1/prestop/..."
            for prefix in ("/", "//"):
                hook.router.add_get(prefix + "v1/prestop/{namespace}/{pod}", handle)
            r = web.AppRunner(hook, access_log=None)
            await r.setup()
            try:
                await web.TCPSite(r, "127.0.0.1", port).start()
            except OSError as exc:
                raise CriuctlError(
                    f"the agent could not serve its preStop hook on 127.0.0.1:{port}: {exc.strerror or exc}",
                    "free that port or pass another --prestop-port (and the webhook's to match)",
                ) from exc
            runner.append(r)
            agent.spawn(_loop(c, agent.name))
            log.info("kubernetes side", extra={"prestop": f"127.0.0.1:{port}", "node": agent.name})

        async def stop(_app: web.Application) -> None:
            for r in runner:
                await r.cleanup()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)

    return attach


async def _prestop(r: web.Request, c: cluster.Cluster, node: str) -> web.Response:
    ns, pod = r.match_info["namespace"], r.match_info["pod"]
    try:
        said = await asyncio.to_thread(prestop.leaving, c, ns, pod, node)
    except prestop.Refused as exc:
        log.warning("prestop refused", extra={"pod": f"{ns}/{pod}", "why": exc.line()})
        return web.Response(status=403, text=exc.line() + "\n")
    except CriuctlError as exc:
        log.warning("prestop failed", extra={"pod": f"{ns}/{pod}", "why": exc.line()})
        return web.Response(status=500, text=exc.line() + "\n")
    log.info("prestop", extra={"pod": f"{ns}/{pod}", "outcome": said})
    return web.Response(text=said + "\n")


async def _loop(c: cluster.Cluster, node: str) -> None:
    untracked_at = 0.0
    while True:
        busy = False
        try:
            busy = await asyncio.to_thread(successors.tick, c, node)
            if time.monotonic() - untracked_at > RETRACK_EVERY:
                untracked_at = time.monotonic()
                await asyncio.to_thread(jobfailures.retrack_stale, c, node)
        except CriuctlError as exc:
            log.warning("moves not read", extra={"why": exc.line()})
        except Exception:  # a bug here must not take the agent (and the migrations it drives) down
            log.exception("moves loop")
        await asyncio.sleep(TICK_BUSY if busy else TICK)
