#!/usr/bin/env python3
"""kvroute as an endpoint picker (`serve --epp-listen`, behind `kvroute bench epp-gateway`,
a gateway stand-in) against kvroute as the proxy (`serve`), on fresh engine-sim fleets:

1. decisions: the same trace slice sent one request at a time (closed loop, 1 client) to
   each mode; the worker each request went to (by its index in the fleet) is compared
   request by request;
2. TTFT: the slice replayed by its timestamps (open loop) to each mode, `--rounds` times
   in alternation; mean/p50/p99 TTFT per run, on the clock of the simulated engines;
3. overhead: instant workers (`engine-sim --instant`), one client, non-streamed requests
   sent directly to the workers, through `serve`, and through the stand-in with the picker;
   end-to-end p50/p99 each, and the picker's own round trip (gRPC, timed by the stand-in).

Standard library only; prints a Markdown report and writes --out JSON. Usage:
  python3 scripts/epp-vs-serve.py --kvroute target/release/kvroute --out docs/results/epp_vs_serve.json
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvroute_procs import free_port, wait_ok  # noqa: E402

MODEL = "sim-llama-3-8b"


class Procs:
    """Processes started for one run, stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self, logdir):
        self.kids = []
        self.logdir = logdir

    def start(self, name, args, env=None):
        log = open(os.path.join(self.logdir, f"{name}.log"), "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.kids.append(p)
        return p

    def stop(self):
        for p in self.kids:
            p.send_signal(signal.SIGTERM)
        for p in self.kids:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
        self.kids = []


def fleet(a, procs, engines, extra):
    urls = []
    for i in range(engines):
        port = free_port()
        procs.start(f"engine{i}", [a.kvroute, "engine-sim", "--port", str(port)] + extra)
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_ok(u + "/health", "engine-sim")
    return urls


def router(a, procs, urls, epp):
    """`kvroute serve` (decision headers exposed); with `epp`, also the picker and the
    stand-in in front of it. Returns the URL to send to and the stand-in's stats URL."""
    port = free_port()
    args = [a.kvroute, "serve", "--port", str(port), "--worker-urls", ",".join(urls),
            "--expose-decision-headers", "true", "--policy", a.policy]
    stats = None
    if epp:
        grpc = f"127.0.0.1:{free_port()}"
        args += ["--epp-listen", grpc]
    procs.start("router", args, env={"KVROUTE_ADMIN_TOKEN": "epp-vs-serve"})
    wait_ok(f"http://127.0.0.1:{port}/readiness", "kvroute serve")
    url = f"http://127.0.0.1:{port}"
    if epp:
        gport = free_port()
        procs.start("gateway", [a.kvroute, "bench", "epp-gateway", "--epp", grpc, "--port", str(gport)])
        url = f"http://127.0.0.1:{gport}"
        stats = url + "/epp-gateway/stats"
        wait_ok(stats, "kvroute bench epp-gateway")
    return url, stats


def bench(a, url, out, extra):
    cmd = [a.kvroute, "bench", "--url", url, "--model", MODEL, "--json", out, "--quiet"] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_mode(a, tmp, name, epp, engine_flags, bench_flags, engines):
    procs = Procs(tmp)
    try:
        urls = fleet(a, procs, engines, engine_flags)
        url, stats = router(a, procs, urls, epp)
        doc = bench(a, url, os.path.join(tmp, f"{name}.json"), bench_flags)
        picks = json.load(urllib.request.urlopen(stats)) if stats else None
        return doc, urls, picks
    finally:
        procs.stop()


def decisions(a, tmp):
    flags = ["--trace", a.trace, "--requests", str(a.decisions), "--closed-loop", "--max-concurrency", "1",
             "--latency-scale", str(a.time_scale), "--max-output", "32"]
    eng = ["--time-scale", str(a.time_scale)]
    seqs = {}
    for name, epp in (("serve", False), ("epp", True)):
        doc, urls, _ = run_mode(a, tmp, f"decisions-{name}", epp, eng, flags, a.engines)
        index = {u: i for i, u in enumerate(urls)}
        reqs = sorted(doc["requests"], key=lambda r: r["index"])
        seqs[name] = [index.get((r.get("worker") or "").rstrip("/"), -1) for r in reqs]
    same = sum(1 for x, y in zip(seqs["serve"], seqs["epp"]) if x == y and x >= 0)
    return {"requests": a.decisions, "same": same, "serve": seqs["serve"], "epp": seqs["epp"]}


def ttft(a, tmp):
    flags = ["--trace", a.trace, "--requests", str(a.requests), "--rate-scale", str(a.time_scale * a.rate_scale),
             "--latency-scale", str(a.time_scale), "--max-output", "64"]
    eng = ["--time-scale", str(a.time_scale)]
    runs = []
    for r in range(a.rounds):
        for name, epp in (("serve", False), ("epp", True)):
            doc, _, _ = run_mode(a, tmp, f"ttft-{name}-{r}", epp, eng, flags, a.engines)
            t = [x["ttft_s"] * a.time_scale for x in doc["requests"] if x.get("ttft_s") is not None]
            runs.append({"mode": name, "round": r, "ok": len(t), "requests": len(doc["requests"]),
                         "mean_ttft_s": sum(t) / max(1, len(t)), "p50_ttft_s": pct(t, 0.5),
                         "p99_ttft_s": pct(t, 0.99)})
    return runs


def overhead(a, tmp):
    flags = ["--workload", "constant", "--requests", str(a.overhead_requests), "--closed-loop",
             "--max-concurrency", "1", "--no-stream", "--input-tokens", "64", "--output-tokens", "8"]
    out = {}
    procs = Procs(tmp)
    try:
        urls = fleet(a, procs, 2, ["--instant"])
        doc = bench(a, ",".join(urls), os.path.join(tmp, "overhead-direct.json"), flags)
        out["direct"] = doc
    finally:
        procs.stop()
    res = {}
    for name, epp in (("serve", False), ("epp", True)):
        doc, _, picks = run_mode(a, tmp, f"overhead-{name}", epp, ["--instant"], flags, 2)
        out[name] = doc
        if picks:
            res["picker_round_trip_us"] = picks
    for name, doc in out.items():
        e2e = [x["e2e_s"] * 1e6 for x in doc["requests"] if (x.get("outcome") or {}).get("kind") == "ok"]
        res[name] = {"ok": len(e2e), "p50_us": pct(e2e, 0.5), "p99_us": pct(e2e, 0.99)}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvroute", default="target/release/kvroute")
    p.add_argument("--trace", default="data/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--policy", default="least_ttft")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--rate-scale", type=float, default=1.0, help="trace arrival rate multiplier (on the engines' clock)")
    p.add_argument("--decisions", type=int, default=100)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--overhead-requests", type=int, default=2000)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="epp-vs-serve-") as tmp:
        rep = {"args": vars(a), "machine": os.uname().nodename, "cpus": os.cpu_count()}
        rep["decisions"] = decisions(a, tmp)
        d = rep["decisions"]
        print(f"decisions: {d['same']}/{d['requests']} requests went to the same worker (closed loop, 1 client)")
        rep["ttft"] = ttft(a, tmp)
        print("| mode | round | ok/sent | mean TTFT s | p50 | p99 |\n|---|---|---|---|---|---|")
        for r in rep["ttft"]:
            print(f"| {r['mode']} | {r['round']} | {r['ok']}/{r['requests']} | {r['mean_ttft_s']:.3f} | "
                  f"{r['p50_ttft_s']:.3f} | {r['p99_ttft_s']:.3f} |")
        rep["overhead"] = o = overhead(a, tmp)
        print("| path | ok | e2e p50 µs | e2e p99 µs |\n|---|---|---|---|")
        for k in ("direct", "serve", "epp"):
            print(f"| {k} | {o[k]['ok']} | {o[k]['p50_us']:.0f} | {o[k]['p99_us']:.0f} |")
        rt = o.get("picker_round_trip_us", {})
        print(f"picker round trip (stand-in, gRPC): p50 {rt.get('p50_us')} µs, p99 {rt.get('p99_us')} µs, "
              f"p99.9 {rt.get('p999_us')} µs over {rt.get('picks')} picks")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
