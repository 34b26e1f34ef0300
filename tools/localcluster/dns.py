"""A STAND-IN for the cluster DNS (CoreDNS's `kubernetes` plugin), for the local cluster only.

Workers of a multi-worker job find their master by a Service's DNS name (`<job>-master-0` for a
PyTorchJob, `<job>-node-0-0.<job>` for a TrainJob), so the cluster needs a DNS that serves the
names CoreDNS serves. CoreDNS is not packaged in Debian; dnsmasq is. This module runs Debian's
dnsmasq as the server and feeds it from the API, the way CoreDNS's plugin reads it:

- `<svc>.<ns>.svc.<domain>`: a Service's cluster IP; for a headless Service (clusterIP None), the
  addresses of its Endpoints' ready pods (what a PyTorchJob's per-replica Services are);
- `<hostname>.<svc>.<ns>.svc.<domain>`: an endpoint whose pod sets `hostname` and a `subdomain`
  naming that headless Service (what JobSet's pods are);
- `<a-b-c-d>.<ns>.pod.<domain>`: a pod's address.

Every kubelet gets `clusterDNS` = this server (the cluster bridge's address) and `clusterDomain`,
so a pod with the default dnsPolicy resolves `ddp-master-0` through its search path as in any
cluster. The feeder polls the API every half second and writes one hosts file into a folder that
dnsmasq watches (`--hostsdir`: re-read on change, no signal); records keep a TTL of 1 s, so a
moved pod's new address is what the next lookup gets.

What it does NOT do: SRV records, PTR records for Services, ExternalName Services, wildcard
queries, stub domains or any forwarding (names outside the cluster domain are refused: the local
cluster has no outside), the plugin's `pods verified` mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from criuctl.kube import api

DOMAIN = "cluster.local"
DNSMASQ = "dnsmasq"
log = logging.getLogger(__name__)


def _json(fn, **kw) -> list[dict]:
    return json.loads(fn(_preload_content=False, **kw).data)["items"]


def records(
    services: list[dict], endpoints: list[dict], pods: list[dict], domain: str = DOMAIN
) -> dict[str, set[str]]:
    """Name → addresses, as CoreDNS's kubernetes plugin answers A queries."""
    out: dict[str, set[str]] = {}

    def add(name: str, ip: str | None) -> None:
        if ip:
            out.setdefault(name, set()).add(ip)

    headless: set[tuple[str, str]] = set()
    for svc in services:
        m, spec = svc["metadata"], svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if ip == "None":
            headless.add((m["namespace"], m["name"]))
        elif ip:
            add(f"{m['name']}.{m['namespace']}.svc.{domain}", ip)
    for ep in endpoints:
        m = ep["metadata"]
        if (m["namespace"], m["name"]) not in headless:
            continue
        base = f"{m['name']}.{m['namespace']}.svc.{domain}"
        for subset in ep.get("subsets") or []:
            for a in subset.get("addresses") or []:  # ready ones only, as the plugin serves
                add(base, a.get("ip"))
                if a.get("hostname"):
                    add(f"{a['hostname']}.{base}", a.get("ip"))
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip and not (pod.get("spec") or {}).get("hostNetwork"):
            add(f"{ip.replace('.', '-')}.{pod['metadata']['namespace']}.pod.{domain}", ip)
    return out


def hosts_text(recs: dict[str, set[str]]) -> str:
    return "".join(f"{ip} {name}\n" for name in sorted(recs) for ip in sorted(recs[name]))


def write(path: Path, text: str) -> bool:
    """Replace the hosts file at once (dnsmasq never reads half of it); True if it changed."""
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(f".{path.name}.tmp")  # dnsmasq skips dot files in its hosts folder
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def dnsmasq_argv(listen: str, hosts_dir: Path, domain: str = DOMAIN) -> list[str]:
    return [
        DNSMASQ,
        "--keep-in-foreground",
        "--log-facility=-",
        "--conf-file=/dev/null",  # not the machine's /etc/dnsmasq.conf
        "--no-resolv",  # nothing to forward to: the cluster domain is all it knows
        "--no-hosts",  # not the machine's /etc/hosts
        f"--hostsdir={hosts_dir}",
        f"--listen-address={listen}",
        "--bind-interfaces",  # only the cluster bridge's address: clusters run side by side
        "--except-interface=lo",
        f"--local=/{domain}/",  # an unknown cluster name is NXDOMAIN at once, never forwarded
        "--local-ttl=1",  # a moved pod's new address is what the next lookup gets
        "--no-negcache",
        "--user=root",  # reads the hosts folder, which is root's like the rest of the cluster's dir
        "--pid-file=",
    ]


def run(kubeconfig: str, hosts: Path, stop: threading.Event, interval: float = 0.5) -> None:
    """Keep the hosts file what the API says until `stop` is set; an API error waits for the next poll."""
    t = api.timeouts()
    core = api.bounded(client.CoreV1Api, api.api_client(kubeconfig, t)[0], t)
    while not stop.is_set():
        try:
            recs = records(
                _json(core.list_service_for_all_namespaces),
                _json(core.list_endpoints_for_all_namespaces),
                _json(core.list_pod_for_all_namespaces, field_selector="status.phase=Running"),
            )
            if write(hosts, hosts_text(recs)):
                log.info("%d names", len(recs))
        except (ApiException, HTTPError, OSError) as exc:
            log.warning("DNS stand-in: %s", str(exc).splitlines()[0][:200])
        stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localcluster.dns", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--listen", required=True, help="the address to serve DNS on (the cluster bridge's)")
    p.add_argument("--dir", required=True, type=Path, help="a folder of its own for the hosts file")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    a.dir.mkdir(parents=True, exist_ok=True)
    hosts = a.dir / "cluster.hosts"
    write(hosts, "")
    server = subprocess.Popen(dnsmasq_argv(a.listen, a.dir))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    feeder = threading.Thread(target=run, args=(a.kubeconfig, hosts, stop), daemon=True)
    feeder.start()
    while not stop.wait(1):
        if server.poll() is not None:
            log.error("dnsmasq exited with %s", server.returncode)
            return 1
    server.terminate()
    server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
