"""Hostile input to the two readers that take files from elsewhere: the bundle reader and the tar
stream an agent receives. Whatever the bytes, each either works or raises criuctl's own error (one
line for the user), and nothing is written outside its folder.

Hypothesis generates the input; runs are kept short (a few hundred examples, no deadline: the
machine may be loaded) so the whole file takes seconds. No database: the tree is shared, and a
failure prints the example that reproduces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criuctl.agent import receiver, transfer
from criuctl.cli import render
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
KEY = bytes(range(32))

# ------------------------------------------------------------------------------------ strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
hostile_names = st.sampled_from(
    [
        "../x",
        "../../outside",
        "/etc/criuctl-fuzz",
        "/x",
        "a/../../x",
        "images/../../x",
        ".",
        "",
        "./",
        "a/",
        "a//b",
        "./a",
        "x" * 300,
        ("d" * 200 + "/") * 3 + "f",
        "a\x00b",
        "é/ü",
        "manifest.json",
        "manifest.sig",
        "images",
        "images/pages-1.img",
        "images/pages-1.img/sub",
        "..",
        "...",
        "a\nb",
        "dump.log",
    ]
) | st.text(max_size=40)


def _sealed(root: Path) -> bundle.Manifest:
    """A small real bundle: two image files and a log, sealed with KEY."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(b"p" * 3000)
    (root / "images" / "core-1.img").write_bytes(b"core")
    (root / "dump.log").write_text("log\n")
    m = bundle.Manifest(
        workload="w",
        command=["python", "train.py"],
        processes=[bundle.ProcessInfo(100, 1, 0, "python", ["python", "train.py"], "/", 4096, 2)],
        open_files=["/tmp/x"],
        uses_gpu=False,
        criu_version="4.1.1",
    )
    return bundle.seal(root, m, KEY)


@functools.cache
def _sealed_json() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return _sealed(Path(d) / "b").to_json()


def _sealed_data() -> dict:
    return json.loads(_sealed_json())  # a fresh copy to change


def _sign(raw: bytes) -> bytes:
    return bundle._sign(KEY, raw).encode() + b"\n"


@st.composite
def manifests(draw) -> bytes:
    """Manifest bytes: random bytes, any JSON value, or a real manifest with one thing changed."""
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "mutated", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    data = _sealed_data()
    field = draw(st.sampled_from([*data, "processes.0", "files.key", "extra"]))
    how = draw(st.sampled_from(["replace", "delete"]))
    if field == "processes.0":
        proc = data["processes"][0]
        key = draw(st.sampled_from(list(proc)))
        if how == "delete":
            del proc[key]
        else:
            proc[key] = draw(json_values)
    elif field == "files.key":
        data["files"][draw(hostile_names)] = draw(st.sampled_from(["0" * 64, "x", ""]))
    elif field == "extra":
        data[draw(st.text(max_size=10))] = draw(json_values)
    elif how == "delete":
        del data[field]
    else:
        data[field] = draw(json_values | st.integers(min_value=2**63, max_value=2**70))
    return json.dumps(data).encode()


@st.composite
def damaged_bundles(draw) -> dict:
    return {
        "manifest": draw(st.none() | manifests()),  # None: keep the sealed one
        "signature": draw(st.sampled_from(["resign", "keep", "missing", "garbage", "folder", "binary"])),
        "garbage": draw(st.binary(max_size=80)),
        "files": draw(
            st.lists(
                st.sampled_from(["delete", "extra", "flip", "symlink-out", "folder", "fifo"]),
                max_size=3,
                unique=True,  # two flips would undo each other
            )
        ),
    }


def _apply(root: Path, outside: Path, d: dict) -> None:
    raw = d["manifest"] if d["manifest"] is not None else (root / bundle.MANIFEST).read_bytes()
    (root / bundle.MANIFEST).write_bytes(raw)
    sig = root / bundle.SIGNATURE
    match d["signature"]:
        case "resign":  # a key holder signed it: the parser, not the signature, must catch it
            sig.write_bytes(_sign(raw))
        case "missing":
            sig.unlink()
        case "garbage":
            sig.write_bytes(d["garbage"])
        case "binary":
            sig.write_bytes(b"\xff\xfe" + _sign(raw))
        case "folder":
            sig.unlink()
            sig.mkdir()
    img = root / "images" / "pages-1.img"
    for change in d["files"]:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, FileExistsError):
            match change:
                case "delete":
                    img.unlink()
                case "extra":
                    (root / "images" / "planted.img").write_bytes(b"x")
                case "flip" if img.is_file() and not img.is_symlink():  # not through a link, not a fifo
                    data = bytearray(img.read_bytes())
                    data[0] ^= 1
                    img.write_bytes(bytes(data))
                case "symlink-out":
                    img.unlink()
                    img.symlink_to(outside)
                case "folder":
                    img.unlink()
                    img.mkdir()
                case "fifo":
                    img.unlink()
                    os.mkfifo(img)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(root).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")
    }


@contextlib.contextmanager
def _box() -> Iterator[tuple[Path, Path]]:
    """A folder for one example, and a file outside the folder under test that must stay as it is."""
    with tempfile.TemporaryDirectory() as d:
        box = Path(d)
        outside = box / "outside.txt"
        outside.write_text("secret\n")
        yield box, outside


# ------------------------------------------------------------------------------------ the bundle


@FUZZ
@given(damaged_bundles())
def test_bundle_reader_on_damaged_bundles(state_dir, d):
    with _box() as (box, outside):
        root = box / "b"
        _sealed(root)
        _apply(root, outside, d)
        before = _snapshot(box)
        outcomes = {}
        for name, read in [
            ("read_manifest", lambda: bundle.read_manifest(root)),
            ("check", lambda: bundle.check(root, KEY)),
            ("verify", lambda: bundle.verify(root, KEY)),
            ("inspect-json", lambda: render.inspect(root, as_json=True)),
            ("inspect-text", lambda: render.inspect(root, as_json=False)),
        ]:
            try:
                outcomes[name] = read()
            except CriuctlError as exc:  # the one failure a user may see: one line
                assert "\n" not in exc.line(), exc.line()
                outcomes[name] = exc
        assert _snapshot(box) == before, "a reader wrote something"
        assert outside.read_text() == "secret\n"
        verified = outcomes["verify"]
        if isinstance(verified, bundle.Manifest):  # only a bundle that is exactly right verifies
            assert d["signature"] in ("resign", "keep") and not d["files"], d
            assert (root / bundle.SIGNATURE).read_bytes().strip() == _sign(
                (root / bundle.MANIFEST).read_bytes()
            ).strip()
            assert all(isinstance(p, bundle.ProcessInfo) for p in verified.processes)
            assert all(isinstance(v, str) for v in verified.command)
            assert all(".." not in Path(rel).parts and not rel.startswith("/") for rel in verified.files)
            assert not (outcomes["check"].bad_files or not outcomes["check"].signature_ok)


def test_verify_parses_the_bytes_it_checked_once(tmp_path, monkeypatch):
    """manifest.json is opened once by verify: a swap after the signature check cannot be read."""
    root = tmp_path / "b"
    _sealed(root)
    opened: list[str] = []
    real_open = Path.open

    def counting_open(self, *a, **kw):
        if self.name == bundle.MANIFEST:
            opened.append(str(self))
        return real_open(self, *a, **kw)

    monkeypatch.setattr(Path, "open", counting_open)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read_bytes({self})"))
    monkeypatch.setattr(Path, "read_text", lambda self, *a: pytest.fail(f"read_text({self})"))
    assert bundle.verify(root, KEY).workload == "w"
    assert opened == [str(root / bundle.MANIFEST)]


# ------------------------------------------------------------------------------ the tar stream

TYPES = [
    tarfile.REGTYPE,
    tarfile.AREGTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.DIRTYPE,
    tarfile.CHRTYPE,
    tarfile.FIFOTYPE,
    tarfile.XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    b"Z",
]


@st.composite
def tar_entries(draw) -> bytes:
    """One tar record: a header (maybe with a hostile name, type, size, or bytes) and its data."""
    info = tarfile.TarInfo(draw(hostile_names | st.sampled_from(["images/a.img", "manifest.json"])))
    info.type = draw(st.sampled_from(TYPES))
    info.linkname = draw(st.sampled_from(["", "/etc/passwd", "../../outside.txt", "images/a.img"]))
    data = draw(st.binary(max_size=1500))
    info.size = draw(
        st.sampled_from([len(data), len(data)])
        | st.integers(0, 4000)
        | st.sampled_from([8 << 30, 0o77777777777])
    )
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    try:
        header = info.tobuf(format=fmt, encoding="utf-8", errors="surrogateescape")
    except (ValueError, UnicodeError):
        header = info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape")
    header = bytearray(header)
    tweak = draw(st.sampled_from(["none", "none", "negative-size", "flip", "flip-resum"]))
    last = len(header) - tarfile.BLOCKSIZE  # the entry's own header (after any long-name records)
    if tweak == "negative-size":  # base-256: the top bit set and all ones is -1
        header[last + 124 : last + 136] = b"\xff" * 12
        _resum(header, last)
    elif tweak.startswith("flip"):
        at = draw(st.integers(0, tarfile.BLOCKSIZE - 1))
        header[last + at] = draw(st.integers(0, 255))
        if tweak == "flip-resum":
            _resum(header, last)
    return bytes(header) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def _resum(header: bytearray, at: int) -> None:
    """Recompute a header's checksum, so the hostile fields get past it to the parser."""
    block = header[at : at + tarfile.BLOCKSIZE]
    block[148:156] = b" " * 8
    header[at + 148 : at + 156] = b"%06o\x00 " % sum(block)


def _record(name: str, data: bytes) -> bytes:
    """A well-formed tar record, as an agent sends it."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


@st.composite
def tar_streams(draw) -> bytes:
    good = draw(st.booleans())
    stream = _record("images/ok.img", b"p" * draw(st.integers(0, 600))) if good else b""
    for entry in draw(st.lists(tar_entries(), min_size=1, max_size=3)):
        stream += entry
    stream += bytes(2 * tarfile.BLOCKSIZE)
    cut = draw(st.none() | st.integers(0, len(stream)))
    return stream if cut is None else stream[:cut]


def _receive(stream: bytes, dest: Path, piece: int) -> dict[str, str]:
    src = io.BytesIO(stream)

    async def read(n: int) -> bytes:
        return src.read(min(n, piece))

    async def bounded() -> dict[str, str]:
        return await asyncio.wait_for(receiver.receive(read, dest), 10)  # a loop that spins fails

    return asyncio.run(bounded())


def _receive_safely(stream: bytes, piece: int) -> None:
    """Whatever the stream, the receiver writes only plain files inside its folder, and the digests
    it returns are those files' — or it refuses with one TransferError line."""
    with _box() as (box, outside):
        dest = box / "in"
        try:
            digests = _receive(stream, dest, piece)
        except CriuctlError as exc:
            assert isinstance(exc, transfer.TransferError), exc
            assert "\n" not in exc.line(), exc.line()
            digests = None
        assert sorted(p.name for p in box.iterdir()) == ["in", "outside.txt"], "wrote outside its folder"
        assert outside.read_text() == "secret\n"
        for p in dest.rglob("*"):
            assert not p.is_symlink(), f"planted a link: {p}"
            assert p.is_dir() or p.is_file(), f"made something that is not a file: {p}"
            assert p.resolve().is_relative_to(dest.resolve())
        for rel, digest in (digests or {}).items():
            assert not rel.startswith("/") and ".." not in rel.split("/")
            assert bundle.file_digest(dest / rel) == digest


@FUZZ
@given(tar_streams(), st.sampled_from([1, 7, 512, 4096, 1 << 20]))
def test_tar_stream_reader_on_hostile_streams(stream, piece):
    _receive_safely(stream, piece)


_D = receiver.DATA


def _rec(kind: bytes, name: str, offset: int, data: bytes, length: int | None = None) -> bytes:
    """One record of a live (record) stream, as `livesend` frames it; `length` may lie."""
    raw = name.encode()
    return receiver.RECORD.pack(kind, len(raw), offset, len(data) if length is None else length) + raw + data


@st.composite
def record_streams(draw) -> bytes:
    """A record stream: good appends, then hostile records (bad names, offsets, kinds, lengths)."""
    stream = receiver.MAGIC
    sizes: dict[str, int] = {}
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(["images/pages-1.img", "images/core-1.img", "manifest.json"]))
        data = draw(st.binary(max_size=300))
        stream += _rec(receiver.DATA, name, sizes.get(name, 0), data)
        sizes[name] = sizes.get(name, 0) + len(data)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from([receiver.DATA, receiver.KEEPALIVE, b"X", b"\0"]))
        names = ["images/pages-1.img", "../evil", "/etc/evil", "", "a/../../b", "images"]
        name = draw(st.sampled_from(names))
        offset = draw(st.integers(0, 1 << 40))
        length = draw(st.none() | st.integers(0, (1 << 32) - 1))
        stream += _rec(kind, name, offset, draw(st.binary(max_size=50)), length)
    if draw(st.booleans()):
        stream += _rec(receiver.END, "", 0, b"")
    cut = draw(st.none() | st.integers(0, len(stream)))
    return stream if cut is None else stream[:cut]


@FUZZ
@given(record_streams(), st.sampled_from([1, 7, 512, 1 << 20]))
def test_record_stream_reader_on_hostile_streams(stream, piece):
    _receive_safely(stream, piece)


@pytest.mark.parametrize(
    ("records", "why"),
    [
        ([(_D, "images/a.img", 0, b"ab"), (_D, "images/a.img", 5, b"c")], "at offset 5"),
        ([(_D, "images/a.img", 0, b"ab"), (_D, "images/a.img", 0, b"c")], "at offset 0"),
        ([(receiver.DATA, "images/a.img", 3, b"x")], "at offset 3"),
        ([(receiver.DATA, "../../outside.txt", 0, b"x")], "refused a bundle stream with the path"),
        ([(b"X", "images/a.img", 0, b"x")], "unknown kind"),
        ([(receiver.DATA, "images/a.img", 0, b"")], "broke off"),  # no END: the sender stopped midway
    ],
)
def test_record_stream_cases(tmp_path, records, why):
    stream = receiver.MAGIC + b"".join(_rec(*r) for r in records)
    with pytest.raises(transfer.TransferError, match=why):
        _receive(stream, tmp_path / "in", 4096)


def test_a_record_larger_than_allowed_is_refused_before_reading_it(tmp_path):
    stream = receiver.MAGIC + _rec(receiver.DATA, "images/a.img", 0, b"", receiver.MAX_RECORD + 1)
    with pytest.raises(transfer.TransferError, match="unknown kind or size"):
        _receive(stream, tmp_path / "in", 4096)


@pytest.mark.parametrize(
    ("name", "kind", "why"),
    [
        ("images/a.img", "negative-size", "of size -1"),
        ("images", "under-a-file", "cannot create it"),
        ("images/a.img", "twice", "cannot create it"),
        ("../../outside.txt", "plain", "refused a bundle stream with the path"),
    ],
)
def test_tar_stream_cases_that_crashed_or_spun(tmp_path, name, kind, why):
    """The fuzzer's finds, kept as plain cases: each is a TransferError now."""

    record = _record
    if kind == "negative-size":
        header = bytearray(record(name, b""))
        header[124:136] = b"\xff" * 12
        _resum(header, 0)
        stream = bytes(header)
    elif kind == "under-a-file":
        stream = record(name, b"file") + record(f"{name}/a.img", b"x")
    elif kind == "twice":
        stream = record(name, b"1") + record(name, b"2")
    else:
        stream = record(name, b"x")
    with pytest.raises(transfer.TransferError, match=why):
        _receive(stream + bytes(1024), tmp_path / "in", 4096)
