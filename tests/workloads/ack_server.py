"""The server train_tcp_client.py talks to: acks every step line, one connection at a time.

Prints `listening PORT` first, then `conn N` for each connection it accepts and `got LINE` for
each line, so a test can tell that one connection carried every step, in order.
"""

import socket
import sys

srv = socket.create_server(
    (sys.argv[sys.argv.index("--listen") + 1] if "--listen" in sys.argv else "127.0.0.1", 0)
)
print(f"listening {srv.getsockname()[1]}", flush=True)
n = 0
while True:
    conn, _ = srv.accept()
    n += 1
    print(f"conn {n}", flush=True)
    with conn, conn.makefile("r") as lines:
        for line in lines:
            line = line.strip()
            print(f"got {line}", flush=True)
            if line == "bye":
                sys.exit(0)
            conn.sendall(f"ack {line.split()[1]}\n".encode())
    print(f"closed {n}", flush=True)
