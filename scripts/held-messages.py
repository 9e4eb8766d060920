#!/usr/bin/env python3
"""Endpoint-picker streams that each send most of a large body message and wait: what the
router holds (its RSS and `kvroute_buffered_body_bytes`) and how many streams it refuses.

The gRPC server assembles a message whole before the picker reads it, so a body message
cut short is held by the router while it waits for the rest. This opens N ext_proc streams
on one HTTP/2 connection to `--epp-listen`; each sends request headers and then the first
90 % of a request-body message of SIZE bytes (a buffered chat request), and stops. After
the last stream it waits 3 s and prints the router's RSS (VmRSS, peak VmHWM), the budget's
gauge, and how many streams were answered with an immediate response naming
`max_buffered_body_bytes` (503) or the tenant's share (429).

Needs the `h2` package (the endpoint picker test venv has it: .ci/run's venv-epp).
Usage: held-messages.py ROUTER_PID EPP_PORT HTTP_PORT N SIZE
"""

import socket
import sys
import time
import urllib.request

import h2.config
import h2.connection
import h2.events


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(tag, payload):
    """A length-delimited protobuf field."""
    return varint(tag << 3 | 2) + varint(len(payload)) + payload


def headers_message():
    """ProcessingRequest{request_headers: HttpHeaders{headers: HeaderMap{...}}}."""
    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")]
    hm = b"".join(field(1, field(1, k.encode()) + field(3, v.encode())) for k, v in pairs)
    return field(2, field(1, hm))


def body_message(size):
    """ProcessingRequest{request_body: HttpBody{body, end_of_stream: true}} of about `size` bytes."""
    words = max(1, (size - 100) // 5)
    body = b'{"model":"sim-llama-3-8b","max_tokens":4,"messages":[{"role":"user","content":"' + b"word " * words + b'"}]}'
    return field(4, field(1, body) + varint(2 << 3 | 0) + b"\x01")


def framed(m):
    return b"\x00" + len(m).to_bytes(4, "big") + m


def rss(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) // 1024
    return out


def gauge(http_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvroute_buffered_body_bytes "):
                return int(float(line.split()[1]))
    return 0


def main():
    pid, epp_port, http_port, n, size = (int(a) for a in sys.argv[1:6])
    sock = socket.create_connection(("127.0.0.1", epp_port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.increment_flow_control_window(1 << 30)
    sock.sendall(conn.data_to_send())
    replies = {}
    ended = set()

    def pump(timeout):
        sock.settimeout(timeout)
        try:
            data = sock.recv(1 << 20)
        except socket.timeout:
            return
        if not data:
            raise SystemExit("the router closed the connection")
        for e in conn.receive_data(data):
            if isinstance(e, h2.events.DataReceived):
                replies[e.stream_id] = replies.get(e.stream_id, b"") + e.data
                conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            elif isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)):
                ended.add(e.stream_id)
        sock.sendall(conn.data_to_send())

    head = framed(headers_message())
    whole = framed(body_message(size))
    part = whole[: len(whole) * 9 // 10]
    t0 = time.time()
    for i in range(n):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{epp_port}"),
                                (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                ("content-type", "application/grpc"), ("te", "trailers")])
        data = head + part
        stalled = time.time()
        while data and sid not in ended and sid not in replies:
            room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, len(data))
            if room > 0:
                conn.send_data(sid, data[:room])
                data = data[room:]
                sock.sendall(conn.data_to_send())
                stalled = time.time()
            else:
                pump(0.2)
                if time.time() - stalled > 2:
                    break
        pump(0.01)
    end = time.time() + 3
    while time.time() < end:
        pump(0.2)
    budget = sum(1 for r in replies.values() if b"max_buffered_body_bytes =" in r)
    share = sum(1 for r in replies.values() if b"max_buffered_body_bytes_per_tenant" in r)
    m = rss(pid)
    print(f"streams {n}, message {len(whole)} bytes, {len(part)} sent each: refused {budget} (budget), {share} (tenant share); "
          f"held by the budget {gauge(http_port) // (1 << 20)} MiB; router RSS {m['VmRSS']} MiB, peak {m['VmHWM']} MiB; "
          f"{time.time() - t0:.1f} s")
    sock.close()


if __name__ == "__main__":
    main()
