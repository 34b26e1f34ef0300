"""The supervisor and the read-only verbs, on real processes: run, ps, inspect, doctor, the hook."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, Job, criuctl, workload_cmd

pytestmark = needs_criu


def test_run_passes_on_exit_status_and_reports_missing_command():
    r = criuctl("run", "--", sys.executable, "-c", "import sys; print('hi'); sys.exit(5)")
    assert r.returncode == 5 and r.stdout == "hi\n"
    r = criuctl("run", "--", "/nonexistent/trainer")
    assert r.returncode == 127 and "cannot start '/nonexistent/trainer'" in r.stderr


def test_workload_runs_as_pid_1_child_in_its_own_namespace_and_session():
    code = "import os; print(os.getpid(), os.getppid(), os.getsid(0))"
    r = criuctl("run", "--", sys.executable, "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "1", "1"]  # trainer is PID 2 under our init, session led by PID 1


def test_sigterm_to_run_reaches_the_trainer():
    job = Job.run("mlp", "train_mlp.py", "--steps", "200")
    job.wait_for_step(2)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0
    assert "got signal 15, stopping cleanly" in job.out


def test_duplicate_name_is_refused_and_ps_lists_workloads():
    job = Job.run("mlp", "train_mlp.py", "--steps", "200")
    try:
        job.wait_for_step(1)
        r = criuctl("run", "--name", "mlp", "--", "true")
        assert r.returncode == 1 and "already running" in r.stderr
        ps = criuctl("ps")
        assert ps.returncode == 0
        row = next(line for line in ps.stdout.splitlines() if line.split()[:1] == ["mlp"])
        assert "running" in row and "train_mlp.py" in row and "MiB" in row
    finally:
        job.kill()
        job.wait()
    ps = criuctl("ps")
    assert "mlp" not in ps.stdout and "No workloads" in ps.stdout
    assert "exited" in criuctl("ps", "--all").stdout


def test_hook_is_loaded_and_user_sitecustomize_still_runs(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    code = (
        "import os, sys, criuctl_hook; print(os.environ['CRIUCTL_WORKLOAD'], criuctl_hook.workload_name(), "
        "os.environ['CRIUCTL_HOOKED_PID'] == str(os.getpid()), os.environ.get('USER_SITE_RAN'))"
    )
    env = {**os.environ, "PYTHONPATH": str(user)}
    r = subprocess.run(
        [*CRIUCTL, "run", "--name", "hooked", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["hooked", "hooked", "True", "yes"]


def test_inspect_describes_a_real_bundle(tmp_path):
    job = Job.run("cnn", "train_cnn_loader.py", "--steps", "200", "--log", str(tmp_path / "log"))
    job.wait_for_step(2)
    listed = criuctl("ps", "-o", "json")  # -o is an output format on every verb
    assert [r["name"] for r in json.loads(listed.stdout) if r["alive"]] == ["cnn"], listed.stdout
    dumped = criuctl("dump", "cnn", "--bundle", str(tmp_path / "b"), "-o", "json")
    assert dumped.returncode == 0, dumped.stderr
    result = json.loads(dumped.stdout)
    assert result["bundle"] == str(tmp_path / "b") and result["workload"] == "cnn", result
    assert result["size_bytes"] > 100 << 20 and 0 < result["freeze_seconds"] <= result["total_seconds"]
    job.wait()
    r = criuctl("inspect", str(tmp_path / "b"), "--output", "json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["checks"] == {"signature": True, "bad_files": [], "ok": True}
    assert m["workload"] == "cnn" and m["uses_gpu"] is False
    cmdlines = [" ".join(p["cmdline"]) for p in m["processes"]]
    assert cmdlines[0].endswith(
        f"criuctl.core.nsinit -- {' '.join(workload_cmd('train_cnn_loader.py'))} "
        f"--steps 200 --log {tmp_path / 'log'}"
    )
    assert len(m["processes"]) >= 4  # init, trainer, two DataLoader workers
    assert [p["ns_pid"] for p in m["processes"][:2]] == [1, 2]
    assert m["rss_bytes"] > 100 << 20 and str(tmp_path / "log") in m["open_files"]
    assert all(len(v) == 64 for v in m["files"].values()) and "images/inventory.img" in m["files"]
    text = criuctl("inspect", str(tmp_path / "b"))
    assert text.returncode == 0
    assert "signature ok" in text.stdout and "train_cnn_loader.py" in text.stdout
    assert "GPU: no" in text.stdout


def test_doctor_reports_each_check():
    r = criuctl("doctor")
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert any(line.startswith("ok   CRIU: 4.") for line in lines)
    assert any(line.startswith("ok   criu check") for line in lines)
    # make test installs CRIU with scripts/criu-patches/: post-copy's pull keeps requests in flight
    assert any(line.startswith("ok   post-copy page pull: 8 requests in flight") for line in lines), r.stdout
    # post-copy is the default: its risk is said where it runs
    window = [line for line in lines if line.startswith("ok   post-copy's window: ")]
    assert window and "two nodes" in window[0], r.stdout
    assert not any("pre-copy" in line or "soft-dirty" in line for line in lines)  # nothing uses it
    for name in (
        "userfaultfd",
        "CAP_CHECKPOINT_RESTORE",
        "PID namespaces",
        "CUDA checkpoint API",
    ):
        assert any(name in line for line in lines), name
    # this machine: v1 controllers with the unified hierarchy beside them, in the node's namespace
    assert any(line.startswith("ok   cgroups: cgroup hybrid") for line in lines), r.stdout


def test_install_script_is_idempotent_and_fast():
    venv = os.path.dirname(os.path.dirname(sys.executable))
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "scripts/install-criu.sh", venv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0, r.stderr
    assert "ok: Version: 4." in r.stderr and "building" not in r.stderr
    assert time.monotonic() - t0 < 10
