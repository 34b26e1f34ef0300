"""Memory pages straight into the target's CRIU page server (issue 25, item 1): the dump sends them
over CRIU's TLS, pinned to certificates made for this one migration; the source writes none of them;
the manifest signs how many went and over which session; the target restores them only with its own
page server's word for them (`bundle.Vouched`). Real CRIU, a real PyTorch job with DataLoader
workers, a thread and a log file.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from criuctl.core import statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.local import checkpoint
from criuctl.net import directpages, pagetls
from tests.jobs import Job, Reference, assert_continues_exactly, criuctl, reference_and_job
from tests.requirements import needs

ARGS = ("--steps", "60", "--workers", "2", "--read-latency", "0.01")  # ~0.2 s a step
# the restore a target's handoff does with its page server's voucher, as a command of its own (the
# restored tree is its child, which it supervises, as `criuctl restore` does)
RESTORE = """
import json, sys
from pathlib import Path
from criuctl.format import bundle
from criuctl.local import restoring
v = json.loads(Path(sys.argv[2]).read_text())
sys.exit(restoring.restore(Path(sys.argv[1]), vouched=bundle.Vouched(**v) if v else None))
"""


class Ends:
    """The two ends of one migration's page session, on this host (127.0.0.1)."""

    def __init__(self, root: Path) -> None:
        self.src = pagetls.make_identity(root / "src", "source")
        self.dst = pagetls.make_identity(root / "dst", "target")
        self.src_pin, _ = pagetls.pin(root / "src", "target", self.dst.pem)
        self.dst_pin, _ = pagetls.pin(root / "dst", "source", self.src.pem)
        self.bundle = root / "target-bundle"
        (self.bundle / bundle.IMAGES_DIR).mkdir(parents=True)
        self.rx = directpages.PageReceiver(
            "127.0.0.1", self.bundle / bundle.IMAGES_DIR, root / "rx", pagetls.tls(self.dst, self.dst_pin)
        )
        self.port = self.rx.listen()

    def pages_to(self, identity: pagetls.Identity | None = None) -> criu.PagesTo:
        return criu.PagesTo("127.0.0.1", self.port, pagetls.tls(identity or self.src, self.src_pin))


def _freeze_into(ends: Ends, name: str, parent: Path, identity: pagetls.Identity | None = None):
    """Freeze `name` with its pages going to `ends`' page server: (Frozen or the error, Received or
    the error)."""
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(ends.rx.receive, 30, 120)
        try:
            frozen: object = checkpoint.freeze(name, parent, pages_to=ends.pages_to(identity))
        except CriuctlError as exc:
            frozen = exc
        try:
            received: object = got.result(150)
        except CriuctlError as exc:
            received = exc
    return frozen, received


@needs("criu")
def test_pages_go_straight_to_the_target_and_the_job_continues_bit_identically(tmp_path):
    ref, job, log = reference_and_job(tmp_path, "train_cnn_loader.py", *ARGS)
    ends = Ends(tmp_path)
    frozen, received = _freeze_into(ends, "cnn", tmp_path)
    assert isinstance(frozen, checkpoint.Frozen), frozen
    assert isinstance(received, directpages.Received), received
    before = dict(job.steps)
    # the source wrote no page of memory; the target's page server wrote all of them
    source_images = sorted(p.name for p in frozen.images_dir.iterdir())
    assert not [n for n in source_images if n.startswith(("pages-", "pagemap-"))], source_images
    m = frozen.manifest
    assert m.direct_pages is not None and m.direct_pages.pages == received.pages
    assert received.pages * 4096 == received.page_bytes > 50 << 20  # torch, the model, Adam, 3 processes
    assert m.direct_pages.source_cert == ends.src.fingerprint != m.direct_pages.target_cert
    # the rest of the bundle goes as the agents' stream carries it
    for p in frozen.bundle_dir.rglob("*"):
        if p.is_file():
            (ends.bundle / p.relative_to(frozen.bundle_dir)).parent.mkdir(exist_ok=True)
            shutil.copy2(p, ends.bundle / p.relative_to(frozen.bundle_dir))
    vouched = received.vouched(ends.src.fingerprint, ends.dst.fingerprint)
    key = bundle.load_key(statedir.key_path())
    assert bundle.verify(ends.bundle, key, vouched=vouched).direct_pages == m.direct_pages
    # nobody else can vouch for those pages: a copy of the bundle does not restore anywhere
    r = criuctl("restore", str(ends.bundle))
    assert r.returncode != 0 and "only the agent which ran it can vouch" in r.stderr, r.stderr
    frozen.commit(workloads.CHECKPOINTED)  # the source's tree ends, as once the target has committed
    assert job.wait(60) == 0 and any("checkpointed" in line for line in job.err), job.err[-5:]
    voucher = tmp_path / "voucher.json"
    voucher.write_text(json.dumps(asdict(vouched)))
    restored = Job([sys.executable, "-c", RESTORE, str(ends.bundle), str(voucher)])
    assert restored.wait(300) == 0, restored.err[-10:]
    assert_continues_exactly(ref, before, restored)
    lines = log.read_text().splitlines()
    logged = [int(x.split()[1]) for x in lines if x.startswith("step ")]
    assert logged == list(range(60)) and lines[-1] == "done", "the log the job holds open lost a step"


@needs("criu")
def test_a_stranger_on_the_page_session_is_refused_and_the_job_runs_on_whole(tmp_path):
    """The page server takes only the certificate made for this migration's source: a dump that
    presents another (another node's, an attacker's) fails in the handshake, before any page; the
    job is thawed at once and finishes exactly as if never touched."""
    ref = Reference("ref", "train_cnn_loader.py", *ARGS, "--log", str(tmp_path / "ref.log"))
    job = Job.run("cnn", "train_cnn_loader.py", *ARGS, "--log", str(tmp_path / "train.log"))
    job.wait_for_step(5)
    ends = Ends(tmp_path)
    stranger = pagetls.make_identity(tmp_path / "stranger", "source")
    frozen, received = _freeze_into(ends, "cnn", tmp_path, stranger)
    assert isinstance(frozen, criu.CriuError), frozen
    assert isinstance(received, criu.CriuError) and "refused the sender's certificate" in received.what
    assert not list((ends.bundle / bundle.IMAGES_DIR).glob("pages-*.img")), "a page arrived"
    assert not list(tmp_path.glob(".cnn.partial-*")), "the failed dump left its staging folder"
    assert job.wait(300) == 0, job.err[-10:]
    assert job.steps == ref.steps and job.final == ref.final


@needs("criu")
def test_a_source_that_never_comes_is_given_up_and_an_abort_ends_the_wait(tmp_path):
    ends = Ends(tmp_path)
    started = time.monotonic()
    with pytest.raises(CriuctlError, match="did not reach this node's page server in 1 s"):
        ends.rx.receive(1, 10)
    assert time.monotonic() - started < 5
    again = Ends(tmp_path / "again")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(again.rx.receive, 60, 10)
        time.sleep(0.2)
        again.rx.close()
        with pytest.raises(CriuctlError, match="closed before the source connected"):
            waiting.result(10)


@pytest.mark.parametrize(
    "pem",
    [
        None,
        42,
        "",
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----",
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----",
        "x" * (pagetls.MAX_PEM + 1),
    ],
    ids=["null", "number", "empty", "garbage", "a-key", "huge"],
)
def test_what_is_not_one_certificate_is_refused_as_the_peers(tmp_path, pem):
    with pytest.raises(pagetls.PeerCertError, match="the target's page-server certificate"):
        pagetls.pin(tmp_path, "target", pem)
    assert not (tmp_path / "target.crt").exists()


def test_two_certificates_in_one_are_refused_and_one_is_pinned_root_only(tmp_path):
    a = pagetls.make_identity(tmp_path / "a", "a")
    b = pagetls.make_identity(tmp_path / "b", "b")
    with pytest.raises(pagetls.PeerCertError, match="not one PEM certificate"):
        pagetls.pin(tmp_path / "pin", "source", a.pem + b.pem)
    path, digest = pagetls.pin(tmp_path / "pin", "source", a.pem)
    assert digest == a.fingerprint != b.fingerprint
    for p in (path, a.key, a.cert):
        assert p.stat().st_mode & 0o077 == 0, f"{p} is readable by others"
    assert (tmp_path / "a").stat().st_mode & 0o077 == 0


def _bundle_with_direct_pages(root: Path, key: bytes) -> tuple[Path, bundle.Vouched]:
    """A sealed bundle whose manifest says 3 pages came straight to the target, and those pages'
    files (not covered by the signature) as a page server would have written them."""
    b = root / "b"
    (b / bundle.IMAGES_DIR).mkdir(parents=True)
    (b / bundle.IMAGES_DIR / "core-1.img").write_bytes(b"core")
    m = bundle.Manifest(
        workload="w",
        command=["python"],
        processes=[],
        open_files=[],
        uses_gpu=False,
        criu_version="4.2.1",
        direct_pages=bundle.DirectPages(pages=3, source_cert="a" * 64, target_cert="b" * 64),
    )
    bundle.seal(b, m, key, durable=False)
    files = {}
    for name, data in (("pagemap-1.img", b"map"), ("pages-1.img", b"\0" * 3 * 4096)):
        (b / bundle.IMAGES_DIR / name).write_bytes(data)
        files[f"{bundle.IMAGES_DIR}/{name}"] = bundle.file_digest(b / bundle.IMAGES_DIR / name)
    return b, bundle.Vouched(files, 3, "a" * 64, "b" * 64)


def test_direct_pages_restore_only_with_their_voucher_for_that_session_and_count(tmp_path):
    key = b"k" * 32
    b, vouched = _bundle_with_direct_pages(tmp_path, key)
    assert bundle.verify(b, key, vouched=vouched).direct_pages.pages == 3

    def refused(v: bundle.Vouched | None, why: str) -> None:
        with pytest.raises(bundle.BundleError, match=why):
            bundle.verify(b, key, vouched=v)
        assert not bundle.check(b, key, vouched=v).ok

    refused(None, "only the agent which ran it can vouch")
    refused(replace(vouched, source_cert="c" * 64), "another TLS session")
    refused(replace(vouched, target_cert="c" * 64), "another TLS session")
    refused(replace(vouched, pages=2), "2 pages arrived where the source sent 3")
    extra = b / bundle.IMAGES_DIR / "pages-2.img"
    extra.write_bytes(b"\0" * 4096)  # a page image nobody's page server wrote
    refused(vouched, "pages-2.img: not written by this node's page server")
    extra.unlink()
    (b / bundle.IMAGES_DIR / "pagemap-1.img").unlink()
    refused(vouched, "pagemap-1.img: missing")


def test_a_voucher_for_a_bundle_that_names_no_direct_pages_is_refused(tmp_path):
    key = b"k" * 32
    b = tmp_path / "plain"
    (b / bundle.IMAGES_DIR).mkdir(parents=True)
    (b / bundle.IMAGES_DIR / "pages-1.img").write_bytes(b"\0" * 4096)
    m = bundle.Manifest(
        workload="w", command=["python"], processes=[], open_files=[], uses_gpu=False, criu_version="4.2.1"
    )
    bundle.seal(b, m, key, durable=False)
    bundle.verify(b, key)  # an ordinary bundle: its pages are signed
    with pytest.raises(bundle.BundleError, match="does not name"):
        bundle.verify(b, key, vouched=bundle.Vouched({}, 0, "a" * 64, "b" * 64))
