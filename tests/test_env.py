"""One home for criuctl's environment variables and for its state dir's layout, and it stays one.

A malformed variable is refused through the real CLI in one line, before any verb runs (it was a
traceback, or a silent default). The README's two tables list exactly what `criuctl.core.env` and
`criuctl.core.statedir` name; no module of criuctl reads a variable of its own but through `env`;
no `CRIUCTL_*` name anywhere in the repository's code is missing from `env`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from criuctl.agent import protocol
from criuctl.core import env, nsinit, statedir
from criuctl.kube import api
from criuctl_hook import contract
from tests.conftest import parse_python
from tests.jobs import criuctl
from tests.test_errors import assert_error_line

REPO = Path(__file__).resolve().parent.parent
OURS = re.compile(r"\b(?:CRIUCTL|MIGRATION)_[A-Z0-9_]*[A-Z0-9]\b")
# The modules that read their own variables: the one home, and the init copied alone into containers.
OWN_READS = {REPO / "criuctl/core/env.py", REPO / "criuctl/core/nsinit.py"}

# ---------------------------------------------------------------------- a malformed value: one line

MALFORMED = {
    env.CRIU_LOG_LEVEL: ("debug", "is not an integer"),  # was a traceback, at import
    env.BOUNDARY_TIMEOUT: ("soon", "is not a number of seconds"),  # was silently 30 s
    env.NETWORK_LOCK: ("nft", "is not one of nftables, iptables, skip"),  # was a traceback, mid-dump
    env.TIMEOUTS: ('{"stall": "5s"}', "is not a JSON object of non-negative seconds"),  # was ignored
    env.PID_NAMESPACE: ("yes", "is not 0 or 1"),  # was the default, silently
}


@pytest.mark.parametrize("var", list(MALFORMED), ids=str)
def test_a_malformed_variable_stops_the_cli_in_one_line(var: env.Var, tmp_path: Path) -> None:
    raw, said = MALFORMED[var]
    r = criuctl("dump", "nosuch", "--bundle", str(tmp_path / "b"), env={**_clean(), var: raw}, timeout=60)
    line = assert_error_line(r, f"{var}={raw!r} {said}")
    assert "Traceback" not in r.stderr and r.returncode == 1, r.stderr
    assert not (tmp_path / "b").exists(), line


def test_a_timeouts_name_that_is_no_wait_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.TIMEOUTS, '{"stal": 5}')
    with pytest.raises(env.BadVariable) as e:
        protocol.timeouts()
    assert e.value.line().startswith("CRIUCTL_TIMEOUTS='{\"stal\": 5}' is not") and "stall" in e.value.line()
    monkeypatch.setenv(env.TIMEOUTS, '{"stall": 5}')
    assert protocol.timeouts().stall == 5.0 and protocol.timeouts().freeze == protocol.Timeouts().freeze
    monkeypatch.setenv(env.KUBE_TIMEOUTS, '{"retries": 2}')
    assert api.timeouts().retries == 2 and isinstance(api.timeouts().retries, int)


def test_unset_and_empty_give_the_same_defaults_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in env.ALL:
        monkeypatch.delenv(var, raising=False)
    env.check()
    expected = {
        env.STATE_DIR: Path("/var/lib/criuctl"),
        env.CRIU: "criu",
        env.CRIU_LOG_LEVEL: 2,
        env.NETWORK_LOCK: "nftables",
        env.BOUNDARY_TIMEOUT: 30.0,
        env.LIBNVML: "libnvidia-ml.so.1",
        env.LIBCUDA: "libcuda.so.1",
        env.CUDA_REMAP: True,
        env.VERBOSE: False,
        env.NO_WARM_HANDOFF: False,
        env.MIGRATION_SIGNAL_PATH: Path("./ckpts/signal"),
        env.MIGRATION_CKPT_PATH: Path("./ckpts/migration.pth"),
    }
    for var, value in expected.items():
        assert var.get() == value, var
        monkeypatch.setenv(var, "")
        assert var.get() == value, f"{var}= (empty)"
    monkeypatch.setenv(env.NO_WARM_HANDOFF, "0")  # any value starts handoffs cold, as it always did
    assert env.NO_WARM_HANDOFF.get() is True


# ------------------------------------------------------------------------------- the README's tables


def _readme_table(heading: str) -> dict[str, list[str]]:
    """The first column (without backticks) → the row's cells, of the table under `## heading`."""
    section = REPO.joinpath("README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].removeprefix("| ").strip("`"): cells[1:] for cells in rows}


def test_the_readme_lists_every_variable_env_names_with_its_default() -> None:
    table = _readme_table("Environment variables")
    assert sorted(table) == sorted(env.ALL)
    for var in env.ALL:
        default, kind = table[var][1], table[var][3]
        assert (default, kind.removesuffix(" |")) == (var.shown, var.role.value), var


def test_the_readme_lists_the_state_dirs_layout() -> None:
    table = _readme_table("The state dir")
    named = {("SPOOL/" if p.spooled else "") + p.name + ("/" if p.folder else "") for p in statedir.LAYOUT}
    assert set(table) == named
    assert len(statedir.LAYOUT) == len(named)


def test_the_layout_keeps_the_names_an_upgraded_node_finds(state_dir: Path, monkeypatch) -> None:
    """The names every earlier version used: a node upgraded in place finds its records there."""
    monkeypatch.delenv(env.SPOOL_DIR, raising=False)
    names = "workloads logs handoffs restores locks control bundles imports outgoing incoming redirects pages"
    more = "bundle.key identity.pem nodes.json .nodes.lock kube"
    found = {p.path().relative_to(state_dir).as_posix() for p in statedir.LAYOUT}
    assert found == set(names.split()) | set(more.split())
    monkeypatch.setenv(env.SPOOL_DIR, str(state_dir / "spool"))
    spooled = {p.path() for p in statedir.LAYOUT if p.spooled}
    assert spooled == {state_dir / "spool" / "outgoing", state_dir / "spool" / "incoming"}


# ----------------------------------------------------------------------------- the one home stays one


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    return {
        id(n.body[0].value)
        for n in nodes
        if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def _environ_key(node: ast.AST) -> ast.AST | None:
    """The key of `os.environ[K]`, `os.environ.get(K)` (`pop`, `setdefault`) or `os.getenv(K)`."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
        return node.slice
    if isinstance(node, ast.Call) and node.args:
        f = ast.unparse(node.func)
        if f == "os.getenv" or f in {f"os.environ.{m}" for m in ("get", "pop", "setdefault")}:
            return node.args[0]
    return None


def test_criuctl_reads_its_variables_only_through_env() -> None:
    """No module but `env` (and the standalone init) names one of criuctl's variables in code, nor
    reads the environment with a key that is not a literal (a name borrowed from elsewhere)."""
    found = []
    for path in sorted((REPO / "criuctl").rglob("*.py")):
        if path in OWN_READS:
            continue
        tree = parse_python(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            text = node.value if isinstance(node, ast.Constant) and id(node) not in docs else None
            if isinstance(text, str) and OURS.search(text):
                found.append(f"{where}: {text!r}")
            key = _environ_key(node)
            if key is not None and not (isinstance(key, ast.Constant) and not OURS.search(str(key.value))):
                found.append(f"{where}: {ast.unparse(node)}")
    assert not found, "read these through criuctl.core.env:\n" + "\n".join(found)


def test_every_variable_the_code_names_is_in_env() -> None:
    where = ["criuctl", "hooks", "tools", "tests", "bench", "scripts", "Makefile", ".ci"]
    grep = ["git", "grep", "-hoE", r"(CRIUCTL|MIGRATION)_[A-Z0-9_]*[A-Z0-9]", "--", *where]
    code = subprocess.run(grep, cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert set(code) - set(env.ALL) == set()


def test_the_names_of_the_hook_and_the_init_are_the_ones_env_lists() -> None:
    assert nsinit.ENV_HOOKS_DIR == contract.ENV_HOOKS_DIR == env.HOOKS_DIR  # nsinit cannot import it
    assert nsinit.ENV_CONTROL_DIR == contract.ENV_CONTROL_DIR and nsinit.ENV_WORKLOAD == contract.ENV_WORKLOAD
    hook = (
        contract.ENV_WORKLOAD,
        contract.ENV_CONTROL_DIR,
        contract.ENV_RESUME_STATE,
        contract.ENV_HOOKED_PID,
    )
    assert hook == (env.WORKLOAD, env.CONTROL_DIR, env.RESUME_STATE, env.HOOKED_PID)
    init = (nsinit.ENV_ALLOW_IO_URING, nsinit.ENV_REPORT_FD, nsinit.ENV_POD_UID)
    assert init == (env.ALLOW_IO_URING, env.INIT_REPORT_FD, env.POD_UID)


def _clean() -> dict[str, str]:
    """This process's environment without any of criuctl's variables but the test's state dir."""
    return {k: v for k, v in os.environ.items() if k not in env.ALL or k == env.STATE_DIR}
