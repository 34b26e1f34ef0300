"""criuctl.net.rto on a real process: its connection to a moving peer gets a bounded backoff, its
other connections and its own options are left as they were."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from criuctl.net import peers, rto
from tests.requirements import needs

# a process with two connections to us; on a line, it prints what its sockets' options now are
CHILD = textwrap.dedent(
    """
    import socket, sys
    port = int(sys.argv[1])
    moving = socket.create_connection(("127.0.0.1", port))
    staying = socket.create_connection(("127.0.0.1", port))
    staying.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 30000)  # the job's own choice
    print(*moving.getsockname(), *staying.getsockname(), flush=True)
    sys.stdin.readline()
    for s in (moving, staying):
        print(s.getsockopt(socket.IPPROTO_TCP, 44), s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
    """
)


@needs("tcp-rto-max")
def test_only_the_connections_to_the_moving_peer_get_a_bounded_backoff() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            a_ip, a_port, b_ip, b_port = child.stdout.readline().split()
            accepted = [server.accept()[0] for _ in range(2)]
            moving = (a_ip, int(a_port), "127.0.0.1", port)
            wanted = {moving, ("127.0.0.1", 1, "127.0.0.1", 2)}
            held = peers.held([child.pid]).items()
            inodes = {ino for ino, s in held if (*s.local, *s.remote) in wanted}
            done = rto.brace([child.pid, child.pid], inodes)
            assert done == rto.Braced(sockets=1), done
            child.stdin.write("\n")
            child.stdin.flush()
            moved = child.stdout.readline().split()
            stayed = child.stdout.readline().split()
            assert child.wait(30) == 0
        finally:
            child.kill()
            for s in locals().get("accepted", []):
                s.close()
    assert moved == [str(rto.RTO_MAX_MS), str(rto.USER_TIMEOUT_MS)], moved
    assert stayed == ["120000", "30000"], "another connection, and a timeout the job set, are left alone"


def test_a_process_that_is_gone_braces_nothing() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert rto.brace([p.pid], {1}) == rto.Braced()
