"""The `baseline` Pod Security Standard as the PodSecurity admission plugin checks it: a stand-in.

The real checks are Go, in k8s.io/pod-security-admission/policy (check_hostProcess.go,
check_hostNamespaces.go, check_privileged.go, check_capabilities_baseline.go,
check_hostPathVolumes.go, check_hostPorts.go, check_appArmorProfile.go, check_seLinuxOptions.go,
check_procMount.go, check_seccompProfile_baseline.go, check_sysctls.go, check_probe.go), and the API
server that runs them here (v1.20.2) predates the plugin (alpha in 1.22). So this module checks the
same fields against the same allowed values, each check with the minor version from which
`enforce-version` applies it, and names every violation by its field path as the plugin's message
does. A namespace labelled `pod-security.kubernetes.io/enforce-version: latest` (the default) gets
every check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Pod = dict[str, Any]
LATEST = (1, 99)

# check_capabilities_baseline.go: the runtimes' default set; anything else added is refused
DEFAULT_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
     "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
# check_seLinuxOptions.go (container_engine_t from 1.31)
SELINUX_TYPES = {"": (1, 0), "container_t": (1, 0), "container_init_t": (1, 0), "container_kvm_t": (1, 0),
                 "container_engine_t": (1, 31)}  # fmt: skip
# check_sysctls.go: the safe set, each from the version that allowed it
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced": (1, 0),
    "net.ipv4.ip_local_port_range": (1, 0),
    "net.ipv4.tcp_syncookies": (1, 0),
    "net.ipv4.ping_group_range": (1, 0),
    "net.ipv4.ip_unprivileged_port_start": (1, 0),
    "net.ipv4.ip_local_reserved_ports": (1, 27),
    "net.ipv4.tcp_keepalive_time": (1, 29),
    "net.ipv4.tcp_fin_timeout": (1, 29),
    "net.ipv4.tcp_keepalive_intvl": (1, 29),
    "net.ipv4.tcp_keepalive_probes": (1, 29),
}
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
HANDLERS = ("httpGet", "tcpSocket")


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            yield f"spec.{kind}[{i}]", c


def _contexts(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The pod's security context and each container's, with the field path of each."""
    yield "spec.securityContext", spec.get("securityContext") or {}
    for where, c in _containers(spec):
        yield f"{where}.securityContext", c.get("securityContext") or {}


def _host_process(spec: dict[str, Any]) -> Iterator[str]:
    for where, ctx in _contexts(spec):
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            yield f"{where}.windowsOptions.hostProcess"


def _host_namespaces(spec: dict[str, Any]) -> Iterator[str]:
    yield from (f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k))


def _privileged(spec: dict[str, Any]) -> Iterator[str]:
    for where, c in _containers(spec):
        if (c.get("securityContext") or {}).get("privileged"):
            yield f"{where}.securityContext.privileged"


def _capabilities(spec: dict[str, Any]) -> Iterator[str]:
    for where, c in _containers(spec):
        added = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        if any(cap not in DEFAULT_CAPABILITIES for cap in added):
            yield f"{where}.securityContext.capabilities.add"


def _host_path(spec: dict[str, Any]) -> Iterator[str]:
    for i, v in enumerate(spec.get("volumes") or []):
        if "hostPath" in v:
            yield f"spec.volumes[{i}].hostPath"


def _host_ports(spec: dict[str, Any]) -> Iterator[str]:
    for where, c in _containers(spec):
        for j, p in enumerate(c.get("ports") or []):
            if p.get("hostPort"):
                yield f"{where}.ports[{j}].hostPort"


def _app_armor(pod: Pod) -> Iterator[str]:
    for key, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        armored = key.startswith("container.apparmor.security.beta.kubernetes.io/")
        if armored and value != "runtime/default" and not value.startswith("localhost/"):
            yield f"metadata.annotations[{key}]"
    for where, ctx in _contexts(pod.get("spec") or {}):
        if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
            yield f"{where}.appArmorProfile.type"


def _se_linux(spec: dict[str, Any], version: tuple[int, int]) -> Iterator[str]:
    for where, ctx in _contexts(spec):
        opts = ctx.get("seLinuxOptions") or {}
        since = SELINUX_TYPES.get(opts.get("type", ""))
        if since is None or since > version:
            yield f"{where}.seLinuxOptions.type"
        yield from (f"{where}.seLinuxOptions.{k}" for k in ("user", "role") if opts.get(k))


def _proc_mount(spec: dict[str, Any]) -> Iterator[str]:
    for where, c in _containers(spec):
        if (c.get("securityContext") or {}).get("procMount") not in (None, "Default"):
            yield f"{where}.securityContext.procMount"


def _seccomp(pod: Pod) -> Iterator[str]:
    for where, ctx in _contexts(pod.get("spec") or {}):
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield f"{where}.seccompProfile.type"


def _sysctls(spec: dict[str, Any], version: tuple[int, int]) -> Iterator[str]:
    for i, s in enumerate((spec.get("securityContext") or {}).get("sysctls") or []):
        since = SAFE_SYSCTLS.get(s.get("name", ""))
        if since is None or since > version:
            yield f"spec.securityContext.sysctls[{i}].name"


def _probe_hosts(spec: dict[str, Any]) -> Iterator[str]:
    for where, c in _containers(spec):
        hooks = [(f"{where}.{p}", c.get(p) or {}) for p in PROBES]
        lifecycle = c.get("lifecycle") or {}
        hooks += [(f"{where}.lifecycle.{h}", lifecycle.get(h) or {}) for h in ("postStart", "preStop")]
        for at, handler in hooks:
            for kind in HANDLERS:
                if (handler.get(kind) or {}).get("host"):
                    yield f"{at}.{kind}.host"


CHECKS: list[tuple[tuple[int, int], Callable[[Pod, tuple[int, int]], Iterator[str]]]] = [
    ((1, 0), lambda p, v: _host_process(p["spec"])),
    ((1, 0), lambda p, v: _host_namespaces(p["spec"])),
    ((1, 0), lambda p, v: _privileged(p["spec"])),
    ((1, 0), lambda p, v: _capabilities(p["spec"])),
    ((1, 0), lambda p, v: _host_path(p["spec"])),
    ((1, 0), lambda p, v: _host_ports(p["spec"])),
    ((1, 0), lambda p, v: _app_armor(p)),
    ((1, 0), lambda p, v: _se_linux(p["spec"], v)),
    ((1, 0), lambda p, v: _proc_mount(p["spec"])),
    ((1, 19), lambda p, v: _seccomp(p)),
    ((1, 0), lambda p, v: _sysctls(p["spec"], v)),
    ((1, 34), lambda p, v: _probe_hosts(p["spec"])),
]


def baseline(pod: Pod, version: tuple[int, int] = LATEST) -> list[str]:
    """The fields of `pod` that the `baseline` level refuses at `enforce-version` `version`."""
    return [field for since, check in CHECKS if since <= version for field in check(pod, version)]
