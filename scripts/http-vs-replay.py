#!/usr/bin/env python3
"""HTTP path against replay: the demo's Mooncake slice sent over real HTTP through
`kvroute serve` to engine-sims, compared with `kvroute replay` of the same slice, and the
gap taken apart.

For each policy and run it starts N `kvroute engine-sim --time-scale S` workers and
`kvroute serve --policy P --record FILE`, sends the slice with `kvroute bench` (open loop,
streaming, the trace's arrivals at `--rate-scale` x S), and then reads three TTFT means,
all in simulated seconds (wall x S):
- `client`: measured by the load generator, from its send to the first token;
- `gateway`: `kvroute_ttft_seconds` of the router, from its arrival to the first token;
- `engine`: `vllm:time_to_first_token_seconds` of the engine-sims, from the request
  reaching the engine to its first token leaving it;
and replays the traffic the gateway recorded (its real arrival instants, one ms apart or
reordered where the client and the network made them so) through the same policy:
`recorded replay`. `client - gateway - engine` are the HTTP hops; `engine` against the
recorded replay is the engine-sim and the routing over HTTP against the engine model and
the replay's routing on the same arrivals. The replay of the trace itself is run once with
its whole seconds spread evenly (what `kvroute replay` does by default) and once per
`--arrival-seeds` seed (each second's requests at seeded random instants), whose average
is the replay's expected value at this load: near the knee one realisation is not.

    python3 scripts/http-vs-replay.py --kvroute target/release/kvroute \\
        --policies round_robin,cache_aware,least_ttft --runs 3 --out /tmp/hvr
    python3 scripts/http-vs-replay.py --report /tmp/hvr/summary.json

Needs only the Python standard library and a release build of kvroute. Sends traffic
only to 127.0.0.1. Run it on an otherwise idle machine: at 10x every wall millisecond the
machine loses is ten simulated ones.
"""

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import urllib.request

from kvroute_procs import free_port, wait_ok

SLICE = ["--trace-window", "1200", "--min-turns", "3", "--max-input-tokens", "32768", "--max-output", "128"]


def histogram_mean(texts, name):
    """Mean of a Prometheus histogram over every label set of every body in `texts`, or None
    without samples."""
    def total(suffix):
        pattern = rf"^{re.escape(name)}_{suffix}(?:{{[^}}]*}})? (\S+)"
        return sum(float(v) for text in texts for v in re.findall(pattern, text, re.M))
    count = total("count")
    return total("sum") / count if count else None


def replay(args, trace, policy, extra):
    """`kvroute replay` of one policy; (hit ratio, mean TTFT s) from its JSON report."""
    out = pathlib.Path(args.out) / "replay.json"
    cmd = [args.kvroute, "replay", "--trace", str(trace), "--engines", str(args.engines), "--policy", policy]
    cmd += ["--quiet", "--json", str(out), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rep = json.loads(out.read_text())["reports"][0]
    return rep["hit_ratio"], rep["ttft_mean_s"]


def http_run(args, policy, tag):
    """One HTTP run; a dict of its TTFT means (simulated s), hit ratio and the recording."""
    out = pathlib.Path(args.out)
    scale = args.time_scale
    procs, urls = [], []
    rec = out / f"{tag}.rec.jsonl"
    rec.unlink(missing_ok=True)
    log = open(out / f"{tag}.log", "w")  # the engine-sims' and the router's stderr
    try:
        for _ in range(args.engines):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [args.kvroute, "engine-sim", "--port", str(port), "--time-scale", str(scale)],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_ok(u + "/health", "engine-sim")
        port = free_port()
        cmd = [args.kvroute, "serve", "--port", str(port), "--worker-urls", ",".join(urls), "--policy", policy]
        cmd += ["--record", str(rec), "--record-block-tokens", "512"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log))
        router = f"http://127.0.0.1:{port}"
        wait_ok(router + "/readiness", "kvroute serve")
        bench = out / f"{tag}.bench.json"
        cmd = [args.kvroute, "bench", "--url", router, "--trace", args.trace, "--quiet", "--json", str(bench)]
        cmd += ["--rate-scale", str(args.rate_scale * scale), "--latency-scale", str(scale), *SLICE]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        gateway = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
        engines = [urllib.request.urlopen(u + "/metrics", timeout=10).read().decode() for u in urls]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        log.close()
    reqs = json.loads(bench.read_text())["requests"]
    ok = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    if not ok:
        sys.exit(f"http-vs-replay: {tag}: no request got a first token; see {out / (tag + '.log')} and {bench}")
    hits = sum(float(v) for e in engines for v in re.findall(r"^vllm:prefix_cache_hits_total (\S+)", e, re.M))
    queries = sum(float(v) for e in engines for v in re.findall(r"^vllm:prefix_cache_queries_total (\S+)", e, re.M))
    rec_hit, rec_mean = replay(args, rec, policy, ["--rate-scale", str(1 / scale)])
    return {
        "requests": len(reqs),
        "ok": len(ok),
        "client": statistics.fmean(ok) * scale,
        "gateway": (histogram_mean([gateway], "kvroute_ttft_seconds") or 0.0) * scale,
        "engine": (histogram_mean(engines, "vllm:time_to_first_token_seconds") or 0.0) * scale,
        "hit": hits / queries if queries else 0.0,
        "recorded_replay": rec_mean,
        "recorded_replay_hit": rec_hit,
    }


def pct(a, b):
    return f"{100 * (a / b - 1):+.1f} %"


def report(policy, p, time_scale):
    """Prints one policy's table from its summary entry."""
    even, seeded, runs = p["replay_even"], p["replay_seeded"], p["runs"]
    seeded_mean = statistics.fmean(m for _, m in seeded) if seeded else even[1]
    print(f"\n{policy}: replay of the trace {even[1]:.3f} s (hit {100 * even[0]:.1f} %, whole seconds spread evenly)", end="")
    if seeded:
        lo, hi = min(m for _, m in seeded), max(m for _, m in seeded)
        print(f", {seeded_mean:.3f} s over {len(seeded)} arrival seeds ({lo:.3f}-{hi:.3f})")
    else:
        print()
    print("  run  client   gateway  engine   hit %  | recorded replay  hit %  | client vs replay (seeds) | engine vs recorded")
    for i, r in enumerate(runs):
        print(
            f"  {i + 1:<4} {r['client']:.3f}   {r['gateway']:.3f}    {r['engine']:.3f}    {100 * r['hit']:.1f}   |"
            f" {r['recorded_replay']:.3f}            {100 * r['recorded_replay_hit']:.1f}   |"
            f" {pct(r['client'], seeded_mean):>24} | {pct(r['engine'], r['recorded_replay'])}"
        )
    mean = {k: statistics.fmean(r[k] for r in runs) for k in ("client", "gateway", "engine", "recorded_replay")}
    print(
        f"  mean {mean['client']:.3f}   {mean['gateway']:.3f}    {mean['engine']:.3f}           |"
        f" {mean['recorded_replay']:.3f}                   |"
        f" {pct(mean['client'], seeded_mean):>24} | {pct(mean['engine'], mean['recorded_replay'])}"
        f"   (against the evenly spread replay: {pct(mean['client'], even[1])})"
    )
    hops = mean["client"] - mean["engine"]
    print(f"  HTTP hops (client - engine): {1000 * hops:.1f} simulated ms = {1000 * hops / time_scale:.2f} wall ms a request")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvroute", default="target/release/kvroute")
    ap.add_argument("--trace", default="data/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--policies", default="round_robin,cache_aware,least_ttft")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rate-scale", type=float, default=10.0, help="arrival-rate multiplier (simulated time)")
    ap.add_argument("--time-scale", type=float, default=10.0, help="engine-sim --time-scale")
    ap.add_argument("--runs", type=int, default=3, help="HTTP runs per policy")
    ap.add_argument("--arrival-seeds", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--out", help="directory for recordings, bench and replay JSON, summary.json")
    ap.add_argument("--report", metavar="SUMMARY_JSON", help="print the tables of an earlier run's summary.json and exit")
    args = ap.parse_args()
    if args.report:
        saved = json.loads(pathlib.Path(args.report).read_text())
        for policy, p in saved["policies"].items():
            report(policy, p, saved["args"]["time_scale"])
        return 0
    if not args.out:
        sys.exit("--out is required (or --report SUMMARY_JSON)")
    if args.runs < 1 or args.engines < 1 or args.time_scale <= 0 or args.rate_scale <= 0:
        sys.exit("--runs and --engines must be at least 1, --time-scale and --rate-scale > 0")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.arrival_seeds.split(",") if s.strip()]
    trace_flags = [*SLICE, "--rate-scale", str(args.rate_scale)]
    summary = {"args": vars(args), "policies": {}}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        even = replay(args, args.trace, policy, trace_flags)
        seeded = [replay(args, args.trace, policy, [*trace_flags, "--arrival-seed", str(k)]) for k in seeds]
        runs = [http_run(args, policy, f"{policy}_run{i + 1}") for i in range(args.runs)]
        summary["policies"][policy] = {"replay_even": even, "replay_seeded": seeded, "runs": runs}
        report(policy, summary["policies"][policy], args.time_scale)
    (pathlib.Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
