#!/usr/bin/env python3
"""Health check with the name and arguments of apache/kafka's tool, for compose.yml:
``kafka-broker-api-versions.sh --bootstrap-server HOST:PORT`` exits 0 when the broker
there answers an ApiVersions request without error, else 1. Python, not a JVM, so a
check every few seconds costs milliseconds (this image has no kafka-tools jar)."""

import socket
import struct
import sys

args = sys.argv[1:]
server = args[args.index("--bootstrap-server") + 1].split(",")[0]
host, port = server.rsplit(":", 1)
client = b"healthcheck"
# ApiVersions (key 18) v0: api key, version, correlation id, client id.
body = struct.pack(">hhih", 18, 0, 1, len(client)) + client
try:
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        head = b""
        while len(head) < 10:
            chunk = sock.recv(10 - len(head))
            if not chunk:
                sys.exit(f"{server}: connection closed")
            head += chunk
except OSError as exc:
    sys.exit(f"{server}: {exc}")
_size, correlation, error = struct.unpack(">iih", head)
if correlation != 1 or error != 0:
    sys.exit(f"{server}: ApiVersions error {error}")
print(f"{server}: ApiVersions ok")
