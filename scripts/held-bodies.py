#!/usr/bin/env python3
"""Opens N connections to a router, each sending a chat request whose body is announced
as SIZE bytes and sent but for its last byte, then reads the router's peak RSS and how
the connections were answered (503 early, or still held)."""
import socket, sys, time, subprocess, os, select
router_pid, port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
head = b'{"model":"sim-llama-3-8b","max_tokens":1,"messages":[{"role":"user","content":"'
tail = b'"}]}'
body = head + b"a" * (size - len(head) - len(tail)) + tail
def rss_kib():
    for l in open(f"/proc/{router_pid}/status"):
        if l.startswith("VmRSS"):
            return int(l.split()[1])
socks = []
refused = 0
peak = rss_kib()
t0 = time.time()
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    try:
        s.settimeout(5)
        s.sendall(body[:-1])
    except OSError:
        pass
    socks.append(s)
    peak = max(peak, rss_kib())
time.sleep(1)
peak = max(peak, rss_kib())
for s in socks:
    r, _, _ = select.select([s], [], [], 0)
    if r:
        try:
            d = s.recv(64)
            if d.startswith(b"HTTP/1.1 503"):
                refused += 1
        except OSError:
            pass
print(f"connections={n} body_bytes={size} refused_503={refused} held={n-refused} router_peak_rss_mib={peak/1024:.0f} secs={time.time()-t0:.1f}")
for s in socks:
    s.close()
