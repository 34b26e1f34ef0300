"""What a ticket proves and what a target's verdict proves, such that neither can be forged by
whatever answers at the target's address.

Before, the source sent the ticket's secret as a bearer token to whoever answered there, and the
target signed its verdicts with a key derived from that secret: whatever answered learned the key
and could sign "aborted" — the source thawed while the real target ran the job. Now:

- **The secret never leaves the source.** A request the ticket opens carries a proof instead
  (`proof`): a keyed BLAKE3 MAC, with a key derived from the secret, over the method, the path,
  the time and a fresh nonce. The target keeps that key (root-only, in its record) to check it;
  something else at the target's address learns a nonce and a MAC, which open nothing elsewhere
  (the path names this one migration) and expire (`WINDOW`).
- **A verdict is signed with a key only the target ever held.** The target makes an Ed25519 key
  pair for each migration as it mints the ticket; the private key stays in its record, the public
  key travels in the ticket (`Ticket.verify`). It signs (migration, state, its boot, the nonce of
  the question) — the nonce so that an old "aborted" replayed at a later question does not pass.
  The source, holding only the public key, can check a verdict and cannot make one; nor can
  another node with a valid certificate, a process on the target's address, or a man in the
  middle under `--insecure` who read every byte the source sent.

The public key comes to the source from the client, who had it from the target over the client's
own authenticated channel: what a man in the middle on *that* path could change is what the
agents' TLS is for (`--insecure` gives it up, and says so).
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from criuctl.agent.protocol import Ticket

SCHEME = "Criuctl-Ticket"
PROVEN = "criuctl.ticket-proven"  # where the agent's request keeps what the checked proof vouches for
WINDOW = 600.0  # seconds a proof is good for either side of the target's clock (nodes' clocks differ)
_PROOF_CONTEXT = "criuctl 2026-12 ticket proof"
_SEAL_CONTEXT = "criuctl 2026-12 move bundle seal"
_VERDICT_DOMAIN = b"criuctl 2026-12 migration verdict\n"


def new_secret() -> str:
    """A ticket's secret: 256 bits, for the source alone."""
    return secrets.token_urlsafe(32)


def proof_key(secret: str) -> str:
    """What the target keeps of a ticket's secret: it checks proofs, and signs nothing."""
    return blake3.blake3(secret.encode(), derive_key_context=_PROOF_CONTEXT).hexdigest()


def seal_key(secret: str) -> bytes:
    """The key the source seals this one move's bundle with, and the target checks it by: no
    node's own bundle key crosses to another node, and this one opens no other move's bundle."""
    return blake3.blake3(secret.encode(), derive_key_context=_SEAL_CONTEXT).digest()


def _mac(key: str, method: str, path: str, ts: int, nonce: str, body: str) -> str:
    said = f"{method}\n{path}\n{ts}\n{nonce}\n{body}".encode()
    return blake3.blake3(said, key=bytes.fromhex(key)).hexdigest()


def digest(body: bytes) -> str:
    return blake3.blake3(body).hexdigest()


@dataclass(frozen=True)
class Proven:
    """What a checked proof vouches for: its nonce, and the digest of the body it was made with
    ("" when it covers none: an upload, whose bytes the bundle's signature vouches for)."""

    nonce: str
    body: str

    def covers(self, raw: bytes) -> bool:
        """Whether the request's body is the one the ticket's holder sent (a man in the middle
        under `--insecure` cannot swap a certificate in it)."""
        return bool(self.body) and hmac.compare_digest(self.body, digest(raw))


def proof(ticket: Ticket, method: str, path: str, body: bytes | None = None) -> tuple[str, str]:
    """(the Authorization header's value, its nonce) for one request `method path` the ticket
    opens; with `body`, the proof covers it too."""
    ts, nonce = int(time.time()), secrets.token_hex(16)
    covered = "" if body is None else digest(body)
    mac = _mac(proof_key(ticket.secret), method, path, ts, nonce, covered)
    return f"{SCHEME} ts={ts},nonce={nonce},body={covered},mac={mac}", nonce


def checked_proof(header: str, key: str, method: str, path: str, now: float | None = None) -> Proven | None:
    """What a proof that `key` made for exactly this request within `WINDOW` vouches for; None
    for anything else."""
    if not key or not header.startswith(SCHEME + " "):
        return None
    parts = dict(p.partition("=")[::2] for p in header[len(SCHEME) + 1 :].split(","))
    ts, nonce, body, mac = (parts.get(k, "") for k in ("ts", "nonce", "body", "mac"))
    if not (ts.isdigit() and len(ts) < 12 and 16 <= len(nonce) <= 64 and nonce.isalnum() and len(mac) == 64):
        return None
    if body and not (len(body) == 64 and body.isalnum()):
        return None
    if abs((time.time() if now is None else now) - int(ts)) > WINDOW:
        return None
    if not hmac.compare_digest(_mac(key, method, path, int(ts), nonce, body), mac):
        return None
    return Proven(nonce, body)


def new_signer() -> tuple[str, str]:
    """(private, public) hex of a fresh Ed25519 key pair: the target's for one migration."""
    k = Ed25519PrivateKey.generate()
    return k.private_bytes_raw().hex(), k.public_key().public_bytes_raw().hex()


class SignedState(TypedDict):
    """The target's answer about one migration (`GET`/`DELETE /v1/incoming/ID`), which a source may
    act on once `checked_state` finds it signed for its own question."""

    state: str
    migration: str
    boot: str
    nonce: NotRequired[str]  # the question's (absent: asked with the node's token, not a ticket)
    sig: NotRequired[str]  # absent for a record made before verdicts were signed this way


def _said(migration: str, state: str, boot: str, nonce: str) -> bytes:
    return _VERDICT_DOMAIN + f"{migration}\n{state}\n{boot}\n{nonce}".encode()


def signed_state(key: str, migration: str, state: str, boot: str, nonce: str = "") -> SignedState:
    """What the target answers about a migration: its state, signed over the question's nonce
    (unsigned, hence worth nothing to a source, for a record that has no key)."""
    out: SignedState = {"state": state, "migration": migration, "boot": boot, "nonce": nonce}
    if key:
        sig = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(key)).sign(
            _said(migration, state, boot, nonce)
        )
        out["sig"] = sig.hex()
    return out


def _cert_said(migration: str, nonce: str, pem: str) -> bytes:
    return _VERDICT_DOMAIN + f"page-server certificate\n{migration}\n{nonce}\n{digest(pem.encode())}".encode()


def signed_cert(key: str, migration: str, nonce: str, pem: str) -> str:
    """The target's signature over the certificate its page session shows, for the question with
    `nonce`: the source pins only a certificate the target itself vouched for."""
    return (
        Ed25519PrivateKey.from_private_bytes(bytes.fromhex(key)).sign(_cert_said(migration, nonce, pem)).hex()
    )


def _verified(ticket: Ticket, sig: object, said: bytes) -> bool:
    """Whether `sig` is the target's signature over `said`, by the key in the ticket."""
    if not ticket.verify or not isinstance(sig, str):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(ticket.verify)).verify(bytes.fromhex(sig), said)
    except (ValueError, InvalidSignature):
        return False
    return True


def checked_cert(ticket: Ticket, nonce: str, pem: str, sig: object) -> bool:
    return _verified(ticket, sig, _cert_said(ticket.incoming, nonce, pem))


def checked_state(ticket: Ticket, answer: object, nonce: str) -> str | None:
    """The state in a target's answer to the question with `nonce` about the ticket's migration if
    the target's key signed it; None for anything else (no answer, another migration or question,
    a 404 page, a forgery, a ticket with no key to check it by)."""
    if not isinstance(answer, dict):
        return None
    state, migration, boot, sig = (answer.get(k) for k in ("state", "migration", "boot", "sig"))
    if not (isinstance(state, str) and isinstance(migration, str) and isinstance(boot, str)):
        return None
    if migration != ticket.incoming or not _verified(ticket, sig, _said(migration, state, boot, nonce)):
        return None
    return state
