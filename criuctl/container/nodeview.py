"""The node's view of a container's mounts, and how this process reaches what only the node sees.

A container's volumes are bind mounts of folders the *node* named: the kubelet resolves a hostPath
or a PersistentVolume's path in its own mount namespace and hands it to the runtime, whose shim runs
runc there. The agent runs in a mount namespace of its own (the DaemonSet's container), which holds
only the host folders its manifest mounts: a hostPath under /var/tmp has no path in it. So the
question "where is this mount on the node" is asked of the runtime's mount namespace, found as the
process that answers on the runtime's socket (SO_PEERCRED). On an ordinary node that is the host's
own namespace (PID 1's); where the runtime runs in a namespace of its own (the local cluster's nodes,
a snap's containerd) it is that one, which is the one its containers' mounts were made in. Without a
runtime socket (procfs containers), PID 1's namespace stands for the node's.

Two ways to reach a node path from here:

    reach(m)      a path to read and write the mount's files: ours when our namespace shows the same
                  folder, else /proc/RUNTIME/root/PATH (a path walk through the node's mounts)
    attach(m)     a mount point in *our* namespace, which CRIU can bind from (the kernel refuses a
                  bind from another namespace's mount, even through /proc/PID/root): ours when our
                  namespace shows it, else a clone of the node's mount (open_tree in the node's
                  namespace, move_mount into ours) under a temporary folder; `release` unmounts it
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass, field

from criuctl.container import mounts
from criuctl.core.errors import CriuctlError

# the generic syscall numbers (the same on every architecture since Linux 5.2)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100
_CLONE_NEWNS = 0x20000
_MNT_DETACH = 2


class NodeViewError(CriuctlError):
    """The node's mount of a container volume cannot be reached from this process."""

    exit_code = 65


def runtime_pid(endpoint: str | None) -> int:
    """The process that serves the runtime's socket `endpoint` (unix://PATH), in our PID namespace;
    PID 1 where there is no socket to ask (procfs containers, a runtime that is down)."""
    path = (endpoint or "").removeprefix("unix://")
    if not path.startswith("/"):
        return 1
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 1
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else 1


def _mnt_ns(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


@dataclass
class NodeView:
    """The node's mount table (as the process `pid`, its runtime, sees it) beside ours."""

    pid: int
    table: list[mounts.Mount]
    own: list[mounts.Mount]
    same: bool  # our mount namespace is the node's
    # (mount point, its temporary folder) of each mount `attach` made; `detach` undoes them
    attached: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of_runtime(cls, endpoint: str | None) -> NodeView:
        from criuctl.container import runtime

        endpoint = endpoint if endpoint and endpoint.startswith(("unix://", "/")) else runtime.endpoint()
        return cls.of_pid(runtime_pid(endpoint))

    @classmethod
    def of_pid(cls, pid: int) -> NodeView:
        own = mounts.of("self")
        try:
            same = _mnt_ns(pid) == _mnt_ns("self")
            table = own if same else mounts.of(pid)
        except OSError as exc:
            raise NodeViewError(
                f"cannot read the mount table of the node's runtime (PID {pid}): {exc.strerror}",
                "criuctl's agent needs the host's PID namespace and privileges (manifests/daemonset.yaml)",
            ) from exc
        return cls(pid, table, own, same)

    def path(self, m: mounts.Mount) -> str | None:
        """Where the node sees what is mounted at `m`; None when it does not (a container's own tmpfs)."""
        return mounts.host_path(m, self.table)

    def paths(self, m: mounts.Mount) -> list[str]:
        """Every node path of `m` (criuctl.container.mounts.host_paths)."""
        return mounts.host_paths(m, self.table)

    def is_external(self, m: mounts.Mount) -> bool:
        return mounts.is_external(m, self.table)

    def externals(self, container: list[mounts.Mount]) -> list[str]:
        return mounts.externals(container, self.table)

    def reach(self, m: mounts.Mount) -> str | None:
        """A path through which this process reads and writes the files mounted at `m`."""
        if (ours := mounts.host_path(m, self.own)) is not None:
            return ours
        node = self.path(m)
        return None if node is None else f"/proc/{self.pid}/root{node}"

    def attach(self, m: mounts.Mount) -> str | None:
        """A mount point in our namespace showing `m`'s folder (see the module docstring)."""
        if (ours := mounts.host_path(m, self.own)) is not None:
            return ours
        node = self.path(m)
        if node is None:
            return None
        home = tempfile.mkdtemp(prefix="criuctl-node-mount-")
        point = home
        try:
            # a file's mount (a hostPath File, a device node, a socket) goes onto a file: the
            # kernel refuses to put it on a folder (EINVAL)
            if not os.path.isdir(f"/proc/{self.pid}/root{node}"):
                point = os.path.join(home, "file")
                os.close(os.open(point, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            _clone_mount(self.pid, node, point)
        except OSError as exc:
            shutil.rmtree(home, ignore_errors=True)
            raise NodeViewError(
                f"cannot attach the node's {node} here: {exc.strerror or exc}",
                "criuctl's agent needs CAP_SYS_ADMIN and the host's PID namespace (manifests/daemonset.yaml)",
            ) from exc
        self.attached.append((point, home))
        return point

    def detach(self) -> None:
        """Unmount what `attach` mounted (a restored tree keeps its own copies of those mounts)."""
        while self.attached:
            point, home = self.attached.pop()
            _umount(point)
            shutil.rmtree(home, ignore_errors=True)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _clone_mount(ns_pid: int, source: str, target: str) -> None:
    """Clone the mount at `source` in process `ns_pid`'s mount namespace onto `target` in ours.

    setns() into another mount namespace is refused to a process with threads, so a forked child
    does it: enter theirs, open_tree(OPEN_TREE_CLONE) (a detached copy, which belongs to no
    namespace), come back, move_mount it onto `target`. The mount stays when the child exits."""
    libc = _libc()
    ours = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    theirs = os.open(f"/proc/{ns_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            err = 0
            try:
                _check(libc.setns(theirs, _CLONE_NEWNS))
                tree = _check(
                    libc.syscall(
                        _SYS_OPEN_TREE, _AT_FDCWD, source.encode(), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC
                    )
                )
                _check(libc.setns(ours, _CLONE_NEWNS))
                _check(
                    libc.syscall(
                        _SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
                    )
                )
            except OSError as exc:
                err = exc.errno or 1
            except BaseException:
                err = 1
            finally:
                os.write(write, struct.pack("i", err))
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            data = f.read(4)
        os.waitpid(child, 0)
        err = struct.unpack("i", data)[0] if len(data) == 4 else 1
        if err:
            raise OSError(err, os.strerror(err))
    finally:
        os.close(ours)
        os.close(theirs)


def _umount(path: str) -> None:
    with contextlib.suppress(OSError):
        _check(_libc().umount2(path.encode(), _MNT_DETACH))
