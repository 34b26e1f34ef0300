"""NCCL communicators in a GPU job: refused before the driver's checkpoint, in one line that says why
and how to run the job instead.

A communicator holds device memory (its buffers, NVLS multicast objects, CUDA IPC mappings of its
peers' memory) and network connections to its peers. The CUDA driver's checkpoint does not cover
the connections, refuses CUDA IPC before r610, and was seen to hang on multicast objects; NVIDIA
said in 2025 that NCCL jobs are not supported by it. NCCL 2.29.7 added `ncclCommSuspend(comm,
NCCL_SUSPEND_MEM)` / `ncclCommResume(comm)`, which release and bring back a communicator's dynamic
device memory (not NVLS buffers, not connections); criuctl's hook does not call them yet. So a job
whose trainers report NCCL process groups at the step boundary is refused, with what to do:
`criuctl dump --state` (the hook's copy of the training state, which a restarted job loads), or
CRIUCTL_NCCL_TRY=1 to let the driver try (its refusal rolls back), with the NCCL settings that keep
what it cannot checkpoint out of the job.
"""

from __future__ import annotations

from collections.abc import Iterable

from criuctl.core import env
from criuctl.core.errors import CriuctlError

SUSPEND_SINCE = (2, 29, 7)  # ncclCommSuspend / ncclCommResume (NVIDIA/nccl src/nccl.h.in)
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


def refusal(reports: Iterable[dict]) -> NcclRefused | None:
    """The one-line refusal for the first trainer that reports an NCCL process group; None if none
    does, or if CRIUCTL_NCCL_TRY lets the driver try.

    `reports`: the trainers' step-boundary reports (hooks/criuctl_hook/boundary.py), each with its
    "groups": [{"backend", "size", "nccl" (version)}] and "nccl_env" (the job's NCCL_* settings).
    """
    for report in reports:
        groups = [g for g in report.get("groups") or [] if isinstance(g, dict) and g.get("backend") == "nccl"]
        if not groups:
            continue
        if env.NCCL_TRY.get():
            return None
        version = str(groups[0].get("nccl") or "unknown")
        parsed = _version(version)
        why = (
            f"NCCL {version} cannot suspend a communicator (ncclCommSuspend came in 2.29.7)"
            if parsed is not None and parsed < SUSPEND_SINCE
            else "criuctl does not suspend NCCL communicators yet (ncclCommSuspend)"
        )
        settings = report.get("nccl_env") if isinstance(report.get("nccl_env"), dict) else {}
        unset = [f"{k}={v}" for k, (v, _what) in TURN_OFF.items() if settings.get(k) != v]
        kept_out = ", ".join(what for k, (v, what) in TURN_OFF.items() if settings.get(k) != v)
        try_it = f"set {env.NCCL_TRY}=1 where criuctl runs to let the driver try (a refusal rolls back)"
        if unset:
            try_it += f", and run the job with {' '.join(unset)} (the driver cannot checkpoint {kept_out})"
        return NcclRefused(
            f"rank {report.get('rank', '?')} (PID {report.get('pid', '?')}) holds "
            f"{len(groups)} NCCL process group(s) (NCCL {version}), which the CUDA driver cannot "
            f"checkpoint: {why}",
            f"move it with `criuctl dump --state` (the hook saves the training state), or {try_it}; "
            "nothing was frozen, the job keeps running",
        )
    return None
