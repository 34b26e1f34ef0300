"""criuctl's Kubernetes side inside the node agent's process (`criuctl agent --prestop-port`):

- plain-HTTP listeners for the preStop hook the webhook adds to migratable pods (GET
  /v1/prestop/NAMESPACE/POD; criuctl.kube.prestop): on PORT inside each wrapped pod of this node
  (`PodHooks`: the hook has no `host`, so the kubelet calls the pod's IP; baseline Pod Security
  refuses a hook's `host` from v1.34), and on 127.0.0.1:PORT for a hook with `host: 127.0.0.1`
  (the webhook's --prestop-on-host). Either acts only on a pod the API server says is being
  deleted on this node: a caller can ask for nothing the deletion would not do;
- the loop that restores kept bundles into their pods' successors (criuctl.kube.successors), and
  puts a Job's tracking finalizer back on a pod of this node untracked for a deletion that did not
  come (criuctl.kube.jobfailures.retrack_stale);
- what other nodes' agents may ask of this one: what a pending move that names both needs
  (criuctl.kube.peerrules; they show their certificates, no token is shared);
- the ranks of this node's jobs, published on their pods for `criuctl ps --jobs` (`Ranks`,
  criuctl.kube.jobs): what a user may see, through the API server alone.

The agent's layer knows nothing of Kubernetes: the CLI hands it `extension(...)`, which it calls
with itself and its application at start-up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from criuctl.container import runtime
from criuctl.core.errors import CriuctlError
from criuctl.kube import cluster, identity, jobfailures, jobs, mutate, peerrules, prestop, successors
from criuctl.net import netns

if TYPE_CHECKING:
    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.kube")

TICK = 2.0  # one list of the move records per node per tick: cheap on a cluster of many nodes
TICK_BUSY = 0.2  # while this node is to restore a move: only the holder's (or target's) agent
RETRACK_EVERY = 10.0  # s between two looks for pods untracked for a deletion that did not come
HOOKS_EVERY = 5.0  # s between two looks for this node's wrapped pods (one cached list of its pods)
RANKS_EVERY = 10.0  # s between two looks at this node's jobs' connections (a patch only on a change)


def extension(port: int, kubeconfig: str | None) -> Callable[[Agent, web.Application], None]:
    """What `criuctl agent --prestop-port PORT` adds to the agent; the cluster is reached at start-up
    (a bad configuration stops the agent with one line, before it serves)."""
    c = identity.as_agent_pod(kubeconfig)  # its bound token: the API server knows its node

    def attach(agent: Agent, app: web.Application) -> None:
        runner: list[web.AppRunner] = []
        agent.peer_rules = peerrules.PeerRules(c, agent.name)  # what other nodes' agents may ask here

        async def handle(r: web.Request) -> web.Response:
            return await _prestop(r, c, agent.name)

        async def start(_app: web.Application) -> None:
            hook = web.Application()
            # Kubernetes 1.20's kubelet asks for "http://HOST:PORT/" + path: "//v1/prestop/..."
            for prefix in ("/", "//"):
                hook.router.add_get(prefix + "v1/prestop/{namespace}/{pod}", handle)
            r = web.AppRunner(hook, access_log=None)
            await r.setup()
            hooks = PodHooks(c, agent, r, port)
            agent.spawn(hooks.forever())
            try:
                await web.TCPSite(r, "127.0.0.1", port).start()
            except OSError as exc:
                raise CriuctlError(
                    f"the agent could not serve its preStop hook on 127.0.0.1:{port}: {exc.strerror or exc}",
                    "free that port or pass another --prestop-port (and the webhook's to match)",
                ) from exc
            runner.append(r)
            agent.spawn(_loop(c, agent.name))
            agent.spawn(Ranks(c, agent).forever())
            log.info("kubernetes side", extra={"prestop": f"127.0.0.1:{port}", "node": agent.name})

        async def stop(_app: web.Application) -> None:
            for r in runner:
                await r.cleanup()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)

    return attach


class PodHooks:
    """The hook's listeners inside this node's wrapped pods: one socket each, made in the pod's
    network namespace (`netns.listen_in`) and served from here, so that the kubelet's httpGet to
    the pod's IP reaches this agent, and no process joins the pod (CRIU would find it in the tree
    it dumps). Looked for every HOOKS_EVERY: a pod deleted in its first seconds, before its
    listener, ends with its pod (the kubelet's call fails), as when the agent is down."""

    def __init__(self, c: cluster.Cluster, agent: Agent, runner: web.AppRunner, port: int) -> None:
        self.c, self.agent, self.runner, self.port = c, agent, runner, port
        # (pod UID, container ID) → its listener: a container the kubelet started anew (a new ID)
        # may be in a new sandbox, whose namespace the old socket would keep alive
        self.sites: dict[tuple[str, str], web.SockSite] = {}
        self.refused: set[tuple[str, str]] = set()  # pods whose port a process of theirs holds

    def _pid(self, cid: str) -> int:
        """A process of the pod (its container's, as the runtime says: a job restored into a
        placeholder is no workload of that container's name), for its network namespace."""
        pid = self.agent.runtimes.connect().container(cid).pid
        if pid <= 0:
            raise runtime.UnknownContainer(f"container {cid[:12]} has no process yet")
        return pid

    async def forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except CriuctlError as exc:
                log.warning("pod hooks not refreshed", extra={"why": exc.line()})
            except Exception:  # a bug here must not take the agent down
                log.exception("pod hooks")
            await asyncio.sleep(HOOKS_EVERY)

    async def refresh(self) -> None:
        pods = await asyncio.to_thread(hooked_pods, self.c, self.agent.name)
        for key in set(self.sites) - set(pods):
            await self.sites.pop(key).stop()
        self.refused &= set(pods)
        for key, pod in pods.items():
            if key not in self.sites and key not in self.refused:
                await self._listen(key, pod)
            said = mutate.TAKEN + key[1] if key in self.refused else key[1] if key in self.sites else None
            if said is not None and pod.said != said:  # what a move waits for (mutate.unheard)
                await asyncio.to_thread(_announce, self.c, pod, said)

    async def _listen(self, key: tuple[str, str], pod: Hooked) -> None:
        try:
            pid = await asyncio.to_thread(self._pid, key[1])
            sock = await asyncio.to_thread(netns.listen_in, pid, self.port)
        except netns.PortTaken as exc:  # for the pod's life: said once
            self.refused.add(key)
            log.warning("no preStop listener in the pod", extra={"pod": pod.who, "why": exc.line()})
            return
        except CriuctlError as exc:  # the runtime, the container or its namespace: next time
            log.info("preStop listener not made yet", extra={"pod": pod.who, "why": exc.line()})
            return
        site = web.SockSite(self.runner, sock)
        await site.start()
        self.sites[key] = site
        log.info("preStop listener", extra={"pod": pod.who, "port": self.port})


class Ranks:
    """Each running container workload of this node, as a rank of a job, on its pod's annotation
    (`jobs.note`): patched when its connections change, not every look."""

    def __init__(self, c: cluster.Cluster, agent: Agent) -> None:
        self.c, self.agent = c, agent
        self.said: dict[tuple[str, str], str] = {}  # (namespace, pod) → the value published

    def look(self) -> None:
        now: dict[tuple[str, str], str] = {}
        self.agent.runtimes.register_all()  # containers become workloads, as for `/v1/workloads`
        for row in self.agent.workload_rows():
            if (n := jobs.note(row, self.agent.name)) is not None:
                now[(n[0], n[1])] = n[2]
        for (ns, pod), value in now.items():
            if self.said.get((ns, pod)) != value:
                try:
                    jobs.publish(self.c, ns, pod, value)
                except cluster.NotFound:  # gone meanwhile
                    continue
                self.said[(ns, pod)] = value
        self.said = {k: v for k, v in self.said.items() if k in now}

    async def forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.look)
            except CriuctlError as exc:
                log.warning("ranks not published", extra={"why": exc.line()})
            except Exception:  # a bug here must not take the agent down
                log.exception("ranks")
            await asyncio.sleep(RANKS_EVERY)


@dataclasses.dataclass(frozen=True)
class Hooked:
    """A pod whose preStop listener this agent makes, as the API server has it."""

    namespace: str
    name: str
    uid: str
    said: str  # its mutate.LISTENER annotation: what this agent last said of it

    @property
    def who(self) -> str:
        return f"{self.namespace}/{self.name}"


def hooked_pods(c: cluster.Cluster, node: str) -> dict[tuple[str, str], Hooked]:
    """The pods on `node` whose preStop hook calls the pod's own IP (`mutate.prestop_hook` without
    `host`) and whose wrapped container runs, by (UID, container ID). Read from the API server's
    cache (resourceVersion 0), as the kubelet's own list is: cheap for it at any size."""
    out: dict[tuple[str, str], Hooked] = {}
    listed = cluster.call(
        f"the pods of node {node}",
        c.core.list_pod_for_all_namespaces,
        field_selector=f"spec.nodeName={node}",
        resource_version="0",
    )
    for item in listed.items:
        pod = c.serialize(item)
        spec, meta = pod["spec"], pod["metadata"]
        if spec.get("hostNetwork") or (pod.get("status") or {}).get("phase") != "Running":
            continue
        for ctr in spec["containers"]:
            hook = ((ctr.get("lifecycle") or {}).get("preStop") or {}).get("httpGet") or {}
            if mutate.has_prestop(ctr) and not hook.get("host"):
                cid = cluster.container_id(pod, ctr["name"])
                if cid:
                    said = (meta.get("annotations") or {}).get(mutate.LISTENER, "")
                    out[(meta["uid"], cid)] = Hooked(meta["namespace"], meta["name"], meta["uid"], said)
                break
    return out


def _announce(c: cluster.Cluster, pod: Hooked, said: str) -> None:
    """The pod's mutate.LISTENER annotation, on this very pod (its UID in the patch: a successor of
    the same name is refused, not marked). A pod gone meanwhile is no error; another failure is
    tried again at the next look."""
    body = {"metadata": {"uid": pod.uid, "annotations": {mutate.LISTENER: said}}}
    try:
        cluster.call(f"pod {pod.who}", c.core.patch_namespaced_pod, pod.name, pod.namespace, body)
    except cluster.NotFound:
        pass
    except CriuctlError as exc:
        log.info("preStop listener not announced yet", extra={"pod": pod.who, "why": exc.line()})


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
