"""Every bad input at a boundary: one error line, a non-zero exit, and nothing started or written.

Black-box: the real `criuctl` CLI, real agents on 127.0.0.1, a real read-only mount. None of these
needs CRIU (each input is refused before CRIU would run), but most need root: `run` makes a PID
namespace, the agent and `dump` refuse to start without root, and only root can mount.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from criuctl.core import workloads
from tests.cluster import agent_cert
from tests.jobs import CRIUCTL, Job, criuctl
from tests.requirements import needs, require
from tests.test_errors import assert_error_line

needs_root = needs("root")
SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
BAD_NAMES = {
    "./../x": "contains '..'",
    "a/b": "contains '/'",
    "": "cannot be empty",
    ".hidden": "starts with '.'",
    "-x": "starts with '-'",
    "a" * 64: "is 64 characters long",
    "a..b": "contains '..'",
    "x\ny": "contains '\\n'",
}


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# ------------------------------------------------------------------------------------------ names


def test_validate_name_accepts_exactly_the_rule():
    for good in ("a", "bert", "bert-2", "x.y_z", "9", "A" * 63, "python3.11"):
        assert workloads.validate_name(good) == good
    for bad, why in BAD_NAMES.items():
        with pytest.raises(workloads.BadName, match=re.escape(why)) as e:
            workloads.validate_name(bad)
        assert e.value.exit_code == 2 and "\n" not in e.value.line()
    with pytest.raises(workloads.BadName, match="must be a string, not int"):
        workloads.validate_name(3)  # type: ignore[arg-type]  # what a JSON body may hold


def test_registry_builds_no_path_from_a_bad_name(state_dir):
    with pytest.raises(workloads.BadName):
        workloads.load("../../etc/passwd")
    with pytest.raises(workloads.BadName):
        workloads.log_path("..")
    w = workloads.Workload("../x", ["true"], 1, 1, {})
    with pytest.raises(workloads.BadName):
        workloads.save(w)
    assert not (state_dir.parent / "x.json").exists()


def test_default_names_are_valid():
    assert workloads.name_for("/usr/bin/python3.11") == "python3.11"
    assert workloads.name_for("./my train.sh") == "my-train.sh"
    assert workloads.name_for("..") == "job"
    assert workloads.name_for("/x/-weird..name") == "weird.name"
    assert len(workloads.name_for("a" * 300)) == workloads.NAME_MAX


@needs_root
@pytest.mark.parametrize("name", list(BAD_NAMES), ids=lambda n: repr(n)[:20])
def test_run_refuses_a_bad_name_before_anything_starts(name, tmp_path, state_dir):
    before = _tree(tmp_path)
    marker = tmp_path / "ran"
    r = criuctl("run", f"--name={name}", "--", "touch", str(marker))
    line = assert_error_line(r, BAD_NAMES[name], "1-63 characters")
    assert r.returncode == 2 and "started" not in r.stderr, line
    assert not marker.exists(), "the command ran"
    assert _tree(tmp_path) == before, "run wrote something for a refused name"


@needs_root
@pytest.mark.parametrize(
    "verb",
    [
        ("logs", "{n}"),
        ("logs", "{n}", "--node", "nosuch"),
        ("dump", "{n}", "--bundle", "{d}/b"),
        ("restore", "{d}", "--name", "{n}"),
        ("migrate", "{n}", "--to", "nosuch"),
    ],
    ids=lambda v: " ".join(v[:1] + v[2:3]),
)
@pytest.mark.parametrize("name", ["./../x", "a/b"])
def test_every_verb_refuses_a_bad_name(verb, name, tmp_path):
    argv = [a.format(n=name, d=tmp_path) for a in verb]
    r = criuctl(*argv)
    assert_error_line(r, f"workload name {name!r}", "1-63 characters")
    assert r.returncode == 2


def test_o_is_an_output_format_and_a_folder_there_says_where_it_goes(tmp_path):
    """`-o DIR` (a dump's folder once) is refused before anything runs, naming `--bundle`."""
    for verb in (("dump", "x"), ("ps",), ("migrate", "x", "b")):
        r = criuctl(*verb, "-o", str(tmp_path / "b"))
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        said = f"not a folder ({str(tmp_path / 'b')!r}); a dump's bundle folder is `--bundle DIR`"
        assert last.endswith(said), last
    assert not (tmp_path / "b").exists()


def test_logs_by_pid_like_names_still_work(tmp_path):
    """A PID is digits: a valid name, so `logs 123` is an ordinary miss, not a refusal."""
    r = criuctl("logs", "123")
    assert_error_line(r, "no logs for '123'")
    assert r.returncode == 3


# -------------------------------------------------------------------------- commands that can't run


@needs_root
def test_run_of_a_missing_program_is_one_line_and_127(state_dir):
    r = criuctl("run", "--", "/nonexistent/trainer")
    assert_error_line(r, "cannot start '/nonexistent/trainer'", "No such file or directory", "PATH")
    assert r.returncode == 127
    assert workloads.all_workloads() == [], "a workload that never started was registered"


@needs_root
def test_run_of_a_file_that_is_not_executable_is_one_line_and_126(tmp_path, state_dir):
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")
    os.chmod(script, 0o644)
    r = criuctl("run", "--", str(script))
    assert_error_line(r, f"cannot start '{script}'", "Permission denied", "chmod +x")
    assert r.returncode == 126
    assert workloads.all_workloads() == []


def _fits(argv: list[str]) -> bool:
    try:
        subprocess.run(argv, executable="/bin/true", check=True)
        return True
    except OSError:
        return False


@needs_root
def test_run_with_an_argument_list_near_arg_max_is_not_exit_0(tmp_path, state_dir):
    """Just short enough for `criuctl run` itself to start, too long for the init it execs
    (which adds its own arguments and environment): this exited 0 before."""
    base = [*CRIUCTL, "run", "--", sys.executable, "-c", "pass"]
    chunk = "x" * 100_000  # below the kernel's 128 KiB per string
    n = 0
    while _fits([*base, *[chunk] * (n + 1)]):
        n += 1
    lo, hi = 0, len(chunk)
    while lo < hi:  # the longest last argument that still fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits([*base, *[chunk] * n, "y" * mid]) else (lo, mid - 1)
    argv = [*base, *[chunk] * n, "y" * max(lo - 64, 0)]  # 64 bytes spare: our own exec fits
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    line = assert_error_line(r, "cannot start", "too long for the kernel", "in a file")
    assert r.returncode == 126, line
    assert workloads.all_workloads() == []


# ------------------------------------------------------------------------------- dump and inspect


@contextlib.contextmanager
def _read_only_mount(where: Path) -> Iterator[Path]:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@needs_root
def test_dump_into_a_read_only_folder_is_one_line_and_nothing_is_frozen(tmp_path):
    job = Job([*CRIUCTL, "run", "--name", "sl", "--", *SLEEPER])
    try:
        job.wait_for("^up$", timeout=60)
        with _read_only_mount(tmp_path / "ro") as ro:
            r = criuctl("dump", "sl", "--bundle", str(ro / "b"))
            assert_error_line(
                r, f"cannot write a bundle into {ro}", "Read-only file system", "nothing was frozen"
            )
            assert list(ro.iterdir()) == []
        assert job.proc.poll() is None, "the workload stopped"
        w = workloads.load("sl")
        assert w is not None and w.state == workloads.RUNNING and w.alive()
    finally:
        job.kill()
        job.wait()


def test_inspect_of_a_file_a_missing_path_and_a_folder_without_manifest(tmp_path):
    f = tmp_path / "bundle.tar"
    f.write_text("not a folder")
    assert_error_line(criuctl("inspect", str(f)), f"{f} is a file, not a bundle directory")
    assert_error_line(criuctl("inspect", str(tmp_path / "none")), f"no bundle at {tmp_path / 'none'}")
    (tmp_path / "empty").mkdir()
    assert_error_line(
        criuctl("inspect", str(tmp_path / "empty")), "is not a criuctl bundle (no manifest.json)"
    )
    (tmp_path / "dir" / "manifest.json").mkdir(parents=True)
    assert_error_line(criuctl("inspect", str(tmp_path / "dir")), "cannot read", "Is a directory")


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[]", "a list, not a JSON object"),
        (b'"x"', "a string, not a JSON object"),
        (b"3", "an integer, not a JSON object"),
        (b"null", "null, not a JSON object"),
        (b'{"processes": 3}', "it has no format_version"),
        (b'{"format_version": "1"}', "format_version is a string, not an integer"),
        (b'{"format_version": 1, "processes": 3}', "manifest has no field 'workload'"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "nested too deeply"),
    ],
    ids=lambda v: repr(v)[:24],
)
@pytest.mark.parametrize("output", ["text", "json"])
def test_inspect_of_a_manifest_that_is_not_a_manifest(tmp_path, raw, why, output):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_bytes(raw)
    r = criuctl("inspect", str(tmp_path / "b"), "--output", output)
    assert_error_line(r, f"{tmp_path / 'b' / 'manifest.json'} is corrupted", why, "take a new checkpoint")
    assert r.stdout == ""


def test_inspect_of_a_manifest_with_wrong_field_types(tmp_path):
    import json

    from criuctl.format import bundle

    m = bundle.Manifest(
        workload="w", command=["x"], processes=[], open_files=[], uses_gpu=False, criu_version="4.1"
    )
    for field, value, why in [
        ("processes", 3, "manifest.processes is an integer, not a list"),
        ("processes", [{"pid": "1"}], "manifest.processes[0].pid is a string, not an integer"),
        ("processes", [{"pid": 1}], "manifest.processes[0] has no field 'ns_pid'"),
        ("command", "python train.py", "manifest.command is a string, not a list"),
        ("uses_gpu", "no", "manifest.uses_gpu is a string, not a boolean"),
        ("files", {"../../etc/shadow": "0" * 64}, "files lists '../../etc/shadow'"),
        ("extra", 1, "unknown field 'extra'"),
    ]:
        data = json.loads(m.to_json())
        data[field] = value
        b = tmp_path / field
        b.mkdir(exist_ok=True)
        (b / "manifest.json").write_text(json.dumps(data))
        assert_error_line(criuctl("inspect", str(b)), why)


def test_inspect_shows_markup_in_a_manifest_as_text(tmp_path):
    """A manifest is data: '[/]' in a name or a command was rich markup, and raised."""

    from criuctl.format import bundle

    m = bundle.Manifest(
        workload="[/]",
        command=["[bold]x", "[/]"],
        processes=[],
        open_files=["/tmp/[/]"],
        uses_gpu=False,
        criu_version="[/]",
        created=1e300,
    )
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_bytes(m.to_json())
    r = criuctl("inspect", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert "workload '[/]': [bold]x [/]" in r.stdout and "/tmp/[/]" in r.stdout


# ------------------------------------------------------------------------------------- state dir


@needs_root
@pytest.mark.parametrize(
    "verb",
    [
        ("ps",),
        ("run", "--", "touch", "{marker}"),
        ("node", "ls"),
        ("logs", "x"),
        ("dump", "x", "--bundle", "{d}/b"),
    ],
    ids=lambda v: v[0],
)
@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_a_state_dir_that_is_a_file_is_one_line(tmp_path, verb, under):
    f = tmp_path / "state-file"
    f.write_text("")
    sd = f / "sub" if under else f
    marker = tmp_path / "ran"
    argv = [a.format(marker=marker, d=tmp_path) for a in verb]
    where = "lies under" if under else "is a file"
    for r in (
        criuctl(*argv[:1], "--state-dir", str(sd), *argv[1:]),
        criuctl(*argv, env={**os.environ, "CRIUCTL_STATE_DIR": str(sd)}),
    ):
        assert_error_line(r, f"the state dir {sd} {where}", "pass --state-dir a folder")
    assert not marker.exists(), "run started its command"


# ------------------------------------------------------------------------------------------- agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token(path: Path, value: str | None = None, mode: int = 0o600) -> Path:
    path.write_text((value or secrets.token_hex(16)) + "\n")
    os.chmod(path, mode)
    return path


def _agent(*args: str, state: Path) -> subprocess.CompletedProcess:
    # 30 s: an agent that passes its checks by mistake serves for ever; the timeout fails the test
    return criuctl("agent", *args, timeout=30, env={**os.environ, "CRIUCTL_STATE_DIR": str(state)})


@needs_root
def test_agent_with_its_port_in_use(tmp_path):
    token = _token(tmp_path / "token")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            r = _agent(
                "--listen", f"{host}:{port}", "--token-file", str(token), "--insecure", state=tmp_path / "s"
            )
            assert_error_line(r, f"cannot listen on {host}:{port}: the port is in use", "another --listen")


@needs_root
@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("nohost", "--listen 'nohost' is not HOST:PORT (no port)"),
        ("1.2.3.4:99999", "the port 99999 in --listen '1.2.3.4:99999' is not in 1-65535"),
        (":abc", "the port 'abc' in --listen ':abc' is not a number"),
        ("127.0.0.1:", "the port '' in --listen '127.0.0.1:' is not a number"),
        ("::1:7070", "write an IPv6 address in brackets"),
        ("[::1:7070", "is not [IPv6]:PORT"),
        ("1.2.3.4:7070", "cannot listen on 1.2.3.4:7070: not an address of this host"),
        ("nohost.invalid:7070", "no address for 'nohost.invalid'"),
    ],
)
def test_agent_with_a_bad_listen(tmp_path, listen, why):
    token = _token(tmp_path / "token")
    r = _agent("--listen", listen, "--token-file", str(token), "--insecure", state=tmp_path / "s")
    assert_error_line(r, why, "0.0.0.0")  # every hint shows a good --listen
    assert r.returncode == 2


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def test_agent_warns_of_a_certificate_for_another_node_or_an_expired_one(tmp_path):
    """The start-up check behind the agent's warnings: by this node's address or name, and expiry."""
    from criuctl.agent import preflight

    require("openssl")
    pki = tmp_path / "pki"
    here, _, _ = agent_cert(pki, "here", "127.0.0.1")
    assert preflight.cert_warnings(here, "127.0.0.1", "here") == []
    other, _, _ = agent_cert(pki, "other", "192.0.2.77")
    (warning,) = preflight.cert_warnings(other, "127.0.0.1", "here")
    assert f"{other} names 192.0.2.77, none of this node's addresses (127.0.0.1) or names (here)" in warning
    named, _, _ = agent_cert(pki, "n1", "192.0.2.78", "*.nodes.test")
    assert preflight.cert_warnings(named, "127.0.0.1", "n1.nodes.test") == []  # by its name
    assert len(preflight.cert_warnings(named, "127.0.0.1", "n1.other.test")) == 1
    (expired,) = preflight.cert_warnings(here, "127.0.0.1", "here", now=time.time() + 3 * 86400)
    assert "has expired" in expired


@needs_root
def test_agent_with_missing_or_bad_tls_files(tmp_path):
    token = _token(tmp_path / "token")
    listen = ("--listen", f"127.0.0.1:{_free_port()}", "--token-file", str(token))
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"

    def agent(*tls: str) -> subprocess.CompletedProcess:
        return _agent(*listen, *tls, state=tmp_path / "s")

    line = assert_error_line(agent("--tls-cert", str(cert)), "--tls-cert and --tls-key go together")
    assert "pass both" in line
    assert_error_line(agent("--tls-cert", str(cert), "--tls-key", str(key)), f"cannot read --tls-cert {cert}")
    cert.write_text("not a certificate\n")
    assert_error_line(agent("--tls-cert", str(cert), "--tls-key", str(key)), f"cannot read --tls-key {key}")
    key.write_text("not a key\n")
    assert_error_line(
        agent("--tls-cert", str(cert), "--tls-key", str(key)), "are not a PEM certificate and its key"
    )
    require("openssl")  # the mismatched-key case
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-days",
        "1",
        "-subj",
        "/CN=a",
    )
    _openssl("genpkey", "-algorithm", "RSA", "-out", str(tmp_path / "other.pem"))
    r = agent("--tls-cert", str(cert), "--tls-key", str(tmp_path / "other.pem"))
    assert_error_line(r, "are not a PEM certificate and its key")
    assert_error_line(
        agent("--tls-cert", str(key), "--tls-key", str(cert)), "are not a PEM certificate and its key"
    )
    # the agents' CA that callers are checked against: missing, or not a certificate
    pair = ("--tls-cert", str(cert), "--tls-key", str(key))
    r = agent(*pair, "--peer-ca", str(tmp_path / "nowhere.crt"))
    assert_error_line(r, f"cannot load --peer-ca {tmp_path / 'nowhere.crt'}", "the PEM certificate of the CA")
    r = agent(*pair, "--peer-ca", str(tmp_path / "other.pem"))
    assert_error_line(r, f"cannot load --peer-ca {tmp_path / 'other.pem'}")


@needs_root
def test_agent_without_a_certificate_or_insecure_refuses(tmp_path):
    """HTTPS is the default: no certificate and no --insecure is a refusal, not plain HTTP."""
    token = _token(tmp_path / "token")
    listen = ("--listen", f"127.0.0.1:{_free_port()}", "--token-file", str(token))
    r = _agent(*listen, state=tmp_path / "s")
    what = "the agent serves HTTPS and was given no certificate"
    assert_error_line(
        r, what, "--tls-cert FILE --tls-key FILE", "scripts/agent-cert.sh NODE ADDRESS", "or --insecure"
    )
    assert r.returncode == 2
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = _agent(*listen, "--insecure", "--tls-cert", str(cert), "--tls-key", str(key), state=tmp_path / "s")
    assert_error_line(r, "--insecure contradicts --tls-cert/--tls-key", "drop --insecure")
    assert r.returncode == 2
    r = _agent(*listen, "--insecure", "--peer-ca", str(cert), state=tmp_path / "s")
    assert_error_line(r, "--peer-ca asks callers for a certificate, which needs HTTPS", "drop --peer-ca")
    assert r.returncode == 2
    r = _agent(*listen, "--tls-from-cluster", "--insecure", state=tmp_path / "s")
    assert_error_line(
        r, "--tls-from-cluster replaces --tls-cert/--tls-key and --insecure", "pass one of them"
    )
    assert r.returncode == 2


@needs_root
def test_an_insecure_agent_says_so_wherever_it_shows(tmp_path):
    """--insecure serves plain HTTP, and says so: the agent's log, /v1/info, node add/ls, doctor."""
    token, port, state = _token(tmp_path / "token"), _free_port(), tmp_path / "s"
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(tmp_path / "client")}
    with (tmp_path / "agent.log").open("w") as log:
        argv = [*CRIUCTL, "agent", "--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--insecure"]
        agent = subprocess.Popen(
            [*argv, "--name", "plain", "--state-dir", str(state)], stdout=log, stderr=log
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, True, tmp_path / "agent.log")
        warning = (tmp_path / "agent.log").read_text().splitlines()[0]
        assert '"level": "warning"' in warning and "serving plain HTTP (--insecure)" in warning, warning
        auth = {"Authorization": f"Bearer {token.read_text().strip()}"}
        assert requests.get(f"{url}/v1/info", headers=auth, timeout=30).json()["tls"] is False
        r = criuctl("node", "add", "plain", url, "--token-file", str(token), "--ca", str(token), env=env)
        assert_error_line(r, f"--ca is for an https URL, and {url} is plain HTTP", "drop --ca")
        r = criuctl("node", "add", "plain", url, "--token-file", str(token), env=env)
        assert r.returncode == 0, r.stderr
        warned = [line for line in r.stderr.splitlines() if "warning" in line]
        assert warned == [warned[0]] and "node plain is plain HTTP" in warned[0] and "https://" in warned[0]
        r = criuctl("node", "ls", env=env)
        row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["plain"])
        assert "NONE: plain HTTP" in row and "up (plain," in row, r.stdout
        r = criuctl("doctor", env=env)
        assert any(
            line.startswith("warn agents' TLS: node plain: plain HTTP") for line in r.stdout.splitlines()
        )
    finally:
        agent.terminate()
        agent.wait(15)


def _wait_up(url: str, verify: str | bool, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/healthz", timeout=2, verify=verify).ok:
                return
        time.sleep(0.2)
    raise AssertionError(f"the agent at {url} did not start: {log.read_text()[-2000:]}")


@needs_root
def test_agent_with_a_token_file_it_would_refuse(tmp_path):
    listen = ("--listen", f"127.0.0.1:{_free_port()}", "--insecure")
    state = tmp_path / "s"
    r = _agent(*listen, "--token-file", str(_token(tmp_path / "open", mode=0o644)), state=state)
    assert_error_line(r, "is readable by others (mode 644)", "chmod 600")
    r = _agent(*listen, "--token-file", str(_token(tmp_path / "short", "abc")), state=state)
    assert_error_line(r, "is too short (3 characters)", "at least 16")
    r = _agent(*listen, "--token-file", str(tmp_path / "missing"), state=state)
    assert_error_line(r, "cannot read token file", "No such file or directory")
    r = _agent(*listen, state=state)  # no token, and no CA whose certificates callers could show
    assert_error_line(r, "needs --token-file, or --peer-ca", "pass --token-file FILE")


# ---------------------------------------------------------------------------- nodes and migration


class Agents:
    """Two agents on 127.0.0.1 with their own state dirs (a runs workload 'w'), each serving HTTPS
    with its own certificate, and a client state dir that knows them as nodes a and b."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = _token(root / "token")
        self.client = root / "client"
        self.procs: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}
        for name in ("a", "b"):
            port = _free_port()
            state = root / name
            cert, key, self.ca = agent_cert(root / "pki", name, "127.0.0.1")
            self.procs.append(
                subprocess.Popen(
                    [
                        *CRIUCTL,
                        "agent",
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--token-file",
                        str(self.token),
                        "--name",
                        name,
                        "--tls-cert",
                        str(cert),
                        "--tls-key",
                        str(key),
                    ],
                    env={**os.environ, "CRIUCTL_STATE_DIR": str(state)},
                    stdout=subprocess.DEVNULL,
                    stderr=open(root / f"{name}.log", "w"),  # noqa: SIM115
                )
            )
            self.urls[name] = f"https://127.0.0.1:{port}"
        for name, url in self.urls.items():
            _wait_up(url, str(self.ca), root / f"{name}.log")
            self.cli(
                "node", "add", name, url, "--token-file", str(self.token), "--ca", str(self.ca), check=True
            )
        self.job = Job(
            [*CRIUCTL, "run", "--name", "w", "--", *SLEEPER],
            env={**os.environ, "CRIUCTL_STATE_DIR": str(root / "a")},
        )
        self.job.wait_for("^up$", timeout=60)

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        r = criuctl(*args, timeout=60, env={**os.environ, "CRIUCTL_STATE_DIR": str(self.client)})
        assert not check or r.returncode == 0, r.stderr
        return r

    def close(self) -> None:
        self.job.kill()
        self.job.wait()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def agents(tmp_path_factory) -> Iterator[Agents]:
    require("root")
    a = Agents(tmp_path_factory.mktemp("agents"))
    try:
        yield a
    finally:
        a.close()


def test_migrate_to_the_node_it_already_runs_on(agents):
    for extra in ((), ("--from", "a")):
        r = agents.cli("migrate", "w", "--to", "a", *extra)
        assert_error_line(r, "workload 'w' already runs on node a", "nothing to move")
    assert agents.job.proc.poll() is None


def test_migrate_from_a_node_it_does_not_run_on(agents):
    r = agents.cli("migrate", "w", "--to", "a", "--from", "b")
    assert_error_line(r, "workload 'w' does not run on node b; it runs on node a", "--from a")
    r = agents.cli("migrate", "nosuch", "--to", "a", "--from", "b")
    assert_error_line(r, "workload 'nosuch' does not run on node b", "criuctl ps --node")
    r = agents.cli("migrate", "nosuch", "--to", "b")
    assert_error_line(r, "no node runs a workload named 'nosuch'", "--from NODE")
    assert agents.job.proc.poll() is None


def test_ps_of_a_node_with_no_workloads(agents):
    r = agents.cli("ps", "--node", "b")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "No workloads on node b. Start one there with: criuctl run -- CMD"
    r = agents.cli("ps", "--node", "a")
    assert r.returncode == 0 and any(line.split()[:1] == ["w"] for line in r.stdout.splitlines()), r.stdout


def test_node_ls_says_refused_for_a_wrong_token_and_down_for_no_agent(agents, tmp_path):
    wrong = _token(tmp_path / "wrong")
    agents.cli(
        "node",
        "add",
        "wrong",
        agents.urls["a"],
        "--token-file",
        str(wrong),
        "--ca",
        str(agents.ca),
        check=True,
    )
    agents.cli(
        "node", "add", "gone", f"http://127.0.0.1:{_free_port()}", "--token-file", str(wrong), check=True
    )
    try:
        r = agents.cli("node", "ls")
        assert r.returncode == 0, r.stderr
        rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
        assert {"a", "b", "wrong", "gone"} <= set(rows), r.stdout
        assert "up (a," in rows["a"] and "up (b," in rows["b"]
        assert "verified (ca.crt)" in rows["a"] and "NONE: plain HTTP" in rows["gone"]
        assert "refused: wrong token" in rows["wrong"] and "down" not in rows["wrong"]
        assert "down: node gone" in rows["gone"]
        r = agents.cli("ps", "--node", "wrong")
        assert_error_line(r, "node wrong", "refused the token", "wrong token", "criuctl node add wrong")
    finally:
        agents.cli("node", "rm", "wrong")
        agents.cli("node", "rm", "gone")


def test_a_node_added_without_its_ca_is_refused_in_one_line(agents):
    """An https node without --ca is checked against the system's CAs, which never signed ours."""
    agents.cli("node", "add", "noca", agents.urls["a"], "--token-file", str(agents.token), check=True)
    try:
        r = agents.cli("ps", "--node", "noca")
        assert_error_line(
            r,
            f"node noca ({agents.urls['a']}) failed the TLS check",
            "unable to get local issuer certificate",
            "--ca CA.pem",
        )
        row = next(
            line for line in agents.cli("node", "ls").stdout.splitlines() if line.split()[:1] == ["noca"]
        )
        assert "verified (system CAs)" in row and "TLS refused: unable to get local issuer" in row, row
        r = agents.cli(
            "node",
            "add",
            "noca",
            agents.urls["a"],
            "--token-file",
            str(agents.token),
            "--ca",
            str(agents.token),
        )
        assert_error_line(r, f"cannot use --ca {agents.token}", "not a PEM certificate")
    finally:
        agents.cli("node", "rm", "noca")


def test_node_add_refuses_a_token_file_the_agent_would_refuse(agents, tmp_path):
    before = (agents.client / "nodes.json").read_text()
    url = agents.urls["b"]
    r = agents.cli("node", "add", "c", url, "--token-file", str(_token(tmp_path / "o", mode=0o644)))
    assert_error_line(r, "is readable by others (mode 644)", "chmod 600")
    r = agents.cli("node", "add", "c", url, "--token-file", str(_token(tmp_path / "s", "short")))
    assert_error_line(r, "is too short (5 characters)", "at least 16")
    r = agents.cli("node", "add", "c", url, "--token-file", str(tmp_path / "none"))
    assert_error_line(r, "cannot read the token file of node c")
    assert (agents.client / "nodes.json").read_text() == before


def test_node_verbs_take_state_dir_after_the_sub_verb(tmp_path, state_dir):
    token = _token(tmp_path / "t")
    other = tmp_path / "other"
    r = criuctl(
        "node", "add", "x", "http://127.0.0.1:9", "--token-file", str(token), "--state-dir", str(other)
    )
    assert r.returncode == 0, r.stderr
    assert "x" in (other / "nodes.json").read_text()
    assert not (state_dir / "nodes.json").exists(), "the sub-verb's --state-dir was ignored"
    r = criuctl("node", "ls", "--state-dir", str(other))
    assert r.returncode == 0 and "http://127.0.0.1:9" in r.stdout, r.stderr
    r = criuctl("node", "--state-dir", str(other), "ls")  # before the sub-verb, as before
    assert r.returncode == 0 and "http://127.0.0.1:9" in r.stdout, r.stderr
    assert criuctl("node", "rm", "x", "--state-dir", str(other)).returncode == 0
    assert "x" not in (other / "nodes.json").read_text()
