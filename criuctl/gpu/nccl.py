"""NCCL communicators in a GPU job: checkpointed once the hook suspended them, else refused before the
driver's lock, in one line that says why and how to run the job instead.

A communicator holds device memory (its buffers, NVLS multicast objects, CUDA IPC mappings of its
peers' memory) and network connections to its peers. The CUDA driver's checkpoint refuses CUDA IPC
before r610 and was seen to hang on multicast objects; NVIDIA said in 2025 that NCCL jobs are not
supported by it. NCCL 2.29.7 added `ncclCommSuspend(comm, NCCL_SUSPEND_MEM)` / `ncclCommResume(comm)`,
which release and bring back a communicator's dynamic device memory (not NVLS multicast, not its
connections): the hook calls them at the step boundary (hooks/criuctl_hook/nccl.py) and reports
what it suspended. A trainer whose every NCCL communicator was suspended goes to the driver: in a
world of one rank there is nothing else; with peers, only with the settings that keep what the
suspension leaves (NVLS, CUDA IPC, shared-memory buffers) out of the job. Anything else is refused,
with what to do: `criuctl dump --state` (the hook's copy of the training state, which a restarted
job loads), or CRIUCTL_NCCL_TRY=1 to let the driver try (its refusal rolls back).
"""

from __future__ import annotations

from collections.abc import Iterable

from criuctl.core import env
from criuctl.core.errors import CriuctlError
from criuctl_hook import contract

SUSPEND_SINCE = contract.NCCL_SUSPEND_SINCE
# what the driver cannot checkpoint, and the NCCL setting that keeps it out of a job
TURN_OFF = {
    "NCCL_NVLS_ENABLE": ("0", "NVLS multicast buffers"),
    "NCCL_P2P_DISABLE": ("1", "peer-to-peer CUDA IPC mappings (r610+ only)"),
    "NCCL_SHM_DISABLE": ("1", "shared-memory transport buffers"),
}


class NcclRefused(CriuctlError):
    """The job holds NCCL communicators that criuctl cannot checkpoint."""


def _version(text: object) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in str(text).split("."))
    except ValueError:
        return None


def _why_not_suspended(report: dict, version: str) -> str | None:
    """Why the hook did not suspend every NCCL communicator of this trainer; None if it did."""
    done = report.get("nccl_suspend")
    parsed = _version(version)
    if parsed is not None and parsed < SUSPEND_SINCE:
        return f"NCCL {version} cannot suspend a communicator (ncclCommSuspend came in 2.29.7)"
    if not isinstance(done, dict):
        return "the job's hook did not suspend its communicators (a hook older than criuctl's?)"
    if done.get("error"):
        return f"suspending them failed: {str(done['error'])[:200]}"
    if int(done.get("suspended", 0)) + int(done.get("skipped", 0)) < int(done.get("groups", 0)):
        return f"only {done.get('suspended')} of {done.get('groups')} were suspended"
    return None


def refusal(reports: Iterable[dict]) -> NcclRefused | None:
    """The one-line refusal for the first trainer whose NCCL communicators the driver should not
    checkpoint; None if there is none, or if CRIUCTL_NCCL_TRY lets the driver try.

    `reports`: the trainers' step-boundary reports (hooks/criuctl_hook/boundary.py), each with its
    "groups": [{"backend", "size", "nccl" (version)}], "nccl_env" (the job's NCCL_* settings) and
    "nccl_suspend" (hooks/criuctl_hook/nccl.py: what the hook suspended).
    """
    for report in reports:
        groups = [g for g in report.get("groups") or [] if isinstance(g, dict) and g.get("backend") == "nccl"]
        if not groups or env.NCCL_TRY.get():
            continue
        version = str(groups[0].get("nccl") or "unknown")
        settings = report.get("nccl_env") if isinstance(report.get("nccl_env"), dict) else {}
        unset = [f"{k}={v}" for k, (v, _what) in TURN_OFF.items() if settings.get(k) != v]
        kept_out = ", ".join(what for k, (v, what) in TURN_OFF.items() if settings.get(k) != v)
        why = _why_not_suspended(report, version)
        peers = max(int(g.get("size") or 1) for g in groups) > 1
        if why is None and (not peers or not unset):
            continue  # suspended: the driver checkpoints what is left
        who = (
            f"rank {report.get('rank', '?')} (PID {report.get('pid', '?')}) holds "
            f"{len(groups)} NCCL process group(s) (NCCL {version})"
        )
        if why is None:
            return NcclRefused(
                f"{who} with peers; suspending them leaves {kept_out}, "
                "which the CUDA driver cannot checkpoint",
                f"run the job with {' '.join(unset)}, or move it with `criuctl dump --state`; "
                "nothing was frozen, the job keeps running",
            )
        try_it = f"set {env.NCCL_TRY}=1 where criuctl runs to let the driver try (a refusal rolls back)"
        if unset:
            try_it += f", and run the job with {' '.join(unset)} (the driver cannot checkpoint {kept_out})"
        return NcclRefused(
            f"{who}, which the CUDA driver cannot checkpoint: {why}",
            f"move it with `criuctl dump --state` (the hook saves the training state), or {try_it}; "
            "nothing was frozen, the job keeps running",
        )
    return None
