"""`criuctl` command line: parse, call one workflow, render its result. No mechanism lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from criuctl.errors import CriuctlError, require_root


def _cmd_run(a: argparse.Namespace) -> int:
    require_root("run")
    from criuctl import supervisor

    w, stdio = supervisor.start(a.command, a.name, allow_io_uring=a.allow_io_uring)
    print(f"criuctl: started {w.name!r} (PID {w.root_pid})", file=sys.stderr, flush=True)
    return supervisor.supervise(w, stdio)


def _cmd_ps(a: argparse.Namespace) -> int:
    from criuctl import render

    render.workloads_table(all_states=a.all)
    return 0


def _cmd_dump(a: argparse.Namespace) -> int:
    require_root("dump")
    from criuctl import checkpoint, render

    with render.phase_progress() as progress:
        outcome = checkpoint.dump(a.target, Path(a.output), leave_running=a.leave_running, progress=progress)
    render.dump_summary(outcome, a.leave_running)
    return 0


def _cmd_restore(a: argparse.Namespace) -> int:
    require_root("restore")
    from criuctl import checkpoint

    return checkpoint.restore(Path(a.bundle), a.name)


def _cmd_inspect(a: argparse.Namespace) -> int:
    from criuctl import render

    return render.inspect(Path(a.bundle), as_json=a.output == "json")


def _cmd_doctor(a: argparse.Namespace) -> int:
    from criuctl import doctor, render

    checks = doctor.run_checks()
    render.doctor(checks)
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _cmd_demo(a: argparse.Namespace) -> int:
    from criuctl import demo

    require_root("demo")
    return demo.main(Path(a.out), steps=a.steps, freeze_at=a.freeze_at)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="criuctl",
        description="Freeze a running training job with CRIU "
        "and restore it, bit-identical, here or on another node.",
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    s = sub.add_parser("run", help="start a command as a checkpointable workload")
    s.add_argument("--name", help="workload name (default: the command's name)")
    s.add_argument(
        "--allow-io-uring",
        action="store_true",
        help="do not block io_uring (CRIU cannot checkpoint a process that uses it)",
    )
    s.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser("ps", help="list the workloads on this host")
    s.add_argument("-a", "--all", action="store_true", help="also show exited and checkpointed ones")
    s.set_defaults(func=_cmd_ps)

    s = sub.add_parser("dump", help="checkpoint a workload into a bundle directory")
    s.add_argument("target", metavar="NAME|PID")
    s.add_argument("-o", "--output", required=True, metavar="DIR", help="new bundle directory")
    s.add_argument("--leave-running", action="store_true", help="snapshot only: the workload keeps running")
    s.set_defaults(func=_cmd_dump)

    s = sub.add_parser("restore", help="restore a bundle and supervise it in the foreground")
    s.add_argument("bundle", metavar="DIR")
    s.add_argument("--name", help="name of the restored workload (default: the checkpointed one's)")
    s.set_defaults(func=_cmd_restore)

    s = sub.add_parser("inspect", help="describe a bundle: processes, memory, files, checks")
    s.add_argument("bundle", metavar="DIR")
    s.add_argument("--output", choices=["text", "json"], default="text")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("doctor", help="check CRIU and the kernel features criuctl needs")
    s.set_defaults(func=_cmd_doctor)

    s = sub.add_parser("demo", help="train, freeze, restore, and compare against an uninterrupted run")
    s.add_argument("--out", default="criuctl-demo", help="directory for the bundle and plot")
    s.add_argument("--steps", type=int, default=80)
    s.add_argument("--freeze-at", type=int, default=30, help="freeze once this step has been printed")
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.verb == "run" and a.command and a.command[0] == "--":
        a.command = a.command[1:]
    try:
        return a.func(a)
    except CriuctlError as exc:
        print(f"criuctl: error: {exc.line()}", file=sys.stderr)
        if exc.detail and _verbose():
            print(exc.detail, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _verbose() -> bool:
    import os

    return os.environ.get("CRIUCTL_VERBOSE") == "1"


if __name__ == "__main__":
    sys.exit(main())
