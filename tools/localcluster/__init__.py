"""A real Kubernetes on one machine, for trying criuctl and for its tests: `scripts/local-cluster`.

    scripts/local-cluster up [--nodes a,b] [--dir DIR] [--net 10.N.0]   build once (cached), start,
                                                                        print KUBECONFIG
    scripts/local-cluster down [--dir DIR]               remove everything it started
    scripts/local-cluster status [--dir DIR]
    scripts/local-cluster demo [--out DIR] [--net 10.N.0]   its own cluster: a pod moved mid-training

Clusters run side by side when each has its own --dir and --net (a test's beside a user's): what
they share with the host is named from the net (layout.Layout).

Real parts only: etcd, kube-apiserver, kube-scheduler and kube-controller-manager v1.20.2 (built
from Debian 12's source package by scripts/install-kubernetes.sh), and per node a network namespace
with its own containerd, a real kubelet and kube-proxy, each node's daemons in a private mount
namespace (the kubelet and containerd hard-code host paths; two nodes on one host would otherwise
delete each other's logs and cgroups) where the kernel settings the kubelet insists on writing are
files of ours, so the machine's own are never touched. criuctl's agent (the DaemonSet) and webhook
(the Deployment) run from `manifests/` as a user applies them, from the image built here from the
Dockerfile (scripts/build-image.sh, cached by content), with nothing of the checkout mounted. What
cannot run here has a named stand-in: the training operator (`localcluster.pytorchjob`), and the
cluster DNS (`localcluster.dns`: Debian's dnsmasq fed from the API, for CoreDNS).

Not a product: it binds to addresses of its own bridge, uses token authentication with tokens it
writes into DIR, and runs a Kubernetes that is end-of-life. Every part is recorded in DIR/state.json
so that `down` finds it again from another process.
"""

from __future__ import annotations

from localcluster.layout import Layout

__all__ = ["Layout"]
