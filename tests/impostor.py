"""Something else listening at an agent's address: answers every request with one status and body.

`python -m tests.impostor PORT STATUS BODY_JSON [CERT KEY]` — run inside a node's network namespace
in place of its agent (killed), to see what a source does with an answer that is not the target's
signed word: a 404 page, or a verdict forged without the ticket's key. With CERT and KEY it speaks
TLS with them (an impostor that holds the node's certificate: the signature must still tell).
`server(...)` is the same in a test's own process.
"""

from __future__ import annotations

import http.server
import ssl
import sys


def server(port: int, status: int, body: bytes, cert: str | None = None, key: str | None = None):
    """A server (not yet serving) on `port` (0: any) answering every request with (status, body)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
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
    if cert and key:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    return srv


def main() -> None:
    port, status, body = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode()
    srv = server(port, status, body, *sys.argv[4:6])
    print("listening", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
