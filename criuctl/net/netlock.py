"""CRIU's nftables network lock: find it, and lift it for a tree that is thawed instead of restored.

With `tcp_established` and `network_lock=nftables`, a dump of a tree that shares the host's network
namespace creates the table `inet CRIU-<run id>` (CRIU's run id is a UUID, cut to fit its 32-byte
buffer: `CRIU-519ac3fa-2f08-4200-88`) and puts every TCP connection of the tree, both directions, in
its `conns4`/`conns6` sets, whose rules drop them. CRIU deletes the table itself when the dump fails
and at the end of a restore (which reads the run id from the images' inventory), but a *successful*
dump leaves it in place: a tree thawed instead (leave-running, an aborted migration) gets EPERM on
its next send or receive, and a dump never restored leaves the table for ever.

Talks to the kernel through libnftables (ctypes; the library CRIU itself links against), so no `nft`
binary is needed. Acts in the network namespace of the calling process. Below `checkpoint`; imports
only `errors`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from functools import cache
from pathlib import Path

from criuctl.core import faults
from criuctl.core.errors import CriuctlError
from criuctl.net.readdress import canonical as _addr

PREFIX = "CRIU-"
FAMILY = "inet"
# CRIU formats "inet CRIU-<uuid>" into `char table[32]`: the name keeps 31 - len("inet ") characters.
_NAME_LEN = 31 - len(f"{FAMILY} ")
_TABLE = re.compile(rf"^table {FAMILY} ({re.escape(PREFIX)}\S+)$", re.M)
_ELEMENT = re.compile(r"([0-9a-fA-F.:]+) \. (\d+) \. ([0-9a-fA-F.:]+) \. (\d+)")
_ENOENT = "No such file or directory"

Connection = tuple[str, int, str, int]  # (source address, port, destination address, port)


class NetlockError(CriuctlError):
    """libnftables is missing or refused a command."""


class Nft:
    """One libnftables context with buffered output and errors."""

    def __init__(self) -> None:
        lib = _lib()
        self.lib = lib
        self.ctx = lib.nft_ctx_new(0)
        if not self.ctx:
            raise NetlockError("libnftables could not create a context", "check that nf_tables is available")
        lib.nft_ctx_buffer_output(self.ctx)
        lib.nft_ctx_buffer_error(self.ctx)

    def run(self, command: str) -> tuple[bool, str, str]:
        """(ok, output, error) of one nft command."""
        rc = self.lib.nft_run_cmd_from_buffer(self.ctx, command.encode())
        out = (self.lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode(errors="replace")
        err = (self.lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode(errors="replace")
        return rc == 0, out, err

    def close(self) -> None:
        self.lib.nft_ctx_free(self.ctx)

    def __enter__(self) -> Nft:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise NetlockError(
            f"cannot load libnftables ({exc})",
            "install the libnftables1 package (CRIU's nftables network lock needs it too)",
        ) from exc
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


def table_name(run_id: str) -> str:
    """The table CRIU's run `run_id` locks the network with (cut exactly as CRIU cuts it)."""
    return (PREFIX + run_id)[:_NAME_LEN]


def table_for_images(images_dir: Path) -> str | None:
    """The lock table of the dump that wrote `images_dir` (from its inventory); None if unreadable."""
    try:
        import pycriu

        with (images_dir / "inventory.img").open("rb") as f:
            entry = pycriu.images.load(f)["entries"][0]
    except Exception:  # no pycriu, no file, a foreign or torn image: the name is not known
        return None
    run_id = entry.get("dump_criu_run_id")
    return table_name(run_id) if run_id else None


def tables() -> list[str]:
    """The names of CRIU's lock tables in this network namespace."""
    with Nft() as nft:
        ok, out, err = nft.run(f"list tables {FAMILY}")
    if not ok:
        raise NetlockError(f"cannot list nftables tables: {err.strip()}", "run criuctl as root")
    return _TABLE.findall(out)


def connections(table: str) -> set[Connection]:
    """The connections `table` drops (both directions of each); empty if the table is gone."""
    with Nft() as nft:
        ok, out, _ = nft.run(f"list table {FAMILY} {table}")
    if not ok:
        return set()
    return {(_addr(a), int(p), _addr(b), int(q)) for a, p, b, q in _ELEMENT.findall(out)}


def lift(table: str) -> bool:
    """Delete lock table `table`; True if it was there. Idempotent: a missing table is fine."""
    if not table.startswith(PREFIX):
        raise ValueError(f"{table!r} is not a CRIU lock table")
    if faults.injected(faults.Fault.NETLOCK_LIFT):  # the table stays, as when the kernel refuses
        ok, err = False, "Operation not permitted (a fault injected by a test)"
    else:
        with Nft() as nft:
            ok, _, err = nft.run(f"delete table {FAMILY} {table}")
    if ok:
        return True
    if _ENOENT in err:
        return False
    raise NetlockError(
        f"cannot delete nftables table {FAMILY} {table}: {err.strip()}",
        f"delete it by hand (`nft delete table {FAMILY} {table}`), or its TCP connections stay blocked",
    )


def tables_holding(conns: set[Connection]) -> list[str]:
    """CRIU lock tables that block any of `conns` (for a tree whose table name is not known)."""
    if not conns:
        return []
    wanted = {(_addr(a), p, _addr(b), q) for a, p, b, q in conns}
    return [t for t in tables() if connections(t) & wanted]
