"""Pure pieces, without processes: request building, hints, bundle sealing and verification."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import os
import stat
import tarfile
from pathlib import Path

import blake3
import pytest

from criuctl.agent import transfer
from criuctl.cli import cliargs, main
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.format.bundle import Manifest, ProcessInfo
from tests.requirements import installed_criu, missing, needs

pytestmark = needs("pycriu")
if missing("pycriu") is None:
    import pycriu


def test_dump_request_carries_every_option(tmp_path):
    o = criu.DumpOptions(
        pid=42,
        images_dir=tmp_path,
        work_dir=tmp_path,
        leave_stopped=True,
        tcp_established=True,
        ext_unix_sk=True,
        file_locks=True,
        external=["mnt[/data]:data"],
    )
    req = criu.build_dump_request(o, images_fd=7)
    assert (req.pid, req.images_dir_fd, req.leave_stopped, req.leave_running) == (42, 7, True, False)
    assert req.tcp_established and req.ext_unix_sk and req.file_locks
    assert req.network_lock == pycriu.rpc.NFTABLES and req.ghost_limit == 1 << 30
    assert list(req.external) == ["mnt[/data]:data"]


def test_restore_request_maps_inherited_fds(tmp_path):
    o = criu.RestoreOptions(
        images_dir=tmp_path, work_dir=tmp_path, inherit_fds={"pipe:[11]": 5, "pipe:[12]": 6}
    )
    req = criu.build_restore_request(o)
    assert req.rst_sibling
    assert {(f.key, f.fd) for f in req.inherit_fd} == {("pipe:[11]", 5), ("pipe:[12]", 6)}


@pytest.mark.parametrize(
    ("log", "expect"),
    [
        ("Error (criu/sockets.c:683): Can't get 1:16 opt: Operation not supported", "kernels >= 6.16"),
        ("Error (criu/image.c:1): write: No space left on device", "disk full"),
        ("Error (criu/files-reg.c:2175): File /x has bad size 10 (expect 20)", "changed size"),
        ("Error (criu/vdso.c:1): vdso: Unexpected rt vDSO area bounds", "vDSO"),
        (
            "Error (criu/files-reg.c:2190): Can't open file srv/data/shard-3.bin on restore: "
            "No such file or directory",
            "missing on this host: /srv/data/shard-3.bin",
        ),
        ("something nobody has seen", "CRIU failed"),
    ],
)
def test_hints_name_the_cause(log, expect):
    what, hint = criu.hint_for(log)
    assert expect in what and hint


@pytest.mark.parametrize(
    ("criu_version", "release", "needs"),
    [
        ((4, 1, 1), "6.15.9", []),
        ((4, 1, 1), "6.18.44-fc-v1147", [(4, 2, 0)]),
        ((4, 2, 0), "6.18.44-fc-v1147", []),
        ((4, 2, 0), "7.1.0-rc3", [(4, 2, 1)]),
        ((4, 1, 1), "7.2.1", [(4, 2, 0), (4, 2, 1)]),
        ((4, 2, 1), "7.2.1", []),
        ((4, 3, 0), "10.0", []),
    ],
)
def test_a_criu_that_lacks_what_the_kernel_needs_is_named(criu_version, release, needs):
    """The version floor alone passes a CRIU that cannot dump a TCP socket on this kernel: the
    kernel's own floor says it (and the install script builds the release past both)."""
    kernel = criu.kernel_release(release)
    assert [f.criu for f in criu.missing_fixes(criu_version, kernel)] == needs
    installed = installed_criu()
    floor = tuple(int(x) for x in installed.split("."))
    assert not criu.missing_fixes(floor, kernel), f"install-criu.sh's CRIU {installed} lacks a fix"


def test_doctor_names_the_release_a_kernel_needs(monkeypatch):
    from criuctl.cli import doctor

    monkeypatch.setattr(criu, "require_version", lambda: (4, 1, 1))
    monkeypatch.setattr(criu, "kernel_release", lambda: (7, 1))
    c = doctor._criu_version()
    assert not c.ok and "4.1.1" in c.detail and "kernel 7.1" in c.detail
    assert "SO_PASSCRED" in c.detail and "UDP-Lite" in c.detail
    assert c.fix == "install CRIU >= 4.2.1 with scripts/install-criu.sh"
    monkeypatch.setattr(criu, "require_version", lambda: (4, 2, 1))
    assert doctor._criu_version().ok


def test_doctor_says_when_criu_lacks_the_page_pull_patch(monkeypatch):
    from criuctl.cli import doctor

    monkeypatch.setattr(criu, "build", lambda: "")
    c = doctor._page_pull()
    assert not c.ok and not c.required and "one request at a time" in c.detail
    assert "scripts/install-criu.sh" in c.fix


@needs("criu")
def test_the_installed_criu_is_built_with_the_patches_in_the_repository():
    """install-criu.sh names its build after the patches' checksum: a CRIU built before a patch
    changed is built over, never taken for the current one."""
    patches = sorted((Path(__file__).resolve().parent.parent / "scripts/criu-patches").glob("*.patch"))
    assert patches
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in patches)).hexdigest()[:12]
    assert criu.build() == f"{criu.OUR_BUILD}{digest}"


def _manifest() -> Manifest:
    return Manifest(
        workload="w",
        command=["python", "t.py"],
        open_files=[],
        uses_gpu=False,
        criu_version="4.1.1",
        processes=[ProcessInfo(10, 1, 9, "python", ["python"], "/", 1 << 20, 1)],
    )


def test_seal_then_verify_and_what_is_refused(tmp_path):
    root = tmp_path / "b"
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(os.urandom(4096))
    (root / "dump.log").write_text("log")
    key = bundle.load_key(tmp_path / "key")
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600
    bundle.seal(root, _manifest(), key)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "images" / "pages-1.img").stat().st_mode) == 0o600
    m = bundle.verify(root, key)
    assert m.workload == "w" and set(m.files) == {"images/pages-1.img", "dump.log"} and m.rss_bytes == 1 << 20

    (root / "images" / "extra.img").write_bytes(b"x")
    with pytest.raises(bundle.BundleError, match=r"extra\.img: not listed"):
        bundle.verify(root, key)
    (root / "images" / "extra.img").unlink()
    (root / "dump.log").unlink()
    with pytest.raises(bundle.BundleError, match=r"dump\.log: missing"):
        bundle.verify(root, key)
    with pytest.raises(bundle.BundleError, match="signature does not verify"):
        bundle.verify(root, bundle.load_key(tmp_path / "other-key"))


def test_a_bundle_crosses_nodes_with_the_key_of_its_one_copy_and_is_then_the_receivers(tmp_path):
    """Node a's bundle goes to b signed with a key b gave for that copy (`signed_for`, streamed by
    `transfer.tar_pieces`); b checks it with that key and signs it with its own (`adopt`). Neither
    node's own key opens the other's bundles."""
    a_key, b_key, copy_key = (bundle.load_key(tmp_path / f"{n}.key") for n in ("a", "b", "copy"))
    root = tmp_path / "on-a"
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(os.urandom(8192))
    bundle.seal(root, _manifest(), a_key)
    raw, sig = bundle.signed_for(root, a_key, copy_key)
    assert raw == (root / bundle.MANIFEST).read_bytes() and sig != (root / bundle.SIGNATURE).read_bytes()

    async def stream() -> bytes:
        given = {bundle.MANIFEST: raw, bundle.SIGNATURE: sig}
        out = b"".join([p async for p in transfer.tar_pieces(root, given=given)])
        assert len(out) == transfer.stream_size(root, given)
        return out

    on_b = tmp_path / "on-b"
    with tarfile.open(fileobj=io.BytesIO(asyncio.run(stream()))) as tar:
        tar.extractall(on_b, filter="data")
    for wrong in (a_key, b_key):  # a's own signature, or b's, is not what the copy carries
        with pytest.raises(bundle.BundleError, match="signature does not verify"):
            bundle.verify(on_b, wrong)
    bundle.adopt(on_b, copy_key, b_key)
    assert bundle.verify(on_b, b_key).workload == "w"
    with pytest.raises(bundle.BundleError, match="signature does not verify"):
        bundle.verify(on_b, a_key)
    # a manifest altered on a after its seal goes nowhere: a checks its own signature first
    (root / bundle.MANIFEST).write_bytes(raw.replace(b'"w"', b'"x"'))
    with pytest.raises(bundle.BundleError, match="signature does not verify"):
        bundle.signed_for(root, a_key, copy_key)


def _format_1_bundle(root: Path, key: bytes) -> None:
    """A bundle as criuctl wrote it before format 2: sha256 digests, an HMAC-SHA256 signature."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(os.urandom(8192))
    m = _manifest()
    m.format_version = 1
    pages = (root / "images" / "pages-1.img").read_bytes()
    m.files = {"images/pages-1.img": hashlib.sha256(pages).hexdigest()}
    raw = m.to_json()
    (root / bundle.MANIFEST).write_bytes(raw)
    (root / bundle.SIGNATURE).write_text(hmac.new(key, raw, hashlib.sha256).hexdigest() + "\n")


def test_format_1_bundles_still_verify_and_formats_do_not_mix(tmp_path):
    key = bundle.load_key(tmp_path / "key")
    old = tmp_path / "old"
    _format_1_bundle(old, key)
    assert bundle.verify(old, key).format_version == 1
    # digests an agent computed with BLAKE3 as the stream arrived are not taken for sha256s
    assert bundle.verify(old, key, {"images/pages-1.img": "0" * 64}).format_version == 1
    with open(old / "images" / "pages-1.img", "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))  # a changed byte (a zero written could be the same one)
    with pytest.raises(bundle.BundleError, match=r"pages-1\.img: checksum mismatch"):
        bundle.verify(old, key)

    # a format-1 manifest under a format-2 MAC (or the reverse) is refused: the key fixes the format
    new = tmp_path / "new"
    (new / "images").mkdir(parents=True)
    (new / "images" / "pages-1.img").write_bytes(os.urandom(8192))
    sealed = bundle.seal(new, _manifest(), key)
    assert sealed.format_version == 2 and len(sealed.files["images/pages-1.img"]) == 64
    pages = (new / "images" / "pages-1.img").read_bytes()
    assert sealed.files["images/pages-1.img"] == blake3.blake3(pages).hexdigest()
    raw = (new / bundle.MANIFEST).read_bytes().replace(b'"format_version": 2', b'"format_version": 1')
    (new / bundle.MANIFEST).write_bytes(raw)
    (new / bundle.SIGNATURE).write_text(bundle._sign(key, raw, 2) + "\n")
    with pytest.raises(bundle.BundleError, match="signature does not verify"):
        bundle.verify(new, key)
    assert not bundle.check(new, key).signature_ok


def test_not_a_bundle_and_future_format(tmp_path):
    with pytest.raises(bundle.BundleError, match="no bundle at"):
        bundle.verify(tmp_path / "nope", b"k")
    (tmp_path / "d").mkdir()
    with pytest.raises(bundle.BundleError, match="not a criuctl bundle"):
        bundle.read_manifest(tmp_path / "d")
    (tmp_path / "d" / bundle.MANIFEST).write_bytes(
        _manifest().to_json().replace(b'"format_version": 2', b'"format_version": 99')
    )
    with pytest.raises(bundle.BundleError, match="format 99 is not supported"):
        bundle.read_manifest(tmp_path / "d")


def test_every_verb_the_parser_knows_has_a_command():
    assert list(main.COMMANDS) == list(cliargs.VERBS)
    assert main.parser().parse_args(["node", "ls"]).verb in main.COMMANDS


def test_the_image_tail_hashes_pages_as_they_are_written_and_the_seal_trusts_only_whole_files(tmp_path):
    """`imagetail` follows a page image while it grows; its digest is the file's. A file that changed
    size after the tail read it (or that it never saw) is hashed again by the seal."""
    import threading
    import time

    from criuctl.format import imagetail

    root = tmp_path / "b"
    images = root / "images"
    images.mkdir(parents=True)
    tail = imagetail.Tail(images).start()
    chunks = [os.urandom(1 << 20) for _ in range(6)]

    def criu() -> None:
        with open(images / "pages-1.img", "wb", buffering=0) as f:
            for c in chunks:
                f.write(c)
                time.sleep(0.02)
        (images / "pagemap-1.img").write_bytes(b"map")  # not a page image: the seal hashes it

    writer = threading.Thread(target=criu)
    writer.start()
    writer.join()
    known = tail.finish()
    assert known == {"images/pages-1.img": (blake3.blake3(b"".join(chunks)).hexdigest(), 6 << 20)}

    with open(images / "pages-1.img", "ab") as f:  # grew after the tail's last look: not trusted
        f.write(b"late")
    key = bundle.load_key(tmp_path / "key")
    m = bundle.seal(root, _manifest(), key, durable=False, known=known)
    assert m.files["images/pages-1.img"] == blake3.blake3(b"".join(chunks) + b"late").hexdigest()
    assert bundle.verify(root, key).files == m.files


def test_backoff_doubles_up_to_its_cap() -> None:
    from criuctl.core.retry import Backoff

    b = Backoff(cap=5.0)
    assert [b.next() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert Backoff(cap=0.5).next() == 0.5  # a cap below the first wait wins
