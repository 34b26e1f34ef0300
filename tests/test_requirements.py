"""`make test` never skips what it could install (tests/requirements.py): under its variable a missing
requirement stops the run with one line; without it, the tests that need it are skipped with the reason.

Checked on the real suite, with a real requirement really missing: a PATH without zstd (everything
else on PATH is still there), and the real test that needs zstd run by a real pytest. No heavy run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requirements import ENV_REQUIRE_ALL, REQUIREMENTS, Outcome, Requirement, Source

REPO = Path(__file__).resolve().parent.parent
ZSTD_TEST = "tests/test_cri_archive.py::test_a_zstd_archive_imports"
GPU_TESTS = "tests/gpu/test_cuda_driver.py"


def _path_without(tool: str, farm: Path) -> str:
    """A PATH with every command of this one but `tool` (symlinks in `farm`)."""
    farm.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for exe in Path(d).iterdir():
            if exe.name != tool and not (farm / exe.name).exists():
                (farm / exe.name).symlink_to(exe)
    return str(farm)


def _pytest(target: str, path: str, require_all: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_REQUIRE_ALL and not k.startswith("PYTEST_")}
    env["PATH"] = path
    if require_all:
        env[ENV_REQUIRE_ALL] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", target],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_make_test_a_missing_tool_stops_the_run_with_one_line(tmp_path: Path) -> None:
    r = _pytest(ZSTD_TEST, _path_without("zstd", tmp_path / "bin"), require_all=True)
    out = r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "Traceback" not in out and "passed" not in out and "skipped" not in out, out
    lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"ERROR: {ENV_REQUIRE_ALL}=1 (make test)"), out
    # one line for the one thing missing: what needs it, what is missing, how make test installs it
    assert lines[1:] == [lines[1]] and lines[1].startswith("zstd (CRI-O and podman archives"), out
    assert "no zstd on PATH" in lines[1] and "test-fixtures.sh installs Debian's zstd" in lines[1], out


def test_without_make_test_a_missing_tool_skips_with_the_reason(tmp_path: Path) -> None:
    r = _pytest(ZSTD_TEST, _path_without("zstd", tmp_path / "bin"), require_all=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"\b1 skipped\b", out), out
    assert re.search(r"SKIPPED .*needs zstd \(.*\): no zstd on PATH: run `make test`", out), out


def test_under_make_test_a_gpu_is_still_a_skip_with_its_reason() -> None:
    """No install provides a GPU: this machine, and CI, have none."""
    if REQUIREMENTS["gpu"].probe() is None:
        pytest.skip("this host has a CUDA driver: the GPU tests run here")  # the one skip not in the table
    r = _pytest(GPU_TESTS, os.environ["PATH"], require_all=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"\b2 skipped\b", out), out
    assert "no CUDA driver (libcuda.so.1) on this host" in out, out


@pytest.mark.parametrize(
    ("source", "present", "require_all", "outcome"),
    [
        (Source.MAKE_TEST, True, True, Outcome.RUN),
        (Source.MAKE_TEST, False, True, Outcome.ERROR),
        (Source.MAKE_TEST, False, False, Outcome.SKIP),
        (Source.KERNEL, False, True, Outcome.ERROR),
        (Source.KERNEL, False, False, Outcome.SKIP),
        (Source.HARDWARE, False, True, Outcome.SKIP),
        (Source.HARDWARE, True, False, Outcome.RUN),
    ],
)
def test_what_a_missing_requirement_means(source, present, require_all, outcome) -> None:
    req = Requirement("x", "a test", source, lambda: None)
    assert req.outcome(None if present else "no x", require_all) is outcome


def test_every_skip_for_something_missing_goes_through_the_table() -> None:
    """A test that skips on its own for a tool or package would skip under make test too."""
    allowed = {
        ("test_requirements.py", "the one skip not in the table"),
    }
    found = set()
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "requirements.py":
            continue
        for line in path.read_text().splitlines():
            if re.search(r"pytest\.(skip\(|importorskip|mark\.skip)", line):
                found.add((path.name, line))
    unexplained = [(n, line) for n, line in found if not any(n == m and a in line for m, a in allowed)]
    assert not unexplained, unexplained
