"""Every environment variable criuctl reads, in one place: its name, meaning, type and default.

Why one module: the variables used to be read in a dozen modules, some at import time, where a
malformed value (`CRIUCTL_CRIU_LOG_LEVEL=debug`) was a traceback before any verb ran. Here each is a
`Var`, which *is* its name (a `str`: it goes into an environment, a message, a test's `setenv` as
is) and reads its value only when asked (`get()`), never at import. A value that is not what the
variable takes is refused in one line naming the variable and what it takes (`BadVariable`); the
CLI checks them all before any verb runs (`check`). Unset and empty are the same: the default.

Two kinds of module keep their own reads, by design: the in-process hook (`criuctl_hook`, loaded
into the workload, never imports criuctl) and the namespace init (`criuctl.core.nsinit`, copied
alone into containers). The init's names are defined there and only registered here. The hook's
are written in both places, as this module cannot import the hook: the CLI must start (and say
"needs root") with nothing but criuctl on its path; tests/test_env.py checks the two agree.
README.md ("Environment variables") lists the same table; tests/test_env.py keeps the two, and the
rule that criuctl reads these only through here, in step.

Standard library only: `statedir`, which every verb checks first, reads through here.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, Generic, TypeVar

from criuctl.core import nsinit
from criuctl.core.errors import CriuctlError

T = TypeVar("T")


class Role(enum.Enum):
    """Who sets a variable; the README's table says it for each."""

    SETTING = "setting"  # an operator or a user sets it
    TEST = "test-only"  # tests and benchmarks set it, to stop, break or compare; never needed in use
    INTERNAL = "internal"  # criuctl (or its webhook) sets it for a process it starts; never set by hand
    TOOLING = "tooling"  # read by the install scripts and the test suite, not by criuctl


class BadVariable(CriuctlError):
    """An environment variable holds a value it does not take."""

    def __init__(self, var: Var[Any], raw: str, hint: str = "") -> None:
        super().__init__(
            f"{var}={raw!r} is not {var.expect}",
            hint or (f"e.g. {var}={var.example}, or unset it" if var.example else "unset it"),
        )


class Var(str, Generic[T]):
    """One environment variable: the string is its name; `get()` its value, parsed, or the default.

    `parse` raises ValueError (or TypeError) on a value the variable does not take; `expect` says
    in words what it takes, for that one line. `shown` is the default as the README says it, for
    defaults computed when used (another file, the first socket that exists)."""

    parse: Callable[[str], T]
    default: T
    meaning: str
    expect: str
    readers: str
    role: Role
    shown: str
    example: str

    def __new__(
        cls,
        name: str,
        meaning: str,
        *,
        parse: Callable[[str], T],
        default: T,
        expect: str,
        readers: str,
        role: Role = Role.SETTING,
        shown: str | None = None,
        example: str = "",
    ) -> Var[T]:
        self = super().__new__(cls, name)
        self.parse, self.default, self.meaning, self.expect = parse, default, meaning, expect
        self.readers, self.role, self.example = readers, role, example
        self.shown = shown if shown is not None else ("unset" if default is None else str(default))
        return self

    def get(self) -> T:
        """The value now in this process's environment (read each time: tests change it)."""
        return self.value_of(os.environ.get(self))

    def value_of(self, raw: str | None) -> T:
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except (ValueError, TypeError) as exc:
            raise BadVariable(self, raw) from exc

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        """Copied or pickled (a pod spec holding the name, say), it is the name: a plain str."""
        return str, (str(self),)

    def export(self, value: str) -> None:
        """Set it in this process's environment, for the processes it starts (`--state-dir`)."""
        os.environ[self] = value


# ------------------------------------------------------------------------------------- parsers


def _text(raw: str) -> str:
    return raw


def _switch(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def _present(raw: str) -> bool:
    return True  # any value: on (unset or empty: off)


def _integer(raw: str) -> int:
    return int(raw)


def _seconds(raw: str) -> float:
    value = float(raw)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(raw)
    return value


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw

    return parse


def _seconds_object(raw: str) -> dict[str, float]:
    """A JSON object of non-negative finite numbers; which names it may hold, its reader checks."""
    given = json.loads(raw)
    if not isinstance(given, dict):
        raise ValueError(raw)
    values = {k: float(v) for k, v in given.items()}
    if not all(math.isfinite(v) and v >= 0 for v in values.values()):
        raise ValueError(raw)
    return values


D = TypeVar("D")


def overrides(var: Var[dict[str, float]], cls: Callable[..., D], raw: str | None = None) -> D:
    """The dataclass `cls` with the fields `var` (or `raw`) names overridden: each value converted
    to its field's type (`retries` stays an int); a name `cls` has not is refused in one line, as a
    typo would otherwise leave a wait unbounded."""
    raw = os.environ.get(var) if raw is None else raw
    defaults = {f.name: f.default for f in fields(cls)}  # type: ignore[arg-type]
    hint = f"name only {', '.join(sorted(defaults))}, e.g. '{var.example}'; or unset it"
    try:
        given = var.parse(raw) if raw else {}
        if set(given) - set(defaults):
            raise ValueError(raw)
        return cls(**{k: int(v) if isinstance(defaults[k], int) else v for k, v in given.items()})
    except (ValueError, TypeError) as exc:
        raise BadVariable(var, raw or "", hint) from exc


# ------------------------------------------------------------------------ settings (operators)

_SECONDS_OBJECT = "a JSON object of non-negative seconds"

STATE_DIR: Var[Path] = Var(
    "CRIUCTL_STATE_DIR",
    "criuctl's state on this node (`criuctl.core.statedir`); `--state-dir` sets it for the verb and "
    "the processes it starts",
    parse=Path,
    default=Path("/var/lib/criuctl"),
    expect="a folder",
    readers="criuctl.core.statedir: every verb, the agent",
)
SPOOL_DIR: Var[Path | None] = Var(
    "CRIUCTL_SPOOL_DIR",
    "where the agent writes bundles in flight (a tmpfs takes the disk out of a migration's path); "
    "`agent --spool-dir` sets it",
    parse=Path,
    default=None,
    shown="the state dir",
    expect="a folder",
    readers="criuctl.core.statedir: the agent and its handoffs",
)
AGENT_IDENTITY: Var[tuple[Path, Path] | None] = Var(
    "CRIUCTL_AGENT_IDENTITY",
    "the certificate and key (CERT:KEY) an agent, its handoffs or the controller present to the agents "
    "they call (mutual TLS: on Kubernetes in place of a token); the agent and the controller set it",
    parse=lambda raw: (Path(raw.partition(":")[0]), Path(raw.partition(":")[2] or raw.partition(":")[0])),
    default=None,
    expect="CERT:KEY, two PEM files (or one holding both)",
    readers="criuctl.agent.conn, criuctl.client.agents: the agent, its handoffs, the controller",
)
BUNDLE_KEY: Var[Path | None] = Var(
    "CRIUCTL_BUNDLE_KEY",
    "the file holding the node's own signing key, if not the state dir's",
    parse=Path,
    default=None,
    shown="`bundle.key` in the state dir",
    expect="a file",
    readers="criuctl.core.statedir: dump, restore, inspect, the agent",
)
RUNTIME_ENDPOINT: Var[str | None] = Var(
    "CRIUCTL_RUNTIME_ENDPOINT",
    "the container runtime's CRI socket (or `procfs`); `--runtime-endpoint` overrides it",
    parse=_text,
    default=None,
    shown="the first of containerd's and CRI-O's sockets that exists",
    expect="a socket",
    readers="criuctl.container.runtime: ps, dump, the agent",
    example="unix:///run/containerd/containerd.sock",
)
CRIU: Var[str] = Var(
    "CRIUCTL_CRIU",
    "the criu binary: a path, or a name looked up on PATH",
    parse=_text,
    default="criu",
    expect="a path",
    readers="criuctl.engine.criu: every dump and restore",
)
CRIU_LOG_LEVEL: Var[int] = Var(
    "CRIUCTL_CRIU_LOG_LEVEL",
    "CRIU's log level: 2 warnings and errors, as the criu CLI; 4 a full trace (~20% slower dumps)",
    parse=_integer,
    default=2,
    expect="an integer (CRIU's log level, 0-4)",
    readers="criuctl.engine.criu: every dump and restore",
    example="4",
)
NETWORK_LOCK: Var[str] = Var(
    "CRIUCTL_NETWORK_LOCK",
    "how CRIU locks a tree's TCP while it is frozen; `skip` on a node without nf_tables, for jobs "
    "without TCP connections",
    parse=_one_of("nftables", "iptables", "skip"),
    default="nftables",
    expect="one of nftables, iptables, skip",
    readers="criuctl.engine.criu: every dump and restore",
    example="skip",
)
PID_NAMESPACE: Var[bool | None] = Var(
    "CRIUCTL_PID_NAMESPACE",
    "whether `criuctl run` gives the job its own PID namespace (1) or not (0)",
    parse=_switch,
    default=None,
    shown="yes, except on an NVIDIA GPU node",
    expect="0 or 1",
    readers="criuctl.local.supervisor: run",
    example="1",
)
BOUNDARY_TIMEOUT: Var[float] = Var(
    "CRIUCTL_BOUNDARY_TIMEOUT",
    "seconds a trainer's step may take to end before a dump at a step boundary gives up",
    parse=_seconds,
    default=30.0,
    shown="30",
    expect="a number of seconds",
    readers="criuctl.local.stepboundary: dump, migrate (their sources)",
    example="120",
)
KUBE_TIMEOUTS: Var[dict[str, float]] = Var(
    "CRIUCTL_KUBE_TIMEOUTS",
    "the waits on the Kubernetes API server, overridden by name (`criuctl.kube.api.KubeTimeouts`)",
    parse=_seconds_object,
    default={},
    shown="connect 5, read 30 (seconds)",
    expect=_SECONDS_OBJECT,
    readers="criuctl.kube.api: every verb that talks to Kubernetes, the webhook",
    example='{"read": 10}',
)
TIMEOUTS: Var[dict[str, float]] = Var(
    "CRIUCTL_TIMEOUTS",
    "the waits of the migration protocol, overridden by name (`criuctl.agent.protocol.Timeouts`)",
    parse=_seconds_object,
    default={},
    shown="`Timeouts`' fields",
    expect=_SECONDS_OBJECT,
    readers="criuctl.agent.protocol: the agent, its handoffs, migrate",
    example='{"stall": 5}',
)
VERBOSE: Var[bool] = Var(
    "CRIUCTL_VERBOSE",
    "after an error's one line, also print CRIU's log tail (or where an unexpected error happened)",
    parse=_switch,
    default=False,
    shown="0",
    expect="0 or 1",
    readers="criuctl.cli.main: every verb",
    example="1",
)

# ------------------------------------------------------------- the job's (the `migrator` API)

MIGRATION_SIGNAL_PATH: Var[Path] = Var(
    "MIGRATION_SIGNAL_PATH",
    "the migrator protocol's signal file, beside the checkpoint (pytorchjob-migration's name)",
    parse=Path,
    default=Path("./ckpts/signal"),
    shown="./ckpts/signal",
    expect="a file",
    readers="criuctl.migration (the job), criuctl prestop",
)
MIGRATION_CKPT_PATH: Var[Path] = Var(
    "MIGRATION_CKPT_PATH",
    "where the `migrator` API writes and reads the job's checkpoint (pytorchjob-migration's name)",
    parse=Path,
    default=Path("./ckpts/migration.pth"),
    shown="./ckpts/migration.pth",
    expect="a file",
    readers="criuctl.migration (the job)",
)
MIGRATION_KEY_PATH: Var[Path | None] = Var(
    "MIGRATION_KEY_PATH",
    "the key that signs that checkpoint (mount a Secret there)",
    parse=Path,
    default=None,
    shown="`.migration.key` beside the checkpoint",
    expect="a file",
    readers="criuctl.migration (the job)",
)

# ------------------------------------------------------------- test-only (and benchmarks)

PAUSE_AT: Var[str] = Var(
    "CRIUCTL_PAUSE_AT",
    "stop the process at these named points (`criuctl.agent.protocol.Point`, comma-separated)",
    parse=_text,
    default="",
    shown="unset",
    expect="point names",
    readers="criuctl.agent.points: client, agents, handoffs",
    role=Role.TEST,
    example="client.sent",
)
PAUSE_DIR: Var[Path | None] = Var(
    "CRIUCTL_PAUSE_DIR",
    "where a stopped process says so and waits for its go (and the file `armed` lists more points)",
    parse=Path,
    default=None,
    shown="/tmp",
    expect="a folder",
    readers="criuctl.agent.points: client, agents, handoffs",
    role=Role.TEST,
)
FAULT_DIR: Var[Path | None] = Var(
    "CRIUCTL_FAULT_DIR",
    "a failure `NAME` (`criuctl.core.faults.Fault`) is on while the file `DIR/NAME` exists",
    parse=Path,
    default=None,
    expect="a folder",
    readers="criuctl.core.faults: the agent, its handoffs, thaw",
    role=Role.TEST,
)
LIBNVML: Var[str] = Var(
    "CRIUCTL_LIBNVML",
    "the NVML library to load (tests point it at a compiled stand-in)",
    parse=_text,
    default="libnvidia-ml.so.1",
    expect="a library",
    readers="criuctl.gpu.gpus: dump, restore, the agent",
    role=Role.TEST,
)
LIBCUDA: Var[str] = Var(
    "CRIUCTL_LIBCUDA",
    "the CUDA driver library to load (tests point it at a compiled stand-in)",
    parse=_text,
    default="libcuda.so.1",
    expect="a library",
    readers="criuctl.gpu.cuda: dump, restore, the agent",
    role=Role.TEST,
)
CUDA_REMAP: Var[bool] = Var(
    "CRIUCTL_CUDA_REMAP",
    "0: restore GPU state without the old → new GPU UUID pairs (tests/gpu/check.sh tries both)",
    parse=_switch,
    default=True,
    shown="1",
    expect="0 or 1",
    readers="criuctl.gpu.gpustate: restore, the agent",
    role=Role.TEST,
    example="0",
)
NCCL_TRY: Var[bool] = Var(
    "CRIUCTL_NCCL_TRY",
    "1: checkpoint a GPU job through the driver even where its NCCL communicators were not all "
    "suspended (NCCL older than 2.29.7, peers with NVLS/IPC/SHM), instead of refusing it; a driver "
    "that refuses is rolled back",
    parse=_switch,
    default=False,
    shown="0",
    expect="0 or 1",
    readers="criuctl.gpu.nccl: dump, the agent",
    role=Role.SETTING,
    example="1",
)
STREAM: Var[str] = Var(
    "CRIUCTL_STREAM",
    "`sealed`: a migration's bundle leaves only once sealed, for comparisons (bench/migrate.py); "
    "`direct`: a stop-and-copy's memory pages go straight into the target's CRIU page server, over "
    "TLS pinned to certificates made for the migration (docs/architecture.md)",
    parse=_one_of("live", "sealed", "direct"),
    default="live",
    expect="live, sealed or direct",
    readers="criuctl.client.migrate: migrate",
    role=Role.TEST,
    example="sealed",
)
NO_WARM_HANDOFF: Var[bool] = Var(
    "CRIUCTL_NO_WARM_HANDOFF",
    "set (any value): every handoff process starts cold, for comparisons",
    parse=_present,
    default=False,
    shown="unset",
    expect="any value",
    readers="criuctl.agent.handoffleases: the agent",
    role=Role.TEST,
    example="1",
)

# ------------------------------------------------ internal: set by criuctl for what it starts
# (the hook's: criuctl_hook.contract's names, which cannot be imported here; the init's: nsinit's)

WORKLOAD: Var[str] = Var(
    "CRIUCTL_WORKLOAD",
    "the workload's name, in its environment (`criuctl run`; in a container, its host name, set by "
    "criuctl's init)",
    parse=_text,
    default="",
    shown="unset",
    expect="a workload name",
    readers="criuctl_hook (in the workload)",
    role=Role.INTERNAL,
)
HOOKS_DIR: Var[str] = Var(
    "CRIUCTL_HOOKS_DIR",
    "the hook's folder, put on the workload's PYTHONPATH",
    parse=_text,
    default="",
    shown="unset",
    expect="a folder",
    readers="criuctl.core.nsinit (the workload's init)",
    role=Role.INTERNAL,
)
CONTROL_DIR: Var[str] = Var(
    "CRIUCTL_CONTROL_DIR",
    "where criuctl asks the hook for a step boundary (in a container, /run/criuctl/boundary, set by "
    "criuctl's init)",
    parse=_text,
    default="",
    shown="unset",
    expect="a folder",
    readers="criuctl_hook (in the workload)",
    role=Role.INTERNAL,
)
RESUME_STATE: Var[str] = Var(
    "CRIUCTL_RESUME_STATE",
    "a state bundle the restarted command loads (`restore` of a `dump --state`)",
    parse=_text,
    default="",
    shown="unset",
    expect="a folder",
    readers="criuctl_hook, criuctl.migration (in the workload)",
    role=Role.INTERNAL,
)
HOOKED_PID: Var[str] = Var(
    "CRIUCTL_HOOKED_PID",
    "the first process of the workload that loaded the hook (set by the hook)",
    parse=_text,
    default="",
    shown="unset",
    expect="a PID",
    readers="criuctl_hook (in the workload)",
    role=Role.INTERNAL,
)
ALLOW_IO_URING: Var[str] = Var(
    nsinit.ENV_ALLOW_IO_URING,
    "1: the init does not block io_uring (`criuctl run --allow-io-uring`)",
    parse=_text,
    default="",
    shown="unset",
    expect="1",
    readers="criuctl.core.nsinit (the workload's init)",
    role=Role.INTERNAL,
)
INIT_REPORT_FD: Var[str] = Var(
    nsinit.ENV_REPORT_FD,
    "the pipe on which the init tells `criuctl run` whether the command could be started",
    parse=_text,
    default="",
    shown="unset",
    expect="a file descriptor",
    readers="criuctl.core.nsinit (the workload's init)",
    role=Role.INTERNAL,
)
POD_UID: Var[str] = Var(
    nsinit.ENV_POD_UID,
    "the pod's UID (the webhook sets it from the downward API): the init of a container restarted "
    "after its job moved away waits instead of running the job again",
    parse=_text,
    default="",
    shown="unset",
    expect="a pod UID",
    readers="criuctl.core.nsinit (the container's init)",
    role=Role.INTERNAL,
)

OWN_POD: Var[str] = Var(
    "CRIUCTL_POD",
    "NAMESPACE/NAME of the pod criuctl's webhook runs in (its manifest sets it from the downward "
    "API): the webhook reads its own image there, for the init container of each pod it wraps",
    parse=_text,
    default="",
    shown="unset",
    expect="NAMESPACE/NAME",
    readers="criuctl.kube.webhook",
    role=Role.INTERNAL,
)

# ----------------------------------------------- tooling: install scripts and the test suite

_SCRIPTS = "scripts/install-*.sh, tests, tools/localcluster"
CACHE: Var[str] = Var(
    "CRIUCTL_CACHE",
    "where built Kubernetes and containerd binaries are kept between runs",
    parse=_text,
    default="/usr/local/lib/criuctl",
    expect="a folder",
    readers=_SCRIPTS,
    role=Role.TOOLING,
)
BUILDER: Var[str] = Var(
    "CRIUCTL_BUILDER",
    "the image builder `make image` uses",
    parse=_text,
    default="",
    shown="the first of buildah, podman, docker that works",
    expect="buildah, podman or docker",
    readers="scripts/build-image.sh",
    role=Role.TOOLING,
)
BUILD_CA: Var[str] = Var(
    "CRIUCTL_BUILD_CA",
    "the CA bundle `make image` hands its build as a secret (pip trusts it)",
    parse=_text,
    default="",
    shown="SSL_CERT_FILE, else the system's",
    expect="a file",
    readers="scripts/build-image.sh",
    role=Role.TOOLING,
)
CONTAINERD2: Var[str] = Var(
    "CRIUCTL_CONTAINERD2",
    "where containerd 2 is installed, for the tests that need it",
    parse=_text,
    default="/usr/local/lib/criuctl/containerd-2",
    expect="a folder",
    readers="scripts/install-containerd2.sh, tests/requirements.py",
    role=Role.TOOLING,
)
CRIU_SRC: Var[str] = Var(
    "CRIUCTL_CRIU_SRC",
    "where CRIU's source is built",
    parse=_text,
    default="/usr/local/src/criuctl",
    expect="a folder",
    readers="scripts/install-criu.sh",
    role=Role.TOOLING,
)
CRI_SRC: Var[str] = Var(
    "CRIUCTL_CRI_SRC",
    "where containerd's source is built",
    parse=_text,
    default="/usr/local/src/criuctl/containerd",
    expect="a folder",
    readers="scripts/install-containerd.sh",
    role=Role.TOOLING,
)
K8S_SRC: Var[str] = Var(
    "CRIUCTL_K8S_SRC",
    "where Kubernetes' source is built",
    parse=_text,
    default="/usr/local/src/criuctl/kubernetes",
    expect="a folder",
    readers="scripts/install-kubernetes.sh",
    role=Role.TOOLING,
)
TESTS_REQUIRE_ALL: Var[str] = Var(
    "CRIUCTL_TESTS_REQUIRE_ALL",
    "1 (`make test` sets it): a test requirement that `make install` provides is missing: stop at "
    "once instead of skipping",
    parse=_text,
    default="",
    shown="unset",
    expect="1",
    readers="tests/requirements.py",
    role=Role.TOOLING,
)
TESTS_SHARE: Var[str] = Var(
    "CRIUCTL_TESTS_SHARE",
    "I/N: the share of the test nets (10.77-176.0.0/24) a test session picks from, when "
    "scripts/run-tests.sh runs N sessions side by side",
    parse=_text,
    default="0/1",
    expect="I/N, e.g. 1/2",
    readers="tests/cluster.py",
    role=Role.TOOLING,
)
GPU_CARRY: Var[str] = Var(
    "CRIUCTL_GPU_CARRY",
    "the CRIU build tests/gpu/check.sh carries to the GPU host",
    parse=_text,
    default=".gpu-carry",
    shown="`.gpu-carry` in the checkout",
    expect="a folder",
    readers="tests/gpu/check.sh",
    role=Role.TOOLING,
)

ALL: tuple[Var[Any], ...] = tuple(v for v in list(globals().values()) if isinstance(v, Var))


def check() -> None:
    """Refuse, in one line, the first variable criuctl reads that holds a value it does not take:
    the CLI calls this before any verb runs, so that a typo fails the start, not a migration."""
    for var in ALL:
        if var.role is not Role.TOOLING:
            var.get()
