"""A kept post-copy bundle's memory pages: who may pull them, and the process that serves them.

A pod being deleted whose successor restores its job on another node (criuctl.kube.prestop) is
dumped in post-copy: its bundle holds everything but the private memory pages, which the dump's
CRIU keeps in its page pipes and serves, while the tree itself ends at once (the pipes hold the
pages, not the tree's mappings). That CRIU runs in a `dump` handoff that outlives the agent (its
own session, the root cgroups, the host's PID namespace) and serves until a lazy-pages daemon has
every page, the agent stops it (`DELETE /v1/bundles/ID`: the move ended otherwise), or its time is
up (`criuctl.agent.protocol.Timeouts.serve`). A daemon that goes away before it has every page (a
restore that failed) leaves them served to the next one: the fallback restore on the source pulls
them from here too.

The pages cross the network over CRIU's TLS, pinned per bundle (`criuctl.net.pagetls`): each node
that may restore the bundle (the target, and the serving node itself for the fallback) makes a
client key pair for it here; the page server accepts those certificates only, and each client
accepts only the server's, which the move's record carries. Private keys never leave their node.

    STATE/pages/ID/client.crt, .key     this node's client key pair for bundle ID
    STATE/pages/ID/server.crt, .key     (the serving node) the page server's key pair
    STATE/pages/ID/clients.crt          (the serving node) the client certificates it accepts
    STATE/pages/ID/server-peer.crt      (a restoring node) the server's certificate, pinned
    STATE/pages/ID/serving.json         (the serving node) the handoff that serves the pages
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from criuctl.agent import records
from criuctl.core import procinfo, statedir
from criuctl.engine import criu
from criuctl.net import pagetls

CLIENT, SERVER, CLIENTS, SERVER_PEER = "client", "server", "clients", "server-peer"
SERVING = "serving.json"


def folder(bid: str) -> Path:
    """Bundle `bid`'s folder here (`bid` already checked: 32 hex digits)."""
    return statedir.PAGES.ensure() / bid


def client(bid: str) -> pagetls.Identity:
    """This node's client key pair for bundle `bid`: made once, the same on every later ask."""
    here = folder(bid)
    return pagetls.load_identity(here, CLIENT) or pagetls.make_identity(here, CLIENT)


# what another node may make this one keep unasked (`POST /v1/bundles/ID/page-client`: any agent
# may ask before a move's record names the bundle): a key pair per bundle ID, at most this many
# that no move has used yet, each gone after a day unused (`tidy`)
MOST_UNUSED = 256
UNUSED_SECONDS = 24 * 3600


class TooManyAsked(Exception):
    """Page-client key pairs asked for and not used: as many as this node keeps."""


def _unused(here: Path) -> bool:
    """A bundle's folder holding only a client key pair: asked for, not (yet) served or pulled."""
    return all(p.name.startswith(f"{CLIENT}.") for p in here.iterdir())


def asked_client(bid: str) -> pagetls.Identity:
    """`client`, asked by another node: refused once MOST_UNUSED asked ones wait unused here."""
    root = statedir.PAGES.ensure()
    if not (root / bid).exists():
        waiting = sum(1 for p in root.iterdir() if p.is_dir() and _unused(p))
        if waiting >= MOST_UNUSED:
            raise TooManyAsked(f"{waiting} page-client key pairs asked for here wait unused")
    return client(bid)


def serve_tls(bid: str, clients: list[object]) -> tuple[criu.PageTls, str]:
    """The page server's TLS for bundle `bid`, accepting `clients` (PEMs, checked as hostile) and
    this node's own client; with the server's certificate (PEM) for the clients to pin."""
    here = folder(bid)
    server = pagetls.make_identity(here, SERVER)
    accepted = pagetls.pin_all(here, CLIENTS, [*clients, client(bid).pem])
    return pagetls.tls(server, accepted), server.pem


def pull_tls(bid: str, server_pem: object) -> criu.PageTls:
    """A lazy-pages daemon's TLS towards bundle `bid`'s page server, whose certificate is `server_pem`."""
    here = folder(bid)
    peer, _ = pagetls.pin(here, SERVER_PEER, server_pem)
    return pagetls.tls(client(bid), peer)


def note_serving(bid: str, port: int, criu_pid: int | None, until: float) -> None:
    """This process serves bundle `bid`'s pages on `port` through CRIU `criu_pid` until `until`
    (time.time()) at the latest: what `stop` and `tidy` need."""
    me = procinfo.Identity.of(os.getpid())
    cr = procinfo.Identity.of(criu_pid) if criu_pid else None
    records.write(
        folder(bid) / SERVING,
        {
            "pid": me.pid,
            "start": me.start,
            "boot": me.boot,
            "port": port,
            "criu": [cr.pid, cr.start] if cr else None,
            "until": until,
        },
    )


def tidy() -> list[str]:
    """What a serving handoff that died left (the agent's janitor): its CRIU, still serving past
    its time, is killed, and once it is gone the bundle's keys, record and bundle go; the ids
    cleared."""
    root = statedir.PAGES.path()
    cleared = []
    for here in root.iterdir() if root.exists() else []:
        with contextlib.suppress(OSError):
            if here.is_dir() and _unused(here) and time.time() - here.stat().st_mtime > UNUSED_SECONDS:
                forget(here.name)
    for rec_path in sorted(root.glob(f"*/{SERVING}")) if root.exists() else []:
        bid = rec_path.parent.name
        rec = records.read(rec_path, lambda d: d if isinstance(d, dict) else {})
        if not isinstance(rec, dict) or serving(bid):
            continue
        cr = rec.get("criu")
        criu = procinfo.Identity(int(cr[0]), cr[1], str(rec.get("boot", ""))) if cr else None
        if criu is not None and criu.alive():
            if time.time() < float(rec.get("until") or 0):
                continue  # its pages may still be pulled
            with contextlib.suppress(ProcessLookupError):
                os.kill(criu.pid, signal.SIGKILL)
            continue
        shutil.rmtree(statedir.BUNDLES.path() / bid, ignore_errors=True)
        forget(bid)
        cleared.append(bid)
    return cleared


def served(bid: str) -> tuple[int, str] | None:
    """(port, the page server's certificate) while bundle `bid`'s pages are served here, else None."""
    here = statedir.PAGES.path() / bid
    rec = records.read(here / SERVING, lambda d: int(d["port"]) if isinstance(d, dict) else 0)
    if not isinstance(rec, int) or not rec or not serving(bid):
        return None
    try:
        return rec, (here / f"{SERVER}.crt").read_text()
    except OSError:
        return None


def _identity(d: object) -> procinfo.Identity:
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    start = d.get("start")
    return procinfo.Identity(int(d["pid"]), int(start) if start is not None else None, str(d["boot"]))


def _server(bid: str) -> procinfo.Identity | None:
    rec = records.read(folder(bid) / SERVING, _identity)
    return rec if isinstance(rec, procinfo.Identity) else None


def serving(bid: str) -> bool:
    """Whether bundle `bid`'s pages are being served from this node now."""
    server = _server(bid)
    return server is not None and server.alive()


def stop(bid: str) -> bool:
    """Ask the handoff serving bundle `bid`'s pages to stop (SIGTERM: it kills its CRIU, the pages
    go, and it removes what it kept); whether one was serving."""
    server = _server(bid)
    if server is None or not server.alive():
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, signal.SIGTERM)
    return True


def forget(bid: str) -> None:
    """Remove bundle `bid`'s keys and records from this node."""
    shutil.rmtree(statedir.PAGES.path() / bid, ignore_errors=True)
