"""Something else listening at an agent's address, to see what a source does with an answer that is
not the target's own signed word.

`python -m tests.impostor PORT STATUS BODY_JSON [CERT KEY]` answers every request with one status and
body (a 404 page, an unsigned "aborted"). `python -m tests.impostor PORT forge [CERT KEY]` answers
"aborted" forged from everything the request gave it (`forged`): the migration id from the path,
the nonce of the ticket's proof, a signature by a key of its own, and — for a source that still
sends the ticket's secret — a MAC keyed as the target's used to be, from that secret. Run inside a
node's network namespace in place of its agent (killed). With CERT and KEY it speaks TLS with them:
a certificate the source accepts for that address (the cluster's shared one, or the node's own
stolen) gets it past TLS, and only the verdict's signature can then tell.
`server(...)` is the same in a test's own process.
"""

from __future__ import annotations

import http.server
import json
import ssl
import sys
from collections.abc import Callable, Mapping

import blake3

from criuctl.agent import tickets

Respond = Callable[[str, str, Mapping[str, str]], tuple[int, bytes]]

# the key derivation of the verdicts before `criuctl.agent.tickets`: what a thing that learned the
# ticket's secret could sign with then
_OLD_VERDICT_CONTEXT = "criuctl 2026-12 migration verdict"


def forged(method: str, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
    """The best "aborted" a thing at the target's address can make of one request."""
    parts = path.split("/")
    migration = parts[3] if path.startswith("/v1/incoming/") and len(parts) > 3 else "x"
    auth = headers.get("Authorization", "")
    nonce = ""
    if auth.startswith(tickets.SCHEME + " "):
        fields = dict(p.partition("=")[::2] for p in auth[len(tickets.SCHEME) + 1 :].split(","))
        nonce = fields.get("nonce", "")
    private, _ = tickets.new_signer()
    body: dict[str, str] = dict(tickets.signed_state(private, migration, "aborted", "forged-boot", nonce))
    if auth.startswith("Bearer "):  # a source that sends its secret gives away the old key
        key = blake3.blake3(auth[7:].strip().encode(), derive_key_context=_OLD_VERDICT_CONTEXT).digest()
        body["mac"] = blake3.blake3(f"{migration}\naborted\nforged-boot".encode(), key=key).hexdigest()
    return 200, json.dumps(body).encode()


def fixed(status: int, body: bytes) -> Respond:
    return lambda _m, _p, _h: (status, body)


def server(port: int, respond: Respond, cert: str | None = None, key: str | None = None):
    """A server (not yet serving) on `port` (0: any) answering each request with `respond`'s
    (status, body); `srv.seen` lists every request's (method, path, headers) as it came."""
    seen: list[tuple[str, str, dict[str, str]]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            headers = dict(self.headers.items())
            seen.append((self.command, self.path, headers))
            status, body = respond(self.command, self.path, headers)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            print(f"answered {self.command} {self.path}", flush=True)

        do_GET = do_DELETE = do_POST = do_PUT = _reply

        def log_message(self, *_a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("0.0.0.0" if port else "127.0.0.1", port), Handler)
    srv.seen = seen  # type: ignore[attr-defined]
    if cert and key:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    return srv


def main() -> None:
    port = int(sys.argv[1])
    if sys.argv[2] == "forge":
        srv = server(port, forged, *sys.argv[3:5])
    else:
        srv = server(port, fixed(int(sys.argv[2]), sys.argv[3].encode()), *sys.argv[4:6])
    print("listening", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
