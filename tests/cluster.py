"""Nodes for tests: network namespaces joined by a bridge, each with its own agent and state dir.

Each node is a separate host as far as the network goes (its own address, its own agent on port
7070); the client — `criuctl migrate` in the test — talks to them from the root namespace over
the bridge. CRIU runs inside a node's namespace because its agent does (`nsenter --net`, not `ip
netns exec`, which would add a mount namespace CRIU then has to dump).

Agents serve HTTPS, as `criuctl agent` does by default: one CA per cluster, and per node a
certificate naming its address, made by `scripts/agent-cert.sh` (the script users run); clients
add nodes with `--ca`. `Cluster(tls=False)` runs them `--insecure` (plain HTTP) instead: the
benchmarks, whose numbers compare with runs before TLS was the default, and the tests of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import requests

from criuctl.agent import tickets
from criuctl.agent.protocol import Ticket
from criuctl.core import env, procinfo
from tests.jobs import CRIUCTL, Job, workload_cmd

_STEP = re.compile(r"^step (\d+) loss (\S+)$")
_FINAL = re.compile(r"^final ([0-9a-f]{64})$")
PORT = 7070
AGENT_CERT = Path(__file__).resolve().parent.parent / "scripts" / "agent-cert.sh"
PLAIN = "plain TCP (agents --insecure)"  # Cluster(tls=False), as benchmark results name their transport


def _free_subnet(seed: int) -> str:
    """A 10.N.0 /24 no interface here routes yet (a cluster left over by a killed run may hold one).

    Each of the sessions scripts/run-tests.sh runs side by side has its own share of the N
    (`env.TESTS_SHARE`, "I/N"), so two never pick one net between one's look and its `ip route add`."""
    worker, workers = (int(x) for x in env.TESTS_SHARE.get().split("/"))
    span = 100 // workers
    for i in range(span):
        net = f"10.{77 + worker * span + (seed + i) % span}.0"
        if not sh("ip", "route", "show", f"{net}.0/24").stdout.strip():
            return net
    raise AssertionError("no free 10.N.0.0/24 subnet for test nodes")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def agent_cert(pki: Path, node: str, *addresses: str) -> tuple[Path, Path, Path]:
    """A node's certificate, key and CA, made as a user makes them (one CA per `pki` folder)."""
    from tests.requirements import require

    require("openssl")
    r = sh(str(AGENT_CERT), "--dir", str(pki), "--days", "2", node, *addresses, check=False)
    assert r.returncode == 0, r.stderr
    return pki / node / "tls.crt", pki / node / "tls.key", pki / "ca.crt"


class TicketAuth(requests.auth.AuthBase):
    """A `POST /v1/incoming` answer's ticket as the source agent uses it: a fresh proof per request,
    never the secret (`criuctl.agent.tickets`)."""

    def __init__(self, inc: dict) -> None:
        self.ticket = Ticket("http://unused", inc["id"], inc["ticket"], "b", verify=inc["verify"])

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body.encode() if isinstance(r.body, str) else r.body  # covered, where there is one
        path = urlsplit(str(r.url)).path
        r.headers["Authorization"], self.nonce = tickets.proof(self.ticket, str(r.method), path, body)
        return r


@dataclass
class Node:
    name: str
    ns: str
    addr: str
    state: Path
    token_file: Path
    veth: str
    agent: subprocess.Popen | None = None
    tls: tuple[Path, Path, Path] | None = None  # certificate, key, the CA that signed it; None: --insecure
    hide: Path | None = None  # a folder this node's filesystem lacks (an empty tmpfs over it)
    extra: list[str] = field(default_factory=list)  # more `criuctl agent` options for this node
    env: dict[str, str] = field(default_factory=dict)  # more environment for this node's agent
    spool: Path | None = None  # this node's --spool-dir (None: bundles go to the state dir)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.addr}:{PORT}"

    @property
    def verify(self) -> str | bool:
        """`requests`' verify= for this node's agent: its CA (the default trust store has none of ours)."""
        return str(self.tls[2]) if self.tls else True

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def inside(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}"]

    def start_agent(
        self,
        env: dict[str, str] | None = None,
        lease: float = 120.0,
        spool: Path | None = None,
        check_cert: bool = True,
    ) -> None:
        """Start the agent and wait until it answers; `check_cert=False`: a TLS handshake that fails
        our check counts as an answer (for a test that gives a node a certificate it should not have)."""
        self.spawn_agent(env, lease, spool)
        self.wait_agent(check_cert)

    def spawn_agent(
        self, env: dict[str, str] | None = None, lease: float = 120.0, spool: Path | None = None
    ) -> None:
        """Start the agent (a cluster starts all of its nodes' at once, then waits for each)."""
        prefix = self.inside()
        if self.hide:  # its own mount namespace, where `hide` is an empty tmpfs
            mount = f'mount -t tmpfs none {self.hide} && exec "$@"'
            prefix += ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
        argv = [
            *prefix,
            *CRIUCTL,
            "agent",
            "--listen",
            f"0.0.0.0:{PORT}",
            "--token-file",
            str(self.token_file),
        ]
        argv += ["--name", self.name, "--state-dir", str(self.state), "--lease", str(lease)]
        if spool or self.spool:
            argv += ["--spool-dir", str(spool or self.spool)]
        argv += (
            ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1]), "--peer-ca", str(self.tls[2])]
            if self.tls
            else ["--insecure"]
        )
        argv += self.extra
        log = (self.state.parent / "agent.log").open("ab")
        self.agent = subprocess.Popen(
            argv, stdout=log, stderr=log, env={**os.environ, **self.env, **(env or {})}
        )

    def wait_agent(self, check_cert: bool = True) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/healthz", timeout=1, verify=self.verify).ok:
                    return
            except requests.exceptions.SSLError:
                if not check_cert:
                    return
            except requests.RequestException:
                pass
            if self.agent.poll() is not None:
                raise AssertionError(f"agent on {self.name} exited: {self.agent_log()[-2000:]}")
            time.sleep(0.2)
        raise AssertionError(f"agent on {self.name} did not come up: {self.agent_log()[-2000:]}")

    def stop_agent(self, sig: int = signal.SIGTERM) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.send_signal(sig)
            try:
                self.agent.wait(15)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()

    def agent_log(self) -> str:
        return (self.state.parent / "agent.log").read_text(errors="replace")

    def records(self) -> list[dict]:
        out = []
        for p in (self.state / "workloads").glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                out.append(json.loads(p.read_text()))
        return out

    def log(self, name: str) -> str:
        p = self.state / "logs" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""


class Cluster:
    """`names` nodes on a private bridge; the client's state (node list) lives in `root/client`."""

    def __init__(
        self,
        root: Path,
        names: tuple[str, ...] = ("a", "b"),
        tls: bool = True,
        tmpfs: dict[str, str] | None = None,
        hide: dict[str, Path] | None = None,
        lease: float = 120.0,
        agent_args: dict[str, list[str]] | None = None,
        agent_env: dict[str, dict[str, str]] | None = None,
        spool: bool = False,
    ) -> None:
        self.root, self.tag = root, secrets.token_hex(2)
        self.bridge = f"crbr{self.tag}"
        self.client_state = root / "client"
        self.nodes: dict[str, Node] = {}
        self.net = _free_subnet(int(self.tag, 16))
        self._names, self._tls, self._tmpfs, self._hide = names, tls, tmpfs or {}, hide or {}
        self.lease = lease
        self._agent_args = agent_args or {}
        self._agent_env, self._spool = agent_env or {}, spool

    def __enter__(self) -> Cluster:
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.root.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(self._names, 2):
            ns, veth = f"cr{self.tag}{name}", f"cr{self.tag}{name}h"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.net}.{i}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            d = self.root / name
            (d / "state").mkdir(parents=True, mode=0o700)
            if name in self._tmpfs:  # a small disk for this node's state (bundles land there)
                sh(
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={self._tmpfs[name]},mode=0700",
                    "none",
                    str(d / "state"),
                )
            token = d / "token"
            token.write_text(secrets.token_urlsafe(24) + "\n")
            os.chmod(token, 0o600)
            node = Node(
                name,
                ns,
                f"{self.net}.{i}",
                d / "state",
                token,
                veth,
                hide=self._hide.get(name),
                extra=self._agent_args.get(name, []),
                env=self._agent_env.get(name, {}),
                spool=d / "spool" if self._spool else None,
            )
            if self._tls:
                node.tls = agent_cert(self.root / "pki", name, node.addr)
            self.nodes[name] = node
        for node in self.nodes.values():
            node.spawn_agent(lease=self.lease)
        for node in self.nodes.values():
            node.wait_agent()
            args = ["node", "add", node.name, node.url, "--token-file", str(node.token_file)]
            if node.tls:
                args += ["--ca", str(node.tls[2])]
            r = self.client(*args)
            assert r.returncode == 0, r.stderr

    def handoffs(self) -> list[psutil.Process]:
        """This cluster's handoff processes (their spec files live under its root)."""
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "criuctl.agent.handoff" in cmd and str(self.root) in cmd:
                out.append(proc)
        return out

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes.values():
            node.stop_agent(signal.SIGKILL)
            for rec in node.records():
                # only the very process the record names: a PID of a job that ended long ago may
                # name another test's process now (the other session's CLI was once SIGKILLed so)
                boot, born = rec.get("boot_id") or procinfo.boot_id(), rec.get("started")
                ours = [procinfo.Identity(rec["root_pid"], rec.get("root_start"), boot, born)]
                ours.append(procinfo.Identity(rec["supervisor_pid"], None, boot, born))  # started before it
                for who in ours:
                    if who.pid > 0 and who.alive():  # a container's workload has no supervisor: 0
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(who.pid, signal.SIGKILL)
        # a target handoff supervising a job ends with it; anything still here after that leaked
        deadline = time.monotonic() + 10
        while (left := self.handoffs()) and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = [" ".join(p.cmdline()[3:5]) for p in left if p.is_running()]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for node in self.nodes.values():
            sh("ip", "netns", "del", node.ns, check=False)
            if node.name in self._tmpfs:
                sh("umount", "-l", str(node.state), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        if leaked and not any(exc):
            raise AssertionError(f"the test leaked handoff processes: {leaked}")

    # ---------------------------------------------------------------------------------- driving

    def client(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """A criuctl command from the client's seat (root namespace, its own node list)."""
        env = {**os.environ, "CRIUCTL_STATE_DIR": str(self.client_state)}
        return subprocess.run([*CRIUCTL, *args], capture_output=True, text=True, timeout=timeout, env=env)

    def migrate(self, name: str, to: str, *flags: str) -> subprocess.CompletedProcess:
        return self.client("migrate", name, "--to", to, "--json", *flags)

    def run(self, node: str, name: str, script: str, *args: str, env: dict[str, str] | None = None) -> Job:
        n = self.nodes[node]
        argv = [*n.inside(), *CRIUCTL, "run", "--state-dir", str(n.state), "--name", name, "--"]
        return Job([*argv, *workload_cmd(script, *args)], env={**os.environ, **(env or {})})

    def link(self, node: str, up: bool) -> None:
        sh("ip", "link", "set", self.nodes[node].veth, "up" if up else "down")

    # ---------------------------------------------------------------------------------- reading

    def steps(self, name: str) -> dict[int, str]:
        """Every step any node logged for `name`; a step logged twice must agree with itself."""
        seen: dict[int, str] = {}
        for node in self.nodes.values():
            for line in node.log(name).splitlines():
                if m := _STEP.match(line):
                    step, loss = int(m[1]), m[2]
                    assert seen.setdefault(step, loss) == loss, f"step {step} logged with two losses"
        return seen

    def final(self, name: str) -> list[str]:
        return [
            m[1]
            for n in self.nodes.values()
            for line in n.log(name).splitlines()
            if (m := _FINAL.match(line))
        ]

    def running(self, name: str) -> list[str]:
        """Nodes where a copy of `name` is alive and not stopped (one: else it was lost or doubled).

        A copy counts when its record says running, its process is not stopped, and its record
        still says running after that look: a source ends its tree by first recording it as moved,
        then killing it, and a tree being torn down by SIGKILL shows as running for a moment.
        """
        return [node.name for node in self.nodes.values() if self._runs_on(node, name)]

    @staticmethod
    def _runs_on(node: Node, name: str) -> bool:
        def record() -> dict | None:
            return next((r for r in node.records() if r["name"] == name and r["state"] == "running"), None)

        rec = record()
        if rec is None:
            return False
        try:
            status = psutil.Process(rec["root_pid"]).status()
        except psutil.Error:
            return False
        held = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        again = record()  # post-copy's page server holds a tree in tracing stop
        return status not in held and again is not None and again["root_pid"] == rec["root_pid"]

    def wait_finished(self, name: str, timeout: float = 300, settle: float = 15) -> None:
        """Until the job wrote its final weights, no copy runs, and its supervisor recorded the exit.

        The supervisor records the exit a moment after the process is gone: a caller that read the
        records in between saw the job end nowhere. A record still saying running `settle` seconds
        after its process ended is left for the caller's assertion to report (a lost copy).
        """
        deadline = time.monotonic() + timeout
        done_since: float | None = None
        while time.monotonic() < deadline:
            if self.final(name) and not self.running(name):
                now = time.monotonic()
                done_since = now if done_since is None else done_since
                recorded = not any(
                    r["name"] == name and r["state"] == "running"
                    for n in self.nodes.values()
                    for r in n.records()
                )
                if recorded or now - done_since > settle:
                    return
            else:
                done_since = None
            time.sleep(0.3)
        raise AssertionError(f"{name} did not finish within {timeout}s; running on {self.running(name)}")

    def wait_step(self, name: str, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if max(self.steps(name), default=-1) >= step:
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} did not reach step {step}")
