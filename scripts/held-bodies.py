#!/usr/bin/env python3
"""Opens N connections to a router, each sending a chat request whose body is announced
as SIZE bytes and sent but for its last byte, then reads the router's peak RSS and how
the connections were answered (503 or 429 early, or still held).

usage: held-bodies.py PID PORT N SIZE [HEADER [PROBE_HEADER [PROBE_SIZE]]]
HEADER ("x-tenant: a") is sent on each held request; with PROBE_HEADER ("x-tenant: b"),
one request of another tenant (a short prompt in a body padded to PROBE_SIZE bytes, default
100) is sent whole
while they are held, and its status printed."""
import socket, sys, time, subprocess, os, select
router_pid, port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
extra = (sys.argv[5] + "\r\n").encode() if len(sys.argv) > 5 else b""
probe_header = (sys.argv[6] + "\r\n").encode() if len(sys.argv) > 6 else None
probe_size = int(sys.argv[7]) if len(sys.argv) > 7 else 100
head = b'{"model":"sim-llama-3-8b","max_tokens":1,"messages":[{"role":"user","content":"'
tail = b'"}]}'
body = head + b"a" * (size - len(head) - len(tail)) + tail
def rss_kib():
    for l in open(f"/proc/{router_pid}/status"):
        if l.startswith("VmRSS"):
            return int(l.split()[1])
socks = []
refused = 0
refused_429 = 0
peak = rss_kib()
t0 = time.time()
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body))
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
            elif d.startswith(b"HTTP/1.1 429"):
                refused_429 += 1
        except OSError:
            pass
probe = ""
if probe_header is not None:
    # A short prompt padded with JSON whitespace to PROBE_SIZE: a valid request any worker serves.
    small = head + b"hello" + tail
    small += b" " * max(0, probe_size - len(small))
    p = socket.create_connection(("127.0.0.1", port))
    p.settimeout(30)
    try:
        p.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + probe_header + b"Content-Length: %d\r\n\r\n" % len(small) + small)
    except OSError:
        pass  # refused before its end: the answer is waiting
    answer = p.recv(4096)
    probe = " probe_status=" + answer.split(b" ")[1].decode()
    if os.environ.get("SHOW_PROBE"):
        print(answer.decode(errors="replace"))
    p.close()
print(f"connections={n} body_bytes={size} refused_503={refused} refused_429={refused_429} held={n-refused-refused_429} router_peak_rss_mib={peak/1024:.0f} secs={time.time()-t0:.1f}{probe}")
for s in socks:
    s.close()
