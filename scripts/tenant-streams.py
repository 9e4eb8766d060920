#!/usr/bin/env python3
"""Opens N long streaming chat requests to a router as one tenant (each read up to its
status line, then left open), then sends one short request as another tenant, and prints
how the N were answered and the other tenant's status.

usage: tenant-streams.py PORT N HEADER PROBE_HEADER
HEADER and PROBE_HEADER name the two tenants, e.g. "x-tenant: a" and "x-tenant: b"."""
import socket, sys, json, collections
port, n, header, probe_header = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

def request(head, stream):
    body = json.dumps({"model": "sim-llama-3-8b", "max_tokens": 4000 if stream else 1, "stream": stream,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + head.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    status = s.recv(64).split(b" ")[1].decode()
    return s, status

socks, statuses = [], collections.Counter()
for _ in range(n):
    s, status = request(header, True)
    statuses[status] += 1
    socks.append(s)
p, probe = request(probe_header, False)
p.close()
print(f"streams={n} answered={dict(sorted(statuses.items()))} probe_status={probe}")
for s in socks:
    s.close()
