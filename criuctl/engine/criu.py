"""The CRIU engine: typed options in, typed results out, over pycriu's RPC (`criu swrk`).

Bottom layer of criuctl: imports nothing of criuctl but `errors` and `env`. Build, then execute: the
`build_*_request` functions are pure (they turn options into the RPC message you can look at);
`dump`, `restore` and `check` run CRIU. No CLI output is ever parsed. Every failure raises `CriuError`
with the tail of CRIU's own log and a hint in words a user understands.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from criuctl.core import env, faults
from criuctl.core.errors import CriuctlError

MIN_VERSION = (4, 0)
POSTCOPY_PIPE_SIZE = 8 << 20  # fs.pipe-max-size CRIU's page server needs (it sizes a pipe to ~3.3 MB)
LOG_LEVEL_DEBUG = 4
# CRIU's log level is $CRIUCTL_CRIU_LOG_LEVEL (criuctl.core.env): by default warnings and errors, as
# the criu CLI logs; debug logging costs ~20% of dump time at GiB sizes (bench/dump_restore.py).


class TreeOptions(TypedDict):
    """`tree_options()`: fields of both `DumpOptions` and `RestoreOptions`, given as `**tree_options()`."""

    tcp_established: bool
    ext_unix_sk: bool
    file_locks: bool
    network_lock: str


def tree_options() -> TreeOptions:
    """The options dump and restore agree on: a training tree holds TCP (DDP), unix sockets, file
    locks. $CRIUCTL_NETWORK_LOCK=skip: a node whose kernel has no nf_tables (the GPU check host may
    not), for jobs without TCP connections to lock."""
    return TreeOptions(
        tcp_established=True, ext_unix_sk=True, file_locks=True, network_lock=env.NETWORK_LOCK.get()
    )


@dataclass(frozen=True)
class KernelFix:
    """A kernel release that breaks CRIU releases before `criu`: the version floor alone (what any
    CRIU 4 can do) does not say whether the installed one works on this node's kernel."""

    kernel: tuple[int, int]
    criu: tuple[int, int, int]
    what: str


# scripts/install-criu.sh installs a release that has every fix below
KERNEL_FIXES = (
    KernelFix((6, 16), (4, 2, 0), "SO_PASSCRED fails on TCP sockets: no job with a connection can be dumped"),
    KernelFix((7, 1), (4, 2, 1), "UDP-Lite is gone: CRIU collects no socket at all"),
)


def kernel_release(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of this kernel (or of `release`, as `uname -r` prints it)."""
    m = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def missing_fixes(criu: tuple[int, int, int], kernel: tuple[int, int]) -> list[KernelFix]:
    """The fixes that `kernel` needs and CRIU `criu` lacks."""
    return [f for f in KERNEL_FIXES if kernel >= f.kernel and criu < f.criu]


class CriuError(CriuctlError):
    """CRIU refused or failed; `log_tail` holds the end of its log."""

    def __init__(self, what: str, hint: str = "", log_tail: str = "", errno: int = 0) -> None:
        super().__init__(what, hint, detail=log_tail)
        self.log_tail = log_tail
        self.errno = errno


# What CRIU's log says → what the user should do. First match wins; order from specific to generic.
_HINTS: list[tuple[str, str, str]] = [
    (
        r"No space left on device",
        "disk full",
        "free space where the bundle is written (or pick another -o directory); the workload keeps running",
    ),
    (
        r"anon_inode:\[io_uring\]|io_uring",
        "the workload uses io_uring, which CRIU cannot checkpoint",
        "run it under `criuctl run` without --allow-io-uring, or set sysctl kernel.io_uring_disabled=2",
    ),
    (
        r"Can't get \d+:\d+ opt: Operation not supported",
        "this CRIU cannot dump TCP/UDP sockets on kernels >= 6.16",
        "install CRIU >= 4.2.1 with scripts/install-criu.sh",
    ),
    (
        r"Unexpected rt vDSO area bounds|vdso",
        "this CRIU does not understand this kernel's vDSO",
        "install CRIU >= 4.0 with scripts/install-criu.sh",
    ),
    (
        r"has bad size",
        "a file the workload had open changed size since the checkpoint",
        "restore the file as it was at checkpoint time, or take a new checkpoint",
    ),
    (
        r"(?:/dev/nvidia|nvidia)",
        "the workload holds NVIDIA GPU state that plain CRIU cannot save",
        "use a driver with the CUDA checkpoint API (r570+) so criuctl can move GPU state to host memory",
    ),
    (
        r"PID \d+ is busy|already exists",
        "a process with one of the checkpoint's PIDs already exists",
        "restore into a new PID namespace (checkpoint workloads started with `criuctl run`)",
    ),
    (
        r"(?:Can't|Unable to) (?:open|find)? ?(?:file|path)? ?(?P<path>[^\s:]*).*No such file or directory",
        "a file the workload had open is missing on this host",
        "make the same paths (script, data, logs, Python) available here before restoring",
    ),
    (
        r"Unsupported|Can't dump|unknown|Unknown",
        "the workload holds a resource CRIU cannot checkpoint",
        "see the CRIU log below for the resource; the workload was left running",
    ),
]


def _named_path(m: re.Match[str]) -> str:
    """ ": /the/path" where the pattern caught the file CRIU names (relative to the root on restore):
    "a file is missing" is half an answer when the job holds hundreds."""
    path = m.groupdict().get("path")
    if not path or "/" not in path:
        return ""
    return ": " + (path if path.startswith("/") else "/" + path)


def hint_for(log_tail: str) -> tuple[str, str]:
    """(what, hint) for a CRIU log tail: the most specific diagnosis we know."""
    for pattern, what, hint in _HINTS:
        m = re.search(pattern, log_tail)
        if m:
            return what + _named_path(m), hint
    return "CRIU failed", "see the CRIU log below"


@dataclass(frozen=True)
class PageTls:
    """CRIU's TLS on a page-server connection, mutual and pinned: each end's CA file is the other
    end's certificate (one made for this migration), so nothing else can be on the other end.
    Names are not checked (`tls_no_cn_verify`): the pin is stronger than a name, and CRIU's server
    would check the client's name against its *own* listening address."""

    peer_cert: Path  # the only certificate this end accepts
    cert: Path
    key: Path


@dataclass(frozen=True)
class PagesTo:
    """Stop-and-copy straight to the target: CRIU sends memory pages to a page server there (over
    `tls`) and writes only the other images here."""

    address: str
    port: int
    tls: PageTls

    def to_json(self) -> dict[str, Any]:
        t = self.tls
        return {
            "address": self.address,
            "port": self.port,
            "peer_cert": str(t.peer_cert),
            "cert": str(t.cert),
            "key": str(t.key),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PagesTo:
        tls = PageTls(Path(d["peer_cert"]), Path(d["cert"]), Path(d["key"]))
        return cls(str(d["address"]), int(d["port"]), tls)


@dataclass
class DumpOptions:
    """What to checkpoint and how. `leave_stopped` leaves the tree frozen for the caller to commit."""

    pid: int
    images_dir: Path
    work_dir: Path  # where CRIU writes its log
    leave_running: bool = False
    leave_stopped: bool = False
    shell_job: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False
    network_lock: str = "nftables"  # no iptables on our nodes; CRIU's default is iptables
    external: list[str] = field(default_factory=list)
    ghost_limit: int = 1 << 30  # deleted-but-open files (DataLoader shared memory) up to 1 GiB
    lazy_pages: bool = False  # post-copy: keep memory pages back and serve them on `page_server_port`
    page_server_port: int = 0
    lazy_tls: PageTls | None = None  # post-copy: serve them over TLS to the pinned client(s) only
    pages_to: PagesTo | None = None  # send memory pages to the target's page server, not to disk
    log_level: int = field(default_factory=env.CRIU_LOG_LEVEL.get)
    log_file: str = "dump.log"


@dataclass
class RestoreOptions:
    """How to recreate a tree. `inherit_fds` maps a resource key ('pipe:[123]') to our fd for it."""

    images_dir: Path
    work_dir: Path
    rst_sibling: bool = True  # the restored tree becomes *our* child, so we can wait for it
    shell_job: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False
    network_lock: str = "nftables"
    inherit_fds: dict[str, int] = field(default_factory=dict)
    external: list[str] = field(default_factory=list)
    leave_stopped: bool = False  # recreate the tree but keep it stopped until the caller commits
    lazy_pages: bool = False  # post-copy: memory comes from a `lazy_pages_daemon` on the same work_dir
    log_level: int = field(default_factory=env.CRIU_LOG_LEVEL.get)
    log_file: str = "restore.log"
    # Restoring into another container (a placeholder): its rootfs as the tree's root, namespaces
    # to join ({"uts": "/proc/PID/ns/uts"}), external mounts mapped to host paths ({"/data": "/var/…"}),
    # and the cgroup each controller's tasks go to ({"memory": "/k8s.io/ID"}, CRIU's soft mode; on
    # cgroup v2 {"": "/kubepods.slice/…/cri-containerd-ID.scope"}: criuctl.container.cgroups.roots_of).
    root: str | None = None
    join_ns: dict[str, str] = field(default_factory=dict)
    ext_mount_map: dict[str, str] = field(default_factory=dict)
    cgroup_roots: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DumpResult:
    seconds: float
    log_path: Path


@dataclass(frozen=True)
class RestoreResult:
    pid: int  # host PID of the restored root
    seconds: float
    log_path: Path


def _pycriu() -> Any:
    try:
        import pycriu
    except ImportError as exc:
        raise CriuError(
            "pycriu is not installed in this Python",
            "run `make install` (scripts/install-criu.sh installs it from CRIU's source)",
        ) from exc
    return pycriu


def binary() -> str:
    """Absolute path of the criu binary, or a CriuError saying how to get one."""
    name = env.CRIU.get()
    path = shutil.which(name)
    if path is None:
        raise CriuError(
            f"CRIU not found ({name!r} is not on PATH)",
            "install CRIU >= 4.0 with scripts/install-criu.sh (or `make install`)",
        )
    return path


def _network_lock(rpc: Any, method: str) -> int:
    return int({"iptables": rpc.IPTABLES, "nftables": rpc.NFTABLES, "skip": rpc.SKIP}[method])


def _base_request(o: DumpOptions | RestoreOptions, images_fd: int, work_fd: int) -> Any:
    """The options dump and restore share, as a fresh `criu_opts` message."""
    rpc = _pycriu().rpc
    opts = rpc.criu_opts()
    opts.images_dir_fd = images_fd
    if work_fd >= 0:
        opts.work_dir_fd = work_fd
    opts.shell_job = o.shell_job
    opts.tcp_established = o.tcp_established
    opts.ext_unix_sk = o.ext_unix_sk
    opts.file_locks = o.file_locks
    opts.network_lock = _network_lock(rpc, o.network_lock)
    opts.external.extend(o.external)
    opts.log_level = o.log_level
    opts.log_file = o.log_file
    return opts


def build_dump_request(o: DumpOptions, images_fd: int = -1, work_fd: int = -1) -> Any:
    """The `criu_opts` message for a dump (pure: opens nothing)."""
    opts = _base_request(o, images_fd, work_fd)
    opts.pid = o.pid
    opts.leave_running = o.leave_running
    opts.leave_stopped = o.leave_stopped
    opts.ghost_limit = o.ghost_limit
    if o.lazy_pages:
        opts.lazy_pages = True
        opts.ps.port = o.page_server_port  # with lazy_pages CRIU *serves* on this port (any address)
        if o.lazy_tls is not None:
            _tls(opts, o.lazy_tls)
    elif o.pages_to is not None:
        opts.ps.address = o.pages_to.address  # without lazy_pages CRIU *connects* and sends pages
        opts.ps.port = o.pages_to.port
        _tls(opts, o.pages_to.tls)
    return opts


def _tls(opts: Any, tls: PageTls) -> None:
    opts.tls = True
    opts.tls_cacert, opts.tls_cert, opts.tls_key = str(tls.peer_cert), str(tls.cert), str(tls.key)
    opts.tls_no_cn_verify = True


def tls_argv(tls: PageTls) -> list[str]:
    """`_tls` for the criu command line."""
    return [
        "--tls",
        "--tls-cacert",
        str(tls.peer_cert),
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        "--tls-no-cn-verify",
    ]


def build_restore_request(o: RestoreOptions, images_fd: int = -1, work_fd: int = -1) -> Any:
    """The `criu_opts` message for a restore (pure: opens nothing)."""
    opts = _base_request(o, images_fd, work_fd)
    opts.rst_sibling = o.rst_sibling
    opts.leave_stopped = o.leave_stopped
    opts.lazy_pages = o.lazy_pages
    for key, fd in o.inherit_fds.items():
        opts.inherit_fd.add(key=key, fd=fd)
    if o.root:
        opts.root = o.root
    for ns, path in o.join_ns.items():
        opts.join_ns.add(ns=ns, ns_file=path)
    for key, path in o.ext_mount_map.items():
        opts.ext_mnt.add(key=key, val=path)
    if o.cgroup_roots:
        opts.manage_cgroups = True
        opts.manage_cgroups_mode = _pycriu().rpc.SOFT
        for ctrl, path in o.cgroup_roots.items():
            if ctrl:
                opts.cg_root.add(ctrl=ctrl, path=path)
            else:  # cgroup v2's one hierarchy: the root of every controller
                opts.cg_root.add(path=path)
    return opts


class _Dirs:
    """Open images/work dirs as fds that survive pycriu's fork+exec of `criu swrk`."""

    def __init__(self, images_dir: Path, work_dir: Path) -> None:
        self.images_dir, self.work_dir = images_dir, work_dir

    def __enter__(self) -> tuple[int, int]:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.fds = [os.open(d, os.O_DIRECTORY) for d in (self.images_dir, self.work_dir)]
        for fd in self.fds:
            os.set_inheritable(fd, True)
        return self.fds[0], self.fds[1]

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)


def log_tail(path: Path, lines: int = 25) -> str:
    """The last error-bearing lines of a CRIU log (errors first, then the very end)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "Error" in line and "RLIMIT_NOFILE" not in line]  # that one is noise
    tail = errors[-lines:] if errors else text[-lines:]
    return "\n".join(tail)


class Session:
    """One CRIU run; `swrk_pid` is known once CRIU has started, so another thread can kill it."""

    def __init__(self) -> None:
        self.swrk_pid: int | None = None

    def kill(self) -> None:
        if self.swrk_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.swrk_pid, signal.SIGKILL)


Notify = Callable[[str], bool]  # CRIU's notification name ('post-dump', 'status-ready', ...) -> go on?


def _converse(c: Any, req: Any, on_notify: Notify | None, session: Session | None) -> Any:
    """Send one request to `criu swrk` and answer its notifications until the final response.

    pycriu's own calls cannot answer notifications; this is how we learn, *during* a lazy dump,
    that the images are written and the page server is listening ('status-ready').
    """
    pycriu = _pycriu()
    rpc = pycriu.rpc
    s = c._comm.connect(False)
    if session is not None:
        session.swrk_pid = c._comm.swrk
    try:
        s.send(req.SerializeToString())
        while True:
            buf = s.recv(len(s.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK)))
            resp = rpc.criu_resp()
            resp.ParseFromString(buf)
            if resp.type != rpc.NOTIFY:
                break
            ok = on_notify(resp.notify.script) if on_notify else True
            s.send(rpc.criu_req(type=rpc.NOTIFY, notify_success=ok).SerializeToString())
    except OSError as exc:
        raise pycriu.CRIUExceptionInternal(req.type, str(exc)) from exc
    finally:
        c._comm.disconnect()
    if not resp.success:
        raise pycriu.CRIUExceptionExternal(req.type, resp.type, resp.cr_errno)
    return resp


def _run(
    action: str, opts: Any, log_path: Path, on_notify: Notify | None = None, session: Session | None = None
) -> tuple[Any, float]:
    pycriu = _pycriu()
    c = pycriu.criu()
    c.use_binary(binary())
    opts.notify_scripts = on_notify is not None
    req = pycriu.rpc.criu_req(type=getattr(pycriu.rpc, action.upper()), opts=opts)
    started = time.monotonic()
    try:
        resp = _converse(c, req, on_notify, session)
    except pycriu.CRIUExceptionExternal as exc:
        tail = log_tail(log_path)
        what, hint = hint_for(tail)
        raise CriuError(f"CRIU {action} failed: {what}", hint, tail, exc.errno) from exc
    except pycriu.CRIUExceptionInternal as exc:
        raise CriuError(
            f"CRIU {action} could not run: {exc}",
            "check that `criu check` passes (criuctl doctor)",
            log_tail(log_path),
        ) from exc
    return resp, time.monotonic() - started


def dump(o: DumpOptions, on_notify: Notify | None = None, session: Session | None = None) -> DumpResult:
    """Checkpoint the tree rooted at `o.pid` into `o.images_dir`.

    With `o.lazy_pages` this returns only when the last page has been pulled (or the puller gave
    up); `on_notify('status-ready')` says when the images are complete and the page server listens.
    """
    with _Dirs(o.images_dir, o.work_dir) as (images_fd, work_fd):
        _, seconds = _run(
            "dump", build_dump_request(o, images_fd, work_fd), o.work_dir / o.log_file, on_notify, session
        )
    return DumpResult(seconds=seconds, log_path=o.work_dir / o.log_file)


def restore(o: RestoreOptions, session: Session | None = None) -> RestoreResult:
    """Recreate the tree in `o.images_dir`; with rst_sibling it becomes the caller's child."""
    for fd in o.inherit_fds.values():
        os.set_inheritable(fd, True)
    with _Dirs(o.images_dir, o.work_dir) as (images_fd, work_fd):
        resp, seconds = _run(
            "restore", build_restore_request(o, images_fd, work_fd), o.work_dir / o.log_file, session=session
        )
    return RestoreResult(pid=resp.restore.pid, seconds=seconds, log_path=o.work_dir / o.log_file)


LAZY_READY_TIMEOUT = 60.0  # seconds for `criu lazy-pages` to say it listens (it reads the images first)


def lazy_pages_daemon(
    images_dir: Path,
    work_dir: Path,
    address: str,
    port: int,
    ready_timeout: float = LAZY_READY_TIMEOUT,
    tls: PageTls | None = None,
) -> subprocess.Popen[bytes]:
    """Start `criu lazy-pages` pulling pages from a source's page server; returns once it listens.
    With `tls`, over CRIU's TLS, pinned to the source's certificate (`PageTls`).

    CRIU's RPC has no request for this daemon, so it runs as a command; its readiness comes
    through `--status-fd` (one byte), its failure through its exit status and log. A daemon that
    neither gets ready nor fails within `ready_timeout` (stuck on a file it reads, say) is killed
    and that is the failure: a restore never waits without an end.
    """
    ready_r, ready_w = os.pipe()
    log = work_dir / "lazy-pages.log"
    argv = [
        binary(),
        "lazy-pages",
        "--page-server",
        "--address",
        address,
        "--port",
        str(port),
        "-D",
        str(images_dir),
        "-W",
        str(work_dir),
        "-o",
        log.name,
        f"-v{env.CRIU_LOG_LEVEL.get()}",
        "--status-fd",
        str(ready_w),
        *(tls_argv(tls) if tls is not None else []),
    ]
    proc = subprocess.Popen(argv, pass_fds=(ready_w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        readable, _, _ = select.select([ready], [], [], ready_timeout)
        got = ready.read(1) if readable else None
    if got is None:
        proc.kill()
        proc.wait()
        raise CriuError(
            f"CRIU lazy-pages did not get ready within {ready_timeout:.0f} s",
            "see its log; the restore was abandoned and nothing runs from it",
            log_tail(log),
        )
    if not got:
        proc.wait()
        tail = log_tail(log)
        raise CriuError(
            f"CRIU lazy-pages could not reach the page server at {address}:{port}",
            "check that the source node is reachable from this one",
            tail,
        )
    return proc


PAGE_SERVER_LOG = "page-server.log"


def page_server(
    images_dir: Path, work_dir: Path, sock: socket.socket, tls: PageTls
) -> subprocess.Popen[bytes]:
    """Run `criu page-server` on a connection already accepted (`--ps-socket`): it does the TLS
    handshake (pinned, `tls`), writes the pagemap and page images the source's dump sends into
    `images_dir`, and exits 0 once the dump closes the session; `wait_page_server` says how it
    ended. A command, not RPC: CRIU's RPC would daemonize it, and its status would be lost."""
    work_dir.mkdir(parents=True, exist_ok=True)
    fd = sock.fileno()
    argv = [
        binary(),
        "page-server",
        "--ps-socket",
        str(fd),
        "-D",
        str(images_dir),
        "-W",
        str(work_dir),
        "-o",
        PAGE_SERVER_LOG,
        f"-v{env.CRIU_LOG_LEVEL.get()}",
        *tls_argv(tls),
    ]
    return subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def wait_page_server(proc: subprocess.Popen[bytes], work_dir: Path, timeout: float) -> None:
    """Until the page server has received the whole dump; a CriuError if it failed (a refused
    certificate, a cut connection) or is still running after `timeout` (it is killed then)."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise CriuError(
            f"CRIU's page server was still receiving after {timeout:.0f} s",
            "the source stopped sending; nothing was restored from it",
            log_tail(work_dir / PAGE_SERVER_LOG),
        ) from None
    if rc != 0:
        tail = log_tail(work_dir / PAGE_SERVER_LOG)
        what = "refused the sender's certificate" if "certificate" in tail.lower() else f"failed (exit {rc})"
        raise CriuError(
            f"CRIU's page server {what}",
            "nothing was restored from what it received; see its log",
            tail,
        )


def _request(req_type: str, **fields: Any) -> Any:
    pycriu = _pycriu()
    c = pycriu.criu()
    c.use_binary(binary())
    req = pycriu.rpc.criu_req()
    req.type = getattr(pycriu.rpc, req_type)
    for name, value in fields.items():
        getattr(req, name).CopyFrom(value)
    try:
        return c._send_req_and_recv_resp(req)  # pycriu has no public call for VERSION/FEATURE_CHECK
    except pycriu.CRIUExceptionInternal as exc:
        raise CriuError(
            f"CRIU at {binary()} does not answer RPC: {exc}",
            "install CRIU >= 4.0 with scripts/install-criu.sh",
        ) from exc


def preload() -> None:
    """Import what a dump or restore needs on its first call (a handoff started ahead does it then)."""
    _pycriu()


# The GitID that scripts/install-criu.sh gives its build: this prefix, then the checksum of the
# patches it applies (scripts/criu-patches/: post-copy's page pull with several requests in flight)
OUR_BUILD = "criuctl-"


def _version() -> Any:
    resp = _request("VERSION")
    if not resp.success or not resp.HasField("version"):
        raise CriuError(
            f"CRIU at {binary()} is too old to report its version",
            "install CRIU >= 4.0 with scripts/install-criu.sh",
        )
    return resp.version


def version() -> tuple[int, int, int]:
    """(major, minor, sublevel) of the criu binary, asked over RPC."""
    v = _version()
    return v.major_number, v.minor_number, v.sublevel if v.HasField("sublevel") else 0


def build() -> str:
    """The binary's GitID ("" for a release tarball built as is): `OUR_BUILD`… for criuctl's."""
    v = _version()
    return str(v.gitid) if v.HasField("gitid") else ""


def require_version() -> tuple[int, int, int]:
    v = version()
    if v[:2] < MIN_VERSION:
        raise CriuError(
            f"CRIU {'.'.join(map(str, v))} at {binary()} is too old (criuctl needs >= 4.0)",
            "install CRIU >= 4.0 with scripts/install-criu.sh",
        )
    return v


def check() -> None:
    """`criu check`: raises CriuError when the kernel lacks what CRIU needs.

    Runs the binary (its exit status is the verdict): over RPC, CHECK fails in swrk mode here
    although the kernel is fine, and it cannot say why (it has no log to write).
    """
    r = subprocess.run([binary(), "check"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        last = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["no output"]
        raise CriuError(f"`criu check` failed: {last[0]}", "run `criu check --all` for the missing feature")


@dataclass(frozen=True)
class Features:
    lazy_pages: bool  # userfaultfd: post-copy migration


def features() -> Features:
    rpc = _pycriu().rpc
    asked = rpc.criu_features(lazy_pages=True)
    resp = _request("FEATURE_CHECK", features=asked)
    f = resp.features
    return Features(lazy_pages=f.lazy_pages and not faults.injected(faults.Fault.NO_USERFAULTFD))


def ensure_lazy_pages() -> None:
    """Post-copy needs userfaultfd, and pipes above the default maximum: check, raise the sysctl.

    CRIU's page server sizes its pipes with F_SETPIPE_SZ above fs.pipe-max-size (1 MiB by default);
    without CAP_SYS_RESOURCE that fails and CRIU ignores the failure, then the transfer breaks.
    """
    if not features().lazy_pages:
        raise CriuError("this kernel has no userfaultfd for CRIU's lazy pages", "use --mode stop-and-copy")
    path = Path("/proc/sys/fs/pipe-max-size")
    if int(path.read_text()) >= POSTCOPY_PIPE_SIZE:
        return
    try:
        path.write_text(str(POSTCOPY_PIPE_SIZE))
    except OSError as exc:
        raise CriuError(
            f"fs.pipe-max-size is {path.read_text().strip()}, CRIU's page server needs {POSTCOPY_PIPE_SIZE}",
            f"sysctl -w fs.pipe-max-size={POSTCOPY_PIPE_SIZE}, or use --mode stop-and-copy",
        ) from exc
