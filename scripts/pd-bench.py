#!/usr/bin/env python3
"""Prefill/decode disaggregation over HTTP: colocated vs 1P:3D, 2P:2D, 3P:1D on 4 engines.

For each layout it starts four `kvroute engine-sim` workers (role both, or prefill and
decode with the given hand-over protocol and transfer link), a `kvroute serve` in front of
them (`--pd-disaggregation --prefill URL PORT --decode URL` for the split layouts; the
same policy, cache_aware, for the colocated fleet and the prefill pool; least_load for the
decode pool), and replays a trace slice through it with `kvroute bench`, reporting times
on the simulated clock (`--latency-scale` = the engines' `--time-scale`). It prints one
row per layout: requests, TTFT mean/p50/p99, TPOT p50/p99, goodput under the SLO, the
share of requests split, and the KV bytes transferred.

Standard library only. Usage:
  python3 scripts/pd-bench.py --kvroute target/release/kvroute --trace TRACE
      [--rate-scale 1] [--requests 300] [--trace-window S] [--time-scale 10]
      [--link-gbytes 25] [--protocol sglang] [--colocate-below 2048] [--max-output 128]
      [--layouts colocated,1:3,2:2,3:1] [--json OUT]
Every process is on 127.0.0.1 and ends with each layout.
"""

import argparse
import json
import os
import subprocess
import tempfile
import urllib.request

from kvroute_procs import free_port, wait_ok


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.split()[-1])
    return total


def run_layout(a, layout):
    procs = []
    try:
        if layout == "colocated":
            roles = ["both"] * 4
        else:
            p, d = (int(x) for x in layout.split(":"))
            roles = ["prefill"] * p + ["decode"] * d
        workers = []
        for role in roles:
            port = free_port()
            cmd = [a.kvroute, "engine-sim", "--port", str(port), "--time-scale", str(a.time_scale),
                   "--kv-link-gbytes-per-s", str(a.link_gbytes)]
            boot = None
            if role != "both":
                boot = free_port() if role == "prefill" else None
                cmd += ["--role", role]
                if boot:
                    cmd += ["--bootstrap-port", str(boot)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            workers.append((role, f"http://127.0.0.1:{port}", boot))
        for _, u, _ in workers:
            wait_ok(u + "/health", "engine-sim", 60)
        rport = free_port()
        serve = [a.kvroute, "serve", "--port", str(rport), "--policy", "cache_aware", "--scrape-metrics", "true"]
        if layout == "colocated":
            serve += ["--worker-urls", ",".join(u for _, u, _ in workers)]
        else:
            serve += ["--pd-disaggregation", "--pd-protocol", a.protocol, "--prefill-policy", "cache_aware",
                      "--decode-policy", "least_load", "--colocate-below-tokens", str(a.colocate_below)]
            for role, u, boot in workers:
                if role == "prefill":
                    serve += ["--prefill", u, str(boot)]
                else:
                    serve += ["--decode", u]
        procs.append(subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{rport}"
        wait_ok(router + "/readiness", "router", 60)
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        bench = [a.kvroute, "bench", "--url", router, "--trace", a.trace, "--rate-scale", str(a.rate_scale),
                 "--latency-scale", str(a.time_scale), "--max-output", str(a.max_output), "--json", out,
                 "--label", layout, "--quiet", "--timeout", "600"]
        if a.requests:
            bench += ["--requests", str(a.requests)]
        if a.trace_window:
            bench += ["--trace-window", str(a.trace_window)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        summary = json.load(open(out))["summary"]
        os.unlink(out)
        with urllib.request.urlopen(router + "/metrics") as r:
            rm = r.read().decode()
        transfer_bytes = 0.0
        for role, u, _ in workers:
            if role == "decode":
                with urllib.request.urlopen(u + "/metrics") as r:
                    transfer_bytes += metric_sum(r.read().decode(), "kvroute_sim_pd_transfer_bytes_total")
        split = metric_sum(rm, 'kvroute_pd_requests_total{outcome="split"}')
        return {"layout": layout, "summary": summary, "split": split, "transfer_bytes": transfer_bytes}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvroute", default="target/release/kvroute")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--trace-window", type=float, default=None)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--link-gbytes", type=float, default=25.0)
    ap.add_argument("--protocol", default="sglang", choices=["sglang", "vllm"])
    ap.add_argument("--colocate-below", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--layouts", default="colocated,1:3,2:2,3:1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [run_layout(a, layout) for layout in a.layouts.split(",")]
    print(f"trace {os.path.basename(a.trace)}, {a.requests} requests at x{a.rate_scale}, engines at x{a.time_scale} "
          f"(times in simulated seconds), {a.protocol}, link {a.link_gbytes} GB/s, colocate below {a.colocate_below} tokens")
    print("| layout | ok | TTFT mean | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput req/s | split | KV moved |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"]
        print(f"| {r['layout']} | {s['ok']}/{s['requests']} | {s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} | "
              f"{s['ttft_p99_s']:.3f} | {s['tpot_p50_s']:.4f} | {s['tpot_p99_s']:.4f} | {s['goodput_rps']:.2f} | "
              f"{r['split']:.0f} | {r['transfer_bytes'] / 2**30:.2f} GiB |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
