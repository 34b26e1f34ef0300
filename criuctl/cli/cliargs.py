"""criuctl's command line as data: each verb's options and help, and the one parser built from them.

Standard library only: `criuctl.cli.main` parses (and a verb checks for root) before anything heavy is
imported. Which function runs a verb is `criuctl.cli.main`'s business, not this module's.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from criuctl.cli import version
from criuctl.core import env

Option = tuple[tuple[str, ...], dict[str, Any]]


def opt(*flags: str, **kw: Any) -> Option:
    """One `add_argument(*flags, **kw)`, as data."""
    return flags, kw


FORMATS = ("text", "json")


def output_format(value: str) -> str:
    """`-o`/`--output` is an output format on every verb, as in kubectl: a folder given there (the
    bundle folder `dump -o DIR` used to take) gets one line saying where it goes now."""
    if value in FORMATS:
        return value
    if "/" in value or value.startswith("."):
        raise argparse.ArgumentTypeError(
            f"-o is the output format (text or json), not a folder ({value!r}); "
            "a dump's bundle folder is `--bundle DIR`"
        )
    raise argparse.ArgumentTypeError(f"invalid output format {value!r}: text or json")


def output(what: str = "the result") -> Option:
    """The one `-o`/`--output` every verb that prints a result takes."""
    kw = {"type": output_format, "default": "text", "metavar": "text|json"}
    return opt("-o", "--output", **kw, help=f"json: {what} on stdout")


class Verb(NamedTuple):
    help: str
    options: tuple[Option, ...] = ()
    verbs: dict[str, Verb] | None = None  # sub-verbs (`node add`), parsed into `<verb>_verb`


DESCRIPTION = (
    "Freeze a running training job with CRIU and restore it, bit-identical, here or on another node."
)

STATE_DIR_HELP = (
    f"criuctl's state on this node: workloads, logs, keys, nodes (env {env.STATE_DIR}; "
    f"default {env.STATE_DIR.default})"
)

# In the order `criuctl --help` lists them; every verb also takes --state-dir.
VERBS: dict[str, Verb] = {
    "run": Verb(
        "start a command as a checkpointable workload",
        (
            opt("--name", help="workload name (default: the command's name)"),
            opt(
                "--allow-io-uring",
                action="store_true",
                help="do not block io_uring (CRIU cannot checkpoint a process that uses it)",
            ),
            opt("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]"),
        ),
    ),
    "ps": Verb(
        "list the workloads on this host (or on a node's agent)",
        (
            opt("-a", "--all", action="store_true", help="also show exited, moved and checkpointed ones"),
            opt("--node", help="ask this node's agent instead of reading this host's registry"),
            opt(
                "--jobs",
                action="store_true",
                help="ask every node and show workloads joined by TCP connections as jobs, rank by rank "
                "(on Kubernetes: every node's agent, a pod's rank shown by the pod's name)",
            ),
            opt(
                "--kubeconfig",
                metavar="FILE",
                help="with --jobs: ask the cluster's agents (default when $KUBECONFIG or "
                "~/.kube/config is there and no node was added with `criuctl node add`)",
            ),
            output("the rows (every field of each workload, and `alive`, `rss_bytes`)"),
        ),
    ),
    "logs": Verb(
        "a workload's stdout and stderr on this host (or on a node)",
        (
            opt("name", metavar="NAME"),
            opt("--node", help="ask this node's agent"),
            opt("--tail", type=int, default=0, metavar="N", help="only the last N lines"),
            opt(
                "-f",
                "--follow",
                action="store_true",
                help="go on printing what it writes until it ends or moves away (then: where to)",
            ),
        ),
    ),
    "agent": Verb(
        "run the node agent (the DaemonSet's process)",
        (
            opt("--listen", default="0.0.0.0:7070", metavar="HOST:PORT"),
            opt(
                "--token-file",
                metavar="FILE",
                help="bearer token, mode 0600 (without it, with --peer-ca: callers show a certificate, "
                "as on Kubernetes)",
            ),
            opt(
                "--tls-cert",
                metavar="FILE",
                help="this node's certificate, PEM, naming the addresses clients use (scripts/agent-cert.sh)",
            ),
            opt("--tls-key", metavar="FILE", help="its private key, PEM, unencrypted, mode 0600"),
            opt(
                "--peer-ca",
                metavar="FILE",
                help="the agents' CA: the agents calling this one for a move present their node's "
                "certificate, and a move's ticket opens its routes only to the move's source",
            ),
            opt(
                "--tls-from-cluster",
                action="store_true",
                help="on Kubernetes: a key of this node's own and a certificate naming it, issued through "
                "the CSR API by criuctl's controller and renewed before it ends (manifests/daemonset.yaml)",
            ),
            opt(
                "--metrics-token-file",
                metavar="FILE",
                help="a scrape credential (mode 0600, at least 16 characters) that opens /metrics and "
                "nothing else, so that Prometheus need not hold the token that drives dumps",
            ),
            opt(
                "--insecure",
                action="store_true",
                help="serve plain HTTP instead of HTTPS: token and bundles cross the network in the clear "
                "(private test and benchmark networks only)",
            ),
            opt("--name", help="this node's name (default: the host name)"),
            opt(
                "--spool-dir",
                metavar="DIR",
                help="where bundles in flight go (default: the state dir); a tmpfs keeps the disk out of a "
                f"migration's path, at the cost of RAM for one bundle per migration (env {env.SPOOL_DIR})",
            ),
            opt(
                "--lease",
                type=float,
                default=120.0,
                metavar="SECONDS",
                help="how long a frozen source waits for the client's commit before asking the target",
            ),
            opt(
                "--runtime-endpoint",
                metavar="SOCKET",
                help=f"the container runtime's CRI socket (env {env.RUNTIME_ENDPOINT}; default: "
                "containerd's, then CRI-O's, whichever exists)",
            ),
            opt(
                "--inject-dir",
                metavar="DIR",
                help="where the agent puts criuctl's init and hook for containers to mount read-only "
                "(default /var/lib/criuctl-inject)",
            ),
            opt(
                "--prestop-port",
                type=int,
                metavar="PORT",
                help="on Kubernetes: serve criuctl's preStop hook on PORT inside each wrapped pod of "
                "this node and on 127.0.0.1:PORT (the kubelet calls it when a migratable pod is "
                "deleted) and restore kept bundles into their pods' successors; needs in-cluster "
                "credentials or --kubeconfig",
            ),
            opt("--kubeconfig", metavar="FILE", help="with --prestop-port, outside a pod"),
        ),
    ),
    "node": Verb(
        "the nodes `migrate` can use: agent addresses and their tokens",
        verbs={
            "add": Verb(
                "add or replace a node",
                (
                    opt("name", metavar="NAME"),
                    opt("url", metavar="URL", help="the agent's address, e.g. https://10.0.0.2:7070"),
                    opt("--token-file", required=True, metavar="FILE"),
                    opt(
                        "--ca",
                        metavar="FILE",
                        help="CA certificate that signed the agent's TLS certificate (default: the "
                        "system's trusted CAs)",
                    ),
                ),
            ),
            "rm": Verb("forget a node", (opt("name", metavar="NAME"),)),
            "ls": Verb("list nodes and whether their agents answer"),
        },
    ),
    "migrate": Verb(
        "move a running workload, or a Kubernetes pod, to another node",
        (
            opt("name", metavar="NAME|POD"),
            opt(
                "node",
                nargs="*",
                metavar="NODE",
                help="the node to move it to (or --to NODE); with --job: more RANK=NODE pairs",
            ),
            opt(
                "--job",
                metavar="JOB",
                help="move ranks of a multi-node job together: criuctl migrate --job JOB RANK=NODE "
                "[RANK=NODE...] (JOB: the job's name in `criuctl ps`, or any of its ranks)",
            ),
            opt(
                "--break-connections",
                action="store_true",
                help="move it alone although its TCP connections to peers outside criuctl cannot follow",
            ),
            opt("--to", metavar="NODE", help=argparse.SUPPRESS),
            opt(
                "-n",
                "--namespace",
                help="a pod's namespace (default: the kubeconfig context's, else 'default'); "
                "POD is a pod when this, --kubeconfig, $KUBECONFIG or an in-cluster config is "
                "there and NODE is not a node of `criuctl node ls`",
            ),
            opt(
                "--kubeconfig",
                metavar="FILE",
                help="the kubeconfig to use (default: $KUBECONFIG, ~/.kube/config)",
            ),
            opt(
                "--dry-run",
                action="store_true",
                help="a pod: check everything, change nothing, say what would happen",
            ),
            opt(
                "--kube",
                action="store_true",
                help="NAME is a pod: move it through the API server (default when a kubeconfig is "
                "there and NODE is no node added with `criuctl node add`)",
            ),
            opt(
                "--agents",
                action="store_true",
                help="NAME is a workload on the nodes added with `criuctl node add`: move it through "
                "their agents, whatever kubeconfig is there",
            ),
            output(),
            opt("--from", dest="source", metavar="NODE", help="the node it runs on (default: ask them all)"),
            opt(
                "--mode",
                choices=["stop-and-copy", "post-copy"],
                help="default: post-copy where both kernels have userfaultfd, else stop-and-copy",
            ),
            opt(
                "--into",
                metavar="CONTAINER",
                help="a container's job: the placeholder container (ID) on the target to restore it into "
                "(default: the target's one empty placeholder for the same pod and container)",
            ),
            opt("--json", action="store_true", help=argparse.SUPPRESS),  # older scripts' `-o json`
            opt(
                "--as",
                dest="object_name",
                metavar="NAME",
                help="a pod: the PodMigration's name (default: generated from the pod's and the node's)",
            ),
            opt(
                "--detach",
                action="store_true",
                help="a pod: create the PodMigration and return (without it, migrate watches it to its "
                "end); `criuctl get NAME -w` follows it",
            ),
            opt(
                "--ttl",
                type=int,
                metavar="SECONDS",
                help="a pod: the controller deletes the PodMigration this long after it ended "
                "(spec.ttlSecondsAfterFinished; default: kept)",
            ),
        ),
    ),
    "thaw": Verb(
        "finish a thaw that did not complete (`ps` says so): lift CRIU's network lock, take the "
        "TCP sockets out of repair mode, give back GPU state; only for a workload that runs again",
        (opt("name", metavar="NAME"),),
    ),
    "dump": Verb(
        "checkpoint a workload into a bundle directory",
        (
            opt("target", metavar="NAME|PID"),
            opt("-b", "--bundle", required=True, metavar="DIR", help="the new bundle's folder"),
            output("the dump's result (bundle, size, times)"),
            opt("--leave-running", action="store_true", help="snapshot only: the workload keeps running"),
            opt(
                "--state",
                action="store_true",
                help="no CRIU: the hook saves models, optimizers, schedulers and RNG at a step boundary "
                "(the CUDA-aware pre-dump, for GPUs without the driver's checkpoint API); "
                "restore starts the command again and loads them (docs/gpu.md)",
            ),
            opt(
                "--via-runtime",
                action="store_true",
                help="a container: checkpoint it with the runtime's CRI CheckpointContainer (what the "
                "kubelet calls; containerd >= 2.0, CRI-O) and import its archive; it keeps running",
            ),
        ),
    ),
    "restore": Verb(
        "restore a bundle and supervise it in the foreground",
        (
            opt("bundle", metavar="DIR"),
            opt("--name", help="name of the restored workload (default: the checkpointed one's)"),
            opt(
                "--into",
                metavar="CONTAINER",
                help="a container's bundle: the placeholder container (ID) to restore into",
            ),
            opt("--runtime-endpoint", metavar="SOCKET", help=f"the CRI socket (env {env.RUNTIME_ENDPOINT})"),
        ),
    ),
    "inspect": Verb(
        "describe a bundle: processes, memory, files, checks",
        (
            opt("bundle", metavar="DIR|ARCHIVE", help="a bundle, or a kubelet/CRI checkpoint archive"),
            output("the description"),
        ),
    ),
    "doctor": Verb("check CRIU and the kernel features criuctl needs"),
    "prestop": Verb(
        "a pod's preStop command for the migrator API: ask the job to save, wait until it has",
        (
            opt(
                "--signal",
                metavar="FILE",
                help=f"the migrator's signal file (default: ${env.MIGRATION_SIGNAL_PATH}, "
                f"else {env.MIGRATION_SIGNAL_PATH.shown})",
            ),
            opt("--timeout", type=float, default=270.0, metavar="SECONDS", help="give up after this long"),
        ),
    ),
    "webhook": Verb(
        "serve the admission webhook that makes labelled pods migratable (manifests/webhook.yaml)",
        (
            opt("--listen", default="0.0.0.0:8443", metavar="HOST:PORT"),
            opt("--tls-cert", required=True, metavar="FILE"),
            opt("--tls-key", required=True, metavar="FILE"),
            opt(
                "--prestop-port",
                type=int,
                metavar="PORT",
                help="add criuctl's preStop hook, calling the node agents' --prestop-port in the pod",
            ),
            opt(
                "--prestop-on-host",
                action="store_true",
                help="the hook calls the agent on the node's loopback (host: 127.0.0.1) instead: for "
                "jobs that listen on that port themselves; the Pod Security Standard baseline refuses "
                "it from Kubernetes v1.34",
            ),
            opt(
                "--kubeconfig",
                metavar="FILE",
                help="credentials to read pending moves (default: in-cluster; without either, "
                "controller-owned pods are not made placeholders)",
            ),
            opt(
                "--inject-image",
                metavar="IMAGE",
                help="criuctl's image, from which an init container copies criuctl's files into "
                "each wrapped pod (default: the webhook's own pod's image, read from the API server; "
                "without either, a hostPath of the node's copy, which Pod Security baseline refuses)",
            ),
        ),
    ),
    "inject": Verb(
        "copy criuctl's init and hook into DIR (the webhook's init container runs this)",
        (opt("dir", metavar="DIR"),),
    ),
    "controller": Verb(
        "carry out PodMigrations in the cluster: one active replica, elected through a Lease "
        "(manifests/controller.yaml)",
        (
            opt("--kubeconfig", metavar="FILE", help="default: in-cluster (the pod's service account)"),
            opt("--lease", default="criuctl-controller", metavar="NAME", help="the Lease's name"),
            opt("--lease-namespace", default="criuctl-system", metavar="NS"),
            opt("--lease-seconds", type=int, default=15, metavar="S", help="how long a leader's Lease lasts"),
            opt(
                "--renew-seconds",
                type=int,
                default=10,
                metavar="S",
                help="a leader that cannot renew within this stops",
            ),
            opt("--retry-seconds", type=int, default=2, metavar="S"),
            opt("--health", default="0.0.0.0:8081", metavar="HOST:PORT", help="serves /healthz and /metrics"),
            opt(
                "--tls-from-cluster",
                action="store_true",
                help="ask criuctl's signer for this controller's certificate (criuctl.kube.identity): "
                "what it shows the agents and signs each move's grant with; it leads no move before",
            ),
            opt(
                "--metrics-token-file",
                metavar="FILE",
                help="the scrape credential /metrics asks for (default: /metrics is open on that port)",
            ),
        ),
    ),
    "signer": Verb(
        "approve and sign criuctl's certificate requests with the agents' CA: each agent's for its "
        "own node, the controller's for its own name (manifests/signer.yaml)",
        (
            opt("--kubeconfig", metavar="FILE", help="default: in-cluster (the pod's service account)"),
            opt("--ca-cert", required=True, metavar="FILE", help="the agents' CA certificate"),
            opt(
                "--ca-key",
                required=True,
                metavar="FILE",
                help="that CA's private key (the Secret criuctl-ca)",
            ),
            opt(
                "--cert-seconds",
                type=int,
                default=7 * 24 * 3600,
                metavar="S",
                help="how long a certificate it signs lasts (each is renewed after two thirds)",
            ),
        ),
    ),
    "settle": Verb(
        "end a move whose target node is gone for good: its frozen source runs the job again",
        (
            opt("name", metavar="NAME"),
            opt("--node", required=True, metavar="NODE", help="the move's source, where the job is frozen"),
            opt(
                "--target-down",
                action="store_true",
                help="declare the move's target node off for good (required: were it running the job, "
                "the job would run twice); the source still asks it once more and obeys an answer. "
                "On Kubernetes: criuctl cancel PODMIGRATION",
            ),
        ),
    ),
    "cancel": Verb(
        "cancel a PodMigration: one not begun ends, one in doubt whose target node is deleted or "
        "tainted out-of-service runs on its source again (one under way ends by itself)",
        (
            opt("name", metavar="PODMIGRATION"),
            opt("-n", "--namespace", help="default: the kubeconfig context's"),
            opt("--kubeconfig", metavar="FILE"),
        ),
    ),
    "get": Verb(
        "list the PodMigrations: pod, nodes, phase, downtime, age, and why a move failed",
        (
            opt("name", nargs="?", metavar="PODMIGRATION", help="only this one, in full"),
            opt("-n", "--namespace", help="default: the kubeconfig context's"),
            opt("-A", "--all-namespaces", action="store_true"),
            opt("--kubeconfig", metavar="FILE"),
            output("the PodMigrations"),
            opt(
                "-w",
                "--watch",
                action="store_true",
                help="then a line for each one that appears or changes (one named: until it ends)",
            ),
        ),
    ),
    "demo": Verb(
        "train, freeze, restore, and compare against an uninterrupted run",
        (
            opt("--out", default="criuctl-demo", help="directory for the bundle and plot"),
            opt("--steps", type=int, default=80),
            opt("--freeze-at", type=int, default=30, help="freeze once this step has been printed"),
        ),
    ),
}


class _Version(argparse.Action):
    """`--version`: argparse's own would wrap the line to the terminal's width (and compute it on
    every start); this prints it whole, once asked."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"criuctl {version.describe()}")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    """`criuctl`'s parser: the verb lands in `verb` (a sub-verb in `<verb>_verb`), options by name."""
    p = argparse.ArgumentParser(prog="criuctl", description=DESCRIPTION)
    p.add_argument("--version", action=_Version, help="say which criuctl this is, and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", metavar="DIR", help=STATE_DIR_HELP)
    # `node ls --state-dir D` as well as `node --state-dir D ls`: SUPPRESS, or the sub-verb's
    # default (None) would overwrite a --state-dir given before it
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _add_verbs(p.add_subparsers(dest="verb", required=True, metavar="VERB"), VERBS, common, after)
    return p


def _add_verbs(sub, verbs: dict[str, Verb], common: argparse.ArgumentParser, after: argparse.ArgumentParser):
    for name, verb in verbs.items():
        s = sub.add_parser(name, help=verb.help, parents=[common])
        for flags, kw in verb.options:
            s.add_argument(*flags, **kw)
        if verb.verbs:
            _add_verbs(s.add_subparsers(dest=f"{name}_verb", required=True), verb.verbs, after, after)
