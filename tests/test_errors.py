"""Every user error: one line saying what is wrong and what to do, a non-zero exit, nothing lost."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from criuctl.format import bundle
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, Job, Reference, criuctl
from tests.requirements import OLD_CRIU, needs

pytestmark = needs_criu


def assert_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode != 0, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got: {r.stderr!r}"
    line = lines[0]
    assert line.startswith("criuctl: error: "), line
    assert ": " in line.removeprefix("criuctl: error: "), f"no hint in {line!r}"
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


@pytest.fixture(scope="module")
def ref():
    return Reference("ref", "train_mlp.py", "--steps", "60")


@pytest.fixture
def job():
    j = Job.run("mlp", "train_mlp.py", "--steps", "60")
    j.wait_for_step(3)
    yield j
    j.kill()


def assert_still_training_exactly_once(job: Job, ref: Reference) -> None:
    """The failed command did not touch the job: it finishes with every step of the reference."""
    assert job.wait() == 0, job.err[-5:]
    assert not any("checkpointed" in line for line in job.err)
    assert job.steps == ref.steps and job.final == ref.final


def test_unknown_name_and_pid(tmp_path, job, ref):
    assert_error_line(criuctl("dump", "nosuch", "--bundle", str(tmp_path / "b")), "nosuch", "criuctl ps")
    free_pid = next(p for p in range(4_000_000, 3_000_000, -1) if not os.path.exists(f"/proc/{p}"))
    assert_error_line(criuctl("dump", str(free_pid), "--bundle", str(tmp_path / "b")), str(free_pid))
    line = assert_error_line(criuctl("dump", str(os.getpid()), "--bundle", str(tmp_path / "b")))
    assert "not part of a criuctl workload" in line and "criuctl run" in line
    assert not (tmp_path / "b").exists()
    assert_still_training_exactly_once(job, ref)


def test_not_root(tmp_path, job, ref):
    # A real unprivileged process: the system Python as `nobody`, with only the project on its path
    # (criuctl checks for root before importing anything beyond the standard library).
    project = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            f"PYTHONPATH={project}",
            "/usr/bin/python3",
            "-m",
            "criuctl.cli.main",
            "dump",
            "mlp",
            "--bundle",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_error_line(r, "needs root", "sudo")
    assert r.returncode == 77
    assert_still_training_exactly_once(job, ref)


def test_criu_missing(tmp_path, job, ref):
    r = criuctl(
        "dump", "mlp", "-b", str(tmp_path / "b"), env={**os.environ, "CRIUCTL_CRIU": "/nonexistent/criu"}
    )
    assert_error_line(r, "CRIU not found", "install-criu.sh")
    assert not (tmp_path / "b").exists()
    assert_still_training_exactly_once(job, ref)


@needs("criu-3.17")
def test_criu_too_old(tmp_path, job, ref):
    r = criuctl("dump", "mlp", "-b", str(tmp_path / "b"), env={**os.environ, "CRIUCTL_CRIU": str(OLD_CRIU)})
    assert_error_line(r, "3.17", "too old", "install-criu.sh")
    assert_still_training_exactly_once(job, ref)


def test_unsupported_resource_leaves_job_running(tmp_path, ref):
    job = Job.run(
        "uring", "train_mlp.py", "--steps", "60", "--hold-io-uring", run_flags=("--allow-io-uring",)
    )
    try:
        job.wait_for_step(3)
        r = criuctl("dump", "uring", "--bundle", str(tmp_path / "b"))
        assert_error_line(r, "holds an io_uring", "without --allow-io-uring", "keeps running")
        assert not (tmp_path / "b").exists()
        assert not list(tmp_path.glob(".b.partial-*")), "the staging directory was left behind"
        assert_still_training_exactly_once(job, ref)
    finally:
        job.kill()


def test_disk_full_leaves_job_running(tmp_path, job, ref):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        r = criuctl("dump", "mlp", "--bundle", str(small / "b"))
        assert_error_line(r, "disk full", "keeps running")
        assert list(small.iterdir()) == [], "a partial bundle was left on the full disk"
        assert_still_training_exactly_once(job, ref)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """One real bundle of a real job, and the key it was signed with."""
    d = tmp_path_factory.mktemp("sealed")
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(d / "state")}
    # long enough that a loaded machine still freezes it mid-run (the dump ends it anyway)
    job = Job([*CRIUCTL, "run", "--name", "s", "--", *_cmd("--steps", "2000")], env=env)
    try:
        job.wait_for_step(3)
        dump = [*CRIUCTL, "dump", "s", "--bundle", str(d / "b")]
        r = subprocess.run(dump, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        job.wait()
    finally:
        job.kill()
    return d / "b", d / "state"


def _cmd(*args: str) -> list[str]:
    from tests.jobs import workload_cmd

    return workload_cmd("train_mlp.py", *args)


def _copy_bundle(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_every_image_file_with_one_flipped_byte_is_refused(sealed, tmp_path):
    src, state = sealed
    key = bundle.load_key(state / "bundle.key", create=False)
    images = sorted(p.relative_to(src) for p in (src / bundle.IMAGES_DIR).iterdir())
    assert len(images) > 10
    for rel in images:
        b = _copy_bundle(src, tmp_path / "t")
        data = bytearray((b / rel).read_bytes())
        data[len(data) // 2] ^= 0x01
        (b / rel).write_bytes(bytes(data))
        with pytest.raises(bundle.BundleError) as e:
            bundle.verify(b, key)
        assert str(rel) in e.value.line() and "checksum mismatch" in e.value.line()
        subprocess.run(["rm", "-rf", str(b)], check=True)


def test_restore_refuses_tampered_unsigned_and_foreign_bundles(sealed, tmp_path):
    src, state = sealed
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(state)}

    def restore(b: Path, environ=env) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*CRIUCTL, "restore", str(b)], capture_output=True, text=True, env=environ, timeout=60
        )

    tampered = _copy_bundle(src, tmp_path / "tampered")
    pages = max((tampered / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert_error_line(restore(tampered), pages.name, "checksum mismatch", "refusing to restore")

    unsigned = _copy_bundle(src, tmp_path / "unsigned")
    (unsigned / bundle.SIGNATURE).unlink()
    assert_error_line(restore(unsigned), "signature does not verify")

    edited = _copy_bundle(src, tmp_path / "edited")
    m = (edited / bundle.MANIFEST).read_text().replace('"workload": "s"', '"workload": "x"')
    (edited / bundle.MANIFEST).write_text(m)
    assert_error_line(restore(edited), "signature does not verify")

    other_node = {**os.environ, "CRIUCTL_STATE_DIR": str(tmp_path / "other-node")}
    bundle.load_key(tmp_path / "other-node" / "bundle.key")  # that node has its own key
    assert_error_line(restore(src, other_node), "signature does not verify", "another node's key")

    from criuctl.core import workloads

    os.environ["CRIUCTL_STATE_DIR"] = str(state)
    try:
        assert [w.name for w in workloads.all_workloads() if w.alive()] == [], "a refused bundle ran"
    finally:
        os.environ.pop("CRIUCTL_STATE_DIR")


def test_restore_without_criu_keeps_bundle(sealed, tmp_path):
    src, state = sealed
    b = _copy_bundle(src, tmp_path / "b")
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(state), "CRIUCTL_CRIU": "/nonexistent/criu"}
    r = subprocess.run([*CRIUCTL, "restore", str(b)], capture_output=True, text=True, env=env, timeout=60)
    assert_error_line(r, "CRIU not found")
    key = bundle.load_key(state / "bundle.key", create=False)
    assert bundle.verify(b, key).workload == "s"  # untouched, still restorable


def test_dump_into_existing_directory_is_refused(tmp_path, job, ref):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("user data")
    assert_error_line(criuctl("dump", "mlp", "--bundle", str(tmp_path / "b")), "not empty")
    assert (tmp_path / "b" / "keep.txt").read_text() == "user data"
    assert_still_training_exactly_once(job, ref)
