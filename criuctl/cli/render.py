"""How criuctl shows things to a person: rich tables, trees and progress. Data in, text out."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from criuctl.core import statedir, workloads
from criuctl.format import bundle
from criuctl.gpu import gpustate

# Piped output (scripts, tests, `| grep`) is not cut to 80 columns: one row stays one line.
_WIDTH = None if sys.stdout.isatty() else 200
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def short_command(argv: list[str], width: int = 90) -> str:
    """The command as a person reads it: the program's name, then its arguments, cut at `width`."""
    text = " ".join([Path(argv[0]).name, *argv[1:]]) if argv else ""
    return text if len(text) <= width else text[: width - 1] + "…"


def workloads_table(
    rows: list[workloads.WorkloadRow], all_states: bool = False, where: str | None = None
) -> None:
    """Workloads as a table: this node's registry, or the rows a node's agent sent (`where`)."""
    remote = where is not None
    where = where or "this host"
    table, notes = [], []
    for r in rows:
        live = r["state"] == workloads.RUNNING and r["alive"]
        state = "running" if live else (r["state"] if r["state"] != workloads.RUNNING else "lost")
        if live and r.get("thaw_incomplete"):  # it runs, but e.g. its connections are still blocked
            state = "running, thaw incomplete"
            notes.append(f"criuctl: {r['name']}: its thaw did not complete: {r['thaw_incomplete']}")
        if r.get("moved_to") and r["state"] == workloads.MIGRATED:
            state = f"moved to {r['moved_to']}"
        unsupported = r.get("why_not") is not None  # a container criuctl cannot checkpoint
        if unsupported:
            state = "not checkpointable"
        elif not live and not all_states:
            continue
        rss = human_bytes(r["rss_bytes"]) if (live or unsupported) and r.get("rss_bytes") else "-"
        pod = "/".join((r.get("pod") or "").split("/")[:2]) or "-"  # namespace/pod of a container
        row = (r["name"], pod, str(r["root_pid"]), short_command(r.get("command") or []), rss, state)
        table.append(tuple(escape(c) for c in row))  # an agent's rows are data, not rich markup
    if not table:
        if remote:  # not this host's state dir: the agent's is its own
            out.print(f"No workloads on {where}. Start one there with: criuctl run -- CMD")
        else:
            out.print(
                f"No workloads on {where} (state dir {statedir.state_dir()}). "
                "Start one with: criuctl run -- CMD"
            )
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "POD", "PID", "COMMAND", "RSS", "STATE"):
        t.add_column(col, no_wrap=True)
    for cells in table:
        t.add_row(*cells)
    out.print(t)
    for note in notes:
        err.print(escape(note))


@contextlib.contextmanager
def phase_progress() -> Iterator[callable]:
    """A spinner on stderr that names the current phase and its elapsed time."""
    status = err.status("starting")
    status.start()
    t0 = time.monotonic()
    try:
        yield lambda phase: status.update(f"{phase} ({time.monotonic() - t0:.1f} s)")
    finally:
        status.stop()


@contextlib.contextmanager
def migration_progress() -> Iterator[callable]:
    """One line per phase on stderr: a spinner and its time; the transfer with bytes and bytes/s."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bars = Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<9}"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=err,
    )
    tasks: dict[str, int] = {}

    def update(phase: str, done: int | None = None, total: int | None = None) -> None:
        for name, tid in tasks.items():
            if name != phase and not bars.tasks[tid].finished:
                bars.update(tid, completed=1, total=1)
                bars.stop_task(tid)
        if phase not in tasks:
            tasks[phase] = bars.add_task(phase, total=None, info="", t0=time.monotonic())
        if done is not None and total:
            rate = done / max(time.monotonic() - bars.tasks[tasks[phase]].fields["t0"], 1e-6)
            info = f"{human_bytes(done)} / {human_bytes(total)}, {human_bytes(rate)}/s"
            bars.update(tasks[phase], completed=done, total=total, info=info)

    with bars:
        yield update
        update("")  # finish the last phase
        bars.remove_task(tasks.pop(""))


def jobs_table(jobs: list) -> None:
    """One row per rank, grouped by job: where each runs and which ranks it talks to."""
    from rich.table import Table

    if not jobs:
        out.print("No workloads on any node (see `criuctl node ls`). Start ranks with: criuctl run -- CMD")
        return
    t = Table(box=None)
    for col in ("JOB", "RANK", "NODE", "CONNECTED TO"):
        t.add_column(col)
    for job in sorted(jobs, key=lambda j: j.name):
        for r in sorted(job.ranks, key=lambda r: r.shown):
            peers = sorted(
                {
                    link.peer.label if link.peer else f"{link.conn[2]}:{link.conn[3]} (not criuctl's)"
                    for link in job.links
                    if link.rank is r and link.peer is not r
                }
            )
            t.add_row(job.name, r.shown, r.node, ", ".join(peers) or "-")
    out.print(t)


def job_progress() -> callable:
    """One line on stderr each time a rank of a job's move enters a phase (ranks move at once)."""
    import threading

    seen: set[tuple[str, str]] = set()
    lock = threading.Lock()
    t0 = time.monotonic()

    def update(phase: str, rank: str = "", **_facts: object) -> None:
        with lock:
            if (rank, phase) not in seen:
                seen.add((rank, phase))
                err.print(f"{time.monotonic() - t0:6.2f} s  {rank}: {phase}", markup=False)

    return update


def job_summary(r) -> None:
    for m in r.ranks:
        err.print(
            f"  {m.workload}: {m.source} → {m.target}, downtime {m.downtime_seconds:.2f} s, "
            f"{human_bytes(m.bytes_moved)} moved (freeze {m.freeze_seconds:.2f} s, "
            f"transfer {m.transfer_seconds:.2f} s, restore {m.restore_seconds:.2f} s)",
            markup=False,
        )
    err.print(
        f"moved {len(r.ranks)} rank(s) of job {r.job}: downtime {r.downtime_seconds:.2f} s, "
        f"total {r.total_seconds:.2f} s; {r.redirects} connection redirect(s) on nodes of ranks "
        f"that stayed",
        markup=False,
    )


def migration_summary(r) -> None:
    if r.via_successor:  # the move record's stamps: the freeze to running again, and the pull
        pulled = (
            f", its memory pulled from {r.source} in {r.pages_seconds:.2f} s after it ran"
            if r.pages_seconds is not None
            else ""
        )
        err.print(
            f"migrated {r.workload!r} {r.source} → {r.target} {r.mode}: the job stopped "
            f"{r.downtime_seconds:.2f} s (frozen {r.freeze_seconds:.2f} s for the dump), "
            f"{human_bytes(r.bytes_moved)} moved{pulled}, total {r.total_seconds:.2f} s"
        )
        return
    pages = (
        f", all pages pulled {r.pages_seconds:.2f} s after the commit" if r.pages_seconds is not None else ""
    )
    downtime = f"downtime {r.downtime_seconds:.2f} s"
    if getattr(r, "downtime_measured_by", "source") == "client":
        downtime = f"downtime at most {r.downtime_seconds:.2f} s (as the client saw it)"
    err.print(
        f"migrated {r.workload!r} {r.source} → {r.target} ({r.mode}): {downtime}, "
        f"{human_bytes(r.bytes_moved)} moved, total {r.total_seconds:.2f} s "
        f"(freeze {r.freeze_seconds:.2f} s, transfer {r.transfer_seconds:.2f} s, "
        f"restore {r.restore_seconds:.2f} s{pages})"
    )
    err.print(f"follow it with: criuctl logs {r.workload} --node {r.target} -f")
    if not r.source_confirmed:
        err.print(
            f"criuctl: warning: node {r.source} did not confirm that its frozen copy ended; its handoff "
            f"ends it once {r.target} confirms the job runs there (see `criuctl ps --node {r.source}`)",
            markup=False,
        )


def nodes_table(nodes, health: dict[str, str]) -> None:
    if not nodes:
        out.print("No nodes yet. Add one: criuctl node add NAME URL --token-file F")
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "URL", "TLS", "TOKEN FILE", "AGENT"):
        t.add_column(col, no_wrap=True)
    for n in nodes:
        tls = n.transport() if n.tls else f"[bold red]{n.transport()}[/]"
        t.add_row(n.name, n.url, tls, n.token_file, health.get(n.name, "?"))
    out.print(t)


def podmigrations_table(objs: list[dict], wide: bool = False) -> None:
    """The columns of `kubectl get podmigrations` (the CRD's printer columns), and REASON."""
    if not objs:
        out.print("No PodMigrations. Move a pod: criuctl migrate POD NODE")
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAMESPACE", "NAME", "POD", "FROM", "TO", "PHASE", "DOWNTIME", "CREATED", "REASON"):
        t.add_column(col, no_wrap=col != "REASON")
    for o in objs:
        st, meta = o.get("status") or {}, o["metadata"]
        reason = st.get("reason") or ""
        if wide and st.get("hint"):
            reason += f" ({st['hint']})"
        t.add_row(
            meta["namespace"],
            meta["name"],
            o["spec"]["pod"],
            st.get("source") or "",
            st.get("target") or o["spec"]["node"],
            st.get("phase") or "Pending",
            st.get("downtime") or "",
            meta.get("creationTimestamp") or "",
            reason,
        )
    out.print(t)


def podmigration_line(o: dict) -> str:
    """One PodMigration as `get -w` prints each change of it: where it is, and how far."""
    st, meta = o.get("status") or {}, o["metadata"]
    where = f"{st.get('source') or '?'} → {st.get('target') or o['spec']['node']}"
    how = f"downtime {st['downtime']}" if st.get("downtime") else st.get("progress") or ""
    phase, reason = st.get("phase") or "Pending", st.get("reason") or ""
    cells = [f"{meta['namespace']}/{meta['name']}", o["spec"]["pod"], where, phase, how, reason]
    return "  ".join(c for c in cells if c)


def _phases(phases: dict[str, float]) -> str:
    """ " (criu_dump 4.10 s, seal 0.31 s)": where a freeze's time went, for benchmarks and users alike."""
    return f" ({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())})" if phases else ""


def dump_summary(o, leave_running: bool, as_json: bool = False) -> None:
    """The dump's one line on stderr; with `as_json` also its result on stdout, for scripts."""
    if as_json:
        result = {
            "workload": o.manifest.workload,
            "bundle": str(o.bundle),
            "size_bytes": o.size_bytes,
            "freeze_seconds": o.freeze_seconds,
            "total_seconds": o.total_seconds,
            "phases": o.phases,
            "leave_running": leave_running,
        }
        print(json.dumps(result, sort_keys=True))
    after = "still running" if leave_running else "stopped"
    err.print(
        f"checkpointed {o.manifest.workload!r} to {o.bundle}: {human_bytes(o.size_bytes)}, "
        f"frozen {o.freeze_seconds:.2f} s{_phases(o.phases)}, total {o.total_seconds:.2f} s; workload {after}"
    )
    if hint := _stranded_cache(o.manifest):
        err.print(escape(hint))


def _stranded_cache(m: bundle.Manifest) -> str:
    """A hint when the GPU checkpoint carried much of torch's cache that the job was not using."""
    idle = gpustate.stranded_cache(m)
    if not idle:
        return ""
    return (
        f"note: {human_bytes(idle)} of the device memory the checkpoint carried was torch's cache, free "
        "but in segments that also hold live tensors, which empty_cache() cannot return; run the job "
        f"with {gpustate.CACHE_FIX} and the checkpoint leaves it behind"
    )


def _checks(root: Path) -> tuple[bool | None, list[str]]:
    try:
        key = bundle.load_key(statedir.key_path(), create=False)
    except bundle.BundleError:
        return None, []
    v = bundle.check(root, key)
    return v.signature_ok, v.bad_files


def _when(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, ValueError, OSError):
        return f"at {t!r} (not a time)"


def inspect(root: Path, as_json: bool) -> int:
    """Describe the bundle at `root`; its manifest is unverified data, shown escaped, never markup."""
    m = bundle.read_manifest(root)
    sig_ok, bad = _checks(root)
    if as_json:
        data = asdict(m)
        data["rss_bytes"] = m.rss_bytes
        data["checks"] = {"signature": sig_ok, "bad_files": bad, "ok": bool(sig_ok) and not bad}
        out.print_json(json.dumps(data))
        return 0 if sig_ok and not bad else 1
    created = _when(m.created)
    out.print(f"[bold]{escape(str(root))}[/]  bundle {escape(m.id[:12])}, format {m.format_version}")
    out.print(escape(f"workload {m.workload!r}: {' '.join(m.command)}"))
    out.print(
        escape(f"taken {created} on {m.host} (kernel {m.kernel}, CRIU {m.criu_version}), ")
        + f"frozen {m.freeze_seconds:.2f} s"
    )
    out.print(
        f"memory: {human_bytes(m.rss_bytes)} RSS in {len(m.processes)} processes; "
        f"bundle {human_bytes(bundle.size_bytes(root))}; GPU: {'yes' if m.uses_gpu else 'no'}"
    )
    out.print(escape(_boundary_line(m)))
    if m.gpu is not None:
        names = ", ".join(sorted({d.name for d in m.gpu.devices})) or "unknown"
        out.print(
            escape(
                f"GPU state: {len(m.gpu.pids)} processes checkpointed by driver {m.gpu.driver} in "
                f"{m.gpu.checkpoint_s:.2f} s ({human_bytes(m.gpu.device_bytes)} moved to host memory); "
                f"node had {len(m.gpu.devices)} × {names}"
            )
        )
        if hint := _stranded_cache(m):
            out.print(escape(hint))
    by_pid = {p.pid: p for p in m.processes}
    nodes: dict[int, Tree] = {}
    tree = Tree("processes")
    for p in m.processes:
        label = escape(
            f"{p.ns_pid} {' '.join(p.cmdline)[:70]}  ({human_bytes(p.rss_bytes)}, {p.threads} threads)"
        )
        parent = nodes.get(p.ppid) if p.ppid in by_pid else tree
        nodes[p.pid] = (parent or tree).add(label)
    out.print(tree)
    files = [f for f in m.open_files if f.startswith("/")]
    out.print(f"open files ({len(files)} paths, {len(m.open_files) - len(files)} pipes/sockets/anon):")
    for f in files[:20]:
        out.print(f"  {escape(f)}")
    if len(files) > 20:
        out.print(f"  … {len(files) - 20} more (--output json lists all)")
    if sig_ok is None:
        out.print("checks: [yellow]no signing key on this host; signature not checked[/]")
    else:
        out.print(
            f"checks: signature {'[green]ok[/]' if sig_ok else '[red]BAD[/]'}, "
            f"{len(m.files)} files " + ("[green]ok[/]" if not bad else f"[red]{len(bad)} bad[/]")
        )
        for b in bad:
            out.print(f"  [red]{b}[/]")
    return 0 if sig_ok is not False and not bad else 1


def _boundary_line(m: bundle.Manifest) -> str:
    """Whether the checkpoint cut a training step in half, in one line."""
    if m.state is not None:
        return f"state bundle (CUDA-aware pre-dump): taken at a step boundary, step {m.state.step}"
    b = m.boundary
    if b is None:
        return "step boundary: not asked (the job was not started by `criuctl run` or criuctl's init)"
    if b.trainers == 0:
        return f"step boundary: none ({b.why})"
    if b.held == b.trainers:
        nccl = f", {b.nccl_suspended} NCCL communicator(s) suspended" if b.nccl_suspended else ""
        return (
            f"step boundary: yes, after optimizer step {b.step} ({b.trainers} trainer(s) held{nccl}; "
            f"waited {b.waited_s:.2f} s); no step was cut in half"
        )
    return f"step boundary: {b.held} of {b.trainers} trainers ({b.why}); CRIU's image is exact regardless"


def doctor(checks) -> None:
    for c in checks:
        mark = "[green]ok  [/]" if c.ok else ("[red]FAIL[/]" if c.required else "[yellow]warn[/]")
        line = f"{mark} {c.name}: {c.detail}"
        if not c.ok and c.fix:
            line += f" → {c.fix}"
        out.print(line)


def inspect_archive(path: Path, as_json: bool) -> int:
    """`criuctl inspect ARCHIVE`: import into the state dir, describe the bundle, remove it."""
    from criuctl.container.runtime import archive  # its readers load pycriu: only for archives

    statedir.ensure_state_dir()  # one line, not a traceback, where it cannot be written
    key = bundle.load_key(statedir.key_path())
    started = time.monotonic()
    with archive.imported(path, key, statedir.IMPORTS.path()) as (root, manifest):
        c = manifest.container
        assert c is not None
        if not as_json:
            pod = f"pod {c.pod_namespace}/{c.pod_name}, " if c.pod_name else ""
            out.print(
                escape(
                    f"{path}: kubelet/CRI checkpoint archive of container {c.name!r} ({c.id[:12]}), "
                    f"{pod}image {c.image}; imported in {time.monotonic() - started:.2f} s, "
                    f"signed by this node"
                )
            )
            out.print(
                escape(
                    f"external mounts: {', '.join(c.external_mounts) or 'none'}; network: "
                    f"{'the pod’s (external)' if c.netns_external else 'the node’s or none'}; rootfs diff: "
                    f"{'yes' if c.rootfs_diff else 'no'}; deleted files: {len(c.deleted)}; "
                    f"stdio pipes: {', '.join(manifest.stdio_pipes) or 'none'}"
                )
            )
        return inspect(root, as_json=as_json)
