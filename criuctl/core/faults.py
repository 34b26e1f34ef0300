"""Failures a test switches on where the real one cannot be caused on demand, and off again.

Some failures are real but cannot be provoked at will on a healthy machine — the kernel refusing to
delete CRIU's nftables lock table, say — yet what criuctl does when they happen (the tree must run,
the record must not say success, the agent must retry) is exactly what a test must see. A mechanism
checks `injected(NAME)` right where that failure would surface and raises its real error. With
`CRIUCTL_FAULT_DIR=D` in a process's environment, the fault NAME is on while the file `D/NAME`
exists: a test creates it, watches criuctl cope, removes it, and watches criuctl recover — in
every process that inherited the variable (an agent and its handoffs) at once. Unset, a check is
one environment lookup. Standard library only.
"""

from __future__ import annotations

import enum

from criuctl.core import env


class Fault(enum.StrEnum):
    NETLOCK_LIFT = "netlock.lift"  # deleting CRIU's network-lock table fails
    RESTORE = "restore"  # CRIU fails to restore a bundle (a target node that cannot run the job)
    NO_USERFAULTFD = "userfaultfd"  # the kernel refuses userfaultfd (no post-copy on this node)


def injected(fault: Fault) -> bool:
    folder = env.FAULT_DIR.get()
    return folder is not None and (folder / str(fault)).exists()
