#!/usr/bin/env python3
"""Benchmark (not a test): two kvroute binaries' `bench decision`, alternated in one session.

This VM's timings drift by tens of percent between minutes, and one process's earlier
policies change the later ones' timings (heap layout), so each round runs the OLD binary,
then the NEW one, each policy in a process of its own; the table is the median of the
rounds' p50 and p99 per policy and fleet size, in microseconds.

usage: scripts/decision-compare.py [--gateway] [--probe-at SECS] [--in-flight-spread N] OLD_BINARY NEW_BINARY WORKERS ROUNDS [POLICY,...]
       WORKERS as `kvroute bench decision --workers` (e.g. 256,1024,4096)
       --gateway: each decision with the gateway's candidate read (`bench decision --gateway`)
       --probe-at: when the probe is decided (`bench decision --probe-at`; both binaries need it)
       --in-flight-spread: the fleet's load spread (`bench decision --in-flight-spread`; both binaries need it)
"""
import json
import statistics
import subprocess
import sys

POLICIES = ("round_robin,random,least_load,power_of_two,consistent_hash,cache_aware,prefix_affinity,"
            "kv_score,lmetric,load_only,sticky,unified,capped,prefill_cost,least_ttft")


def main() -> int:
    extra = []
    while len(sys.argv) > 2 and sys.argv[1] in ("--gateway", "--probe-at", "--in-flight-spread"):
        if sys.argv[1] == "--gateway":
            extra.append("--gateway")
            del sys.argv[1]
        else:
            extra += [sys.argv[1], sys.argv[2]]
            del sys.argv[1:3]
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    old, new, workers, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    policies = (sys.argv[5] if len(sys.argv) > 5 else POLICIES).split(",")
    res: dict = {}
    for _ in range(rounds):
        for tag, binary in (("old", old), ("new", new)):
            for p in policies:
                out = subprocess.run(
                    [binary, "bench", "decision", "--workers", workers, "--policy", p, "--decisions", "5000", "--json", *extra],
                    capture_output=True, text=True, timeout=1200, check=True).stdout
                for line in out.splitlines():
                    o = json.loads(line)
                    res.setdefault((o["workers"], o["policy"]), {}).setdefault(tag, []).append((o["p50_ns"], o["p99_ns"]))
    print(f"# {old} (old) against {new} (new){' '.join([''] + extra)}: median of {rounds} alternating rounds, µs")
    print(f"{'workers':>7} {'policy':<16} {'old p50':>8} {'old p99':>8} {'new p50':>8} {'new p99':>8}")
    for (w, p), d in sorted(res.items(), key=lambda kv: (kv[0][0], policies.index(kv[0][1]))):
        med = lambda tag, i: statistics.median(x[i] for x in d[tag]) / 1000
        print(f"{w:>7} {p:<16} {med('old', 0):8.1f} {med('old', 1):8.1f} {med('new', 0):8.1f} {med('new', 1):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
