"""An independent client of kvroute's endpoint picker: a gateway's ext_proc side written
with Envoy's published types from PyPI (envoy-data-plane, betterproto2) over grpcio, and
the standard library for HTTP. Nothing here shares code with kvroute's Rust.

Run by crates/kvroute/tests/epp.rs (`epp_python_client`) against a running router:
  python epp_client.py --epp 127.0.0.1:E --router http://127.0.0.1:R \
      --workers 127.0.0.1:P1,127.0.0.1:P2 [--full-router http://127.0.0.1:R2 --full-epp 127.0.0.1:E2]
Prints "ok <scenario>" for each; exits non-zero on the first failure.
"""

import argparse
import json
import sys
import threading
import time
import urllib.request
import queue

import betterproto2
import grpc
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.service.ext_proc import v3 as ep
from envoy_data_plane.google.protobuf import ListValue, Struct, Value
from grpc_health.v1 import health_pb2, health_pb2_grpc

MODEL = "sim-llama-3-8b"
CHAT = "/v1/chat/completions"


def headers(pairs, end=False):
    return ep.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
                          end_of_stream=end)


def lb_metadata(namespace, key, value):
    return Metadata(filter_metadata={namespace: Struct(fields={key: value})})


class Stream:
    """One ext_proc stream: what the gateway sends, and the picker's answers in order."""

    def __init__(self, channel):
        self.out = queue.Queue()
        # ExternalProcessorSyncStub.process's own call, kept so the gateway can cancel it.
        process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            ep.ProcessingRequest.SerializeToString,
            ep.ProcessingResponse.FromString,
        )
        self.call = process(iter(self.out.get, None))
        self.closed = False

    def send(self, **fields):
        self.out.put(ep.ProcessingRequest(**fields))

    def recv(self):
        r = next(self.call)
        name, value = betterproto2.which_one_of(r, "response")
        return name, value, r

    def close(self):
        """The gateway goes away (the client left): the call is cancelled."""
        self.out.put(None)
        self.call.cancel()


def destination(common):
    for o in common.header_mutation.set_headers:
        if o.header.key == "x-gateway-destination-endpoint":
            return o.header.raw_value.decode() or o.header.value
    return None


def pick(channel, body, subset=None, buffered=False):
    """Sends a chat request; returns (stream, endpoints, body to forward) or raises
    Immediate(status, body, headers)."""
    s = Stream(channel)
    md = None
    if subset is not None:
        md = lb_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset",
                         Value(list_value=ListValue(values=[Value(string_value=e) for e in subset])))
    cfg = None
    if buffered:
        cfg = ep.ProtocolConfiguration(request_body_mode=2, response_body_mode=1)  # BUFFERED, STREAMED
    s.send(request_headers=headers([(":method", "POST"), (":path", CHAT), ("content-type", "application/json")]),
           metadata_context=md, protocol_config=cfg)
    raw = json.dumps(body).encode()
    if buffered:
        name, value, _ = s.recv()
        if name == "immediate_response":
            raise Immediate(value)
        assert name == "request_headers", name
    s.send(request_body=ep.HttpBody(body=raw, end_of_stream=True))
    name, value, full = s.recv()
    if name == "immediate_response":
        raise Immediate(value)
    if buffered:
        assert name == "request_body", name
        dest = destination(value.response)
        mutation = value.response.body_mutation
        forward = mutation.body if mutation and betterproto2.which_one_of(mutation, "mutation")[0] == "body" else raw
    else:
        assert name == "request_headers", name
        assert value.response.clear_route_cache, "the route cache is cleared"
        dest = destination(value.response)
        forward = b""
        while True:
            name, value, _ = s.recv()
            assert name == "request_body", name
            sr = value.response.body_mutation.streamed_response
            forward += sr.body
            if sr.end_of_stream:
                break
    lb = full.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    assert dest == lb, f"header {dest!r} and envoy.lb metadata {lb!r} differ"
    return s, dest.split(","), forward


class Immediate(Exception):
    def __init__(self, r):
        super().__init__(r.status.code)
        self.status = r.status.code
        self.body = json.loads(r.body)
        self.headers = {o.header.key: o.header.raw_value.decode() for o in r.headers.set_headers}


def relay(s, endpoint, forward, served=None, stop_after=None, duplex=True):
    """Forwards the body to `endpoint` and reports the response to the picker, as a gateway
    does; `stop_after` chunks then the client leaves. Returns the body relayed."""
    req = urllib.request.Request(f"http://{endpoint}{CHAT}", data=forward, headers={"content-type": "application/json"})
    got = b""
    with urllib.request.urlopen(req, timeout=30) as r:
        md = lb_metadata("envoy.lb", "x-gateway-destination-endpoint-served", Value(string_value=served or endpoint))
        s.send(response_headers=headers([(":status", str(r.status)), ("content-type", r.headers["content-type"])]),
               metadata_context=md)
        name, _, _ = s.recv()
        assert name == "response_headers", name
        n = 0
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            end = not chunk
            s.send(response_body=ep.HttpBody(body=chunk, end_of_stream=end))
            back = b""
            while True:
                name, value, _ = s.recv()
                assert name == "response_body", name
                if not duplex:
                    back = chunk
                    break
                sr = value.response.body_mutation.streamed_response
                back += sr.body
                if sr.end_of_stream or (not end and len(back) >= len(chunk)):
                    break
            got += back
            n += 1
            if end:
                break
            if stop_after is not None and n >= stop_after:
                s.close()
                return got
    s.close()
    return got


def metric(router, name, label):
    text = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name) and label in l)


def expect_metric(router, name, label, want):
    for _ in range(200):
        got = metric(router, name, label)
        if got == want:
            return
        time.sleep(0.05)
    sys.exit(f"{name}{{{label}}} is {got}, expected {want}")


def drains(router, token):
    req = urllib.request.Request(router + "/workers", headers={"authorization": f"Bearer {token}"})
    for _ in range(200):
        rows = json.load(urllib.request.urlopen(req, timeout=10))["workers"]
        if all(w["in_flight"] == 0 for w in rows):
            return
        time.sleep(0.05)
    sys.exit("the router's ledger did not drain")


def chat(text, stream, model=MODEL):
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": stream}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epp", required=True)
    p.add_argument("--router", required=True)
    p.add_argument("--workers", required=True)
    p.add_argument("--admin-token", default="test-admin-token")
    p.add_argument("--full-epp", help="a picker whose router admits one request per model at a time")
    p.add_argument("--full-router")
    a = p.parse_args()
    workers = a.workers.split(",")
    ch = grpc.insecure_channel(a.epp)
    ok = lambda name: print("ok", name, flush=True)  # noqa: E731

    h = health_pb2_grpc.HealthStub(ch)
    for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        st = h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10).status
        assert st == health_pb2.HealthCheckResponse.SERVING, (svc, st)
    ok("health")

    before = metric(a.router, "kvroute_requests_total", 'outcome="ok"')
    s, dest, fwd = pick(ch, chat("a streamed question about caches", True))
    body = relay(s, dest[0], fwd).decode()
    assert body.count("data: ") >= 4 and "[DONE]" in body, body
    drains(a.router, a.admin_token)
    expect_metric(a.router, "kvroute_requests_total", 'outcome="ok"', before + 1)
    ok("streamed")

    s, dest, fwd = pick(ch, chat("a whole answer please", False))
    answer = json.loads(relay(s, dest[0], fwd))
    assert answer["usage"]["completion_tokens"] == 4, answer
    expect_metric(a.router, "kvroute_requests_total", 'outcome="ok"', before + 2)
    ok("whole")

    s, dest, fwd = pick(ch, chat("buffered this time", False), buffered=True)
    answer = json.loads(relay(s, dest[0], fwd, duplex=False))
    assert answer["usage"]["completion_tokens"] == 4, answer
    expect_metric(a.router, "kvroute_requests_total", 'outcome="ok"', before + 3)
    ok("buffered")

    for i in range(3):
        s, dest, _ = pick(ch, chat(f"subset {i}", True), subset=[workers[1]])
        assert dest[0] == workers[1], dest
        s.close()
    try:
        pick(ch, chat("empty subset", True), subset=[])
        sys.exit("an empty subset was picked from")
    except Immediate as e:
        assert e.status == 503, e.status
    ok("subset")

    try:
        pick(ch, chat("who serves this?", True, model="no-such-model"))
        sys.exit("an unknown model was picked")
    except Immediate as e:
        assert e.status == 404 and "no-such-model" in e.body["error"]["message"], (e.status, e.body)
        assert e.headers.get("content-type") == "application/json", e.headers
    ok("unknown_model")

    fb = metric(a.router, "kvroute_epp_served_total", 'outcome="fallback"')
    s, dest, fwd = pick(ch, chat("the gateway retries elsewhere", True))
    other = next(w for w in workers if w != dest[0])
    relay(s, other, fwd)
    drains(a.router, a.admin_token)
    expect_metric(a.router, "kvroute_epp_served_total", 'outcome="fallback"', fb + 1)
    ok("fallback")

    gone = metric(a.router, "kvroute_requests_total", 'outcome="cancelled"')
    s, dest, fwd = pick(ch, chat("a long story, then the client leaves", True))
    relay(s, dest[0], fwd, stop_after=1)
    drains(a.router, a.admin_token)
    expect_metric(a.router, "kvroute_requests_total", 'outcome="cancelled"', gone + 1)
    ok("client_gone")

    if a.full_epp:
        fch = grpc.insecure_channel(a.full_epp)
        held, _, _ = pick(fch, chat("holding the only place", True))
        try:
            pick(fch, chat("no room", True))
            sys.exit("admission let a second request in")
        except Immediate as e:
            assert e.status == 503 and e.headers.get("retry-after"), (e.status, e.headers)
            assert "too many requests in flight" in e.body["error"]["message"], e.body
        held.close()
        drains(a.full_router, a.admin_token)
        s, _, _ = pick(fch, chat("room again", True))
        s.close()
        ok("admission_full")


if __name__ == "__main__":
    main()
