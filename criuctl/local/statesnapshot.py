"""The CUDA-aware pre-dump: a job's training state, not its processes, for where CRIU cannot go.

When the driver has no checkpoint API (or CRIU is not allowed), criuctl asks the in-process hook
to save at its next step boundary: every model, optimizer, LR scheduler and GradScaler it finds,
the RNG states and the step count, written by torch into the bundle's `state/` directory (or,
for a script that uses the `migrator` API, that API's own registered objects and position). The
bundle is sealed and signed like any other; it holds no CRIU images. Restoring it starts the
job's command again, in its directory and with its environment, with the hook in resume mode
(`criuctl_hook.resume`, `criuctl.migration`). docs/gpu.md says what is exact in this mode.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

from criuctl.core import procinfo, statedir, workloads
from criuctl.core.env import BOUNDARY_TIMEOUT
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle
from criuctl.local import checkpoint, locks, stepboundary, supervisor
from criuctl_hook import contract

STATE_DIR = "state"
_NOT_CARRIED = (
    contract.ENV_WORKLOAD,
    contract.ENV_CONTROL_DIR,
    contract.ENV_HOOKED_PID,
    contract.ENV_RESUME_STATE,
    contract.ENV_HOOKS_DIR,
)


def _job_process(root_pid: int) -> psutil.Process:
    """The user's command: the namespace init's first child (the init is criuctl's)."""
    init = psutil.Process(root_pid)
    children = init.children()
    return children[0] if children else init


def _environment(p: psutil.Process) -> tuple[dict[str, str], str]:
    env = {k: v for k, v in p.environ().items() if k not in _NOT_CARRIED}
    hooks = str(contract.HOOKS_DIR)
    path = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e != hooks]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    return env, p.cwd()


def freeze_state(
    target: str, parent: Path, progress: checkpoint.Progress = lambda _phase: None
) -> checkpoint.Frozen:
    """Have every trainer of `target` save its state at a step boundary and hold; seal the bundle.

    Returns a `checkpoint.Frozen` (the trainers are held, not frozen by CRIU): `commit` ends the
    job, `thaw` lets it train on. Nothing is left behind if any trainer cannot save.
    """
    started = time.monotonic()
    w = workloads.resolve(target)
    if not w.control:
        raise CriuctlError(
            f"workload {w.name!r} was not started with criuctl's hook, so its state cannot be saved",
            "a state dump needs a job started by `criuctl run`; `criuctl dump` without --state works",
        )
    if w.container:
        raise CriuctlError(
            f"workload {w.name!r} is a container: its trainers cannot write their state into this "
            "node's state directory, so the state pre-dump does not work for it yet",
            "`criuctl dump` without --state (CRIU, with the step boundary) works for a container",
        )
    key = bundle.load_key(statedir.key_path())
    lock = locks.lock_workload(w.name, "criuctl dump --state")
    staging = Path(tempfile.mkdtemp(prefix=f".{w.name}.partial-", dir=parent))
    frozen = checkpoint.Frozen(w, staging, None, 0.0, lock=lock)  # type: ignore[arg-type]
    try:
        (staging / STATE_DIR).mkdir(mode=0o700)
        processes = procinfo.describe(w.root_pid)
        env, cwd = _environment(_job_process(w.root_pid))
        progress("step boundary")
        reached = frozen.boundary = stepboundary.reach(w, contract.SAVE, staging / STATE_DIR)
        if not reached.complete or len(reached.saved) != reached.trainers:
            raise CriuctlError(
                f"workload {w.name!r}: its state could not be saved at a step boundary "
                f"({reached.why or 'a trainer did not save'})",
                "nothing was saved and the job keeps running; check that it is training, or use "
                f"`criuctl dump` (CRIU) without --state; a longer wait: {BOUNDARY_TIMEOUT}=SECONDS",
            )
        progress("sealing")
        manifest = bundle.Manifest(
            workload=w.name,
            command=w.command,
            processes=processes,
            open_files=procinfo.open_files([p.pid for p in processes]),
            uses_gpu=procinfo.uses_gpu([p.pid for p in processes]),
            criu_version="",
            control_dir=w.control,
            boundary=reached.facts(),
            state=bundle.StateFacts(
                {rank: f"{STATE_DIR}/{name}" for rank, name in reached.saved.items()},
                reached.state_bytes,
                reached.step,
                env,
                cwd,
            ),
        )
        manifest.freeze_seconds = round(time.monotonic() - started, 3)
        frozen.manifest = bundle.seal(staging, manifest, key)
        frozen.freeze_seconds = manifest.freeze_seconds
    except BaseException:
        frozen.thaw()
        raise
    return frozen


def restart(bundle_dir: Path, manifest: bundle.Manifest, name: str | None) -> int:
    """Start a state bundle's job again, in resume mode, and supervise it in the foreground."""
    facts = manifest.state
    assert facts is not None
    name = workloads.unique_name(name or manifest.workload)
    cwd = facts.cwd if os.path.isdir(facts.cwd) else None
    if cwd is None:
        raise CriuctlError(
            f"the job ran in {facts.cwd}, which does not exist on this node",
            "create it (with the job's files) or restore on a node that has it; the bundle is untouched",
        )
    w, stdio = supervisor.start(
        manifest.command, name, env=facts.env, cwd=cwd, resume_state=bundle_dir / STATE_DIR
    )
    w.restored_from = str(bundle_dir)
    workloads.save(w)
    supervisor.forward_signals(w.root_pid)
    print(
        f"criuctl: started {w.name!r} again from the state saved at step {facts.step} in {bundle_dir} "
        f"(PID {w.root_pid})",
        file=sys.stderr,
        flush=True,
    )
    return supervisor.supervise(w, stdio)
