#!/usr/bin/env python3
"""Compares prefill_cost with every other policy over several arrival realisations.

Runs `kvroute replay --policy all --prefix-state approximate,precise --arrival-seed K` for
each seed K (each whole second's requests at seeded random instants: the same trace at the
same load), averages each policy's mean and p99 TTFT over the seeds, and prints, per load
point and prefix state, prefill_cost against the best other policy on each metric. A point
is a win when prefill_cost's averaged mean *and* p99 are both below every other policy's,
with no more rejections.

    scripts/replay-realisations.py --engines 8 --rates 2.5,2.75,3,3.25 --out /tmp/real8

Needs only the Python standard library and a release build of kvroute
(`cargo build --release -p kvroute`).
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvroute", default="target/release/kvroute")
    ap.add_argument("--trace", default="data/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--rates", default="2.5,2.75,3,3.25")
    ap.add_argument("--seeds", default="1,2,3,4,5", help="arrival seeds, comma-separated")
    ap.add_argument("--out", required=True, help="directory for the per-seed JSON reports")
    ap.add_argument("--policy", default="prefill_cost", help="the policy compared with all others")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for k in seeds:
        path = out / f"e{args.engines}_seed{k}.json"
        cmd = [args.kvroute, "replay", "--trace", args.trace, "--policy", "all", "--engines", str(args.engines),
               "--prefix-state", "approximate,precise", "--rate-scale", args.rates, "--arrival-seed", str(k),
               "--quiet", "--json", str(path)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs.append(json.loads(path.read_text()))

    # (policy, state, rate) -> list of reports, one per seed
    table: dict[tuple[str, str, float], list[dict]] = {}
    for run in runs:
        for r in run["reports"]:
            name, _, state = r["policy"].partition("/")
            table.setdefault((name, state or "approximate", r["rate_scale"]), []).append(r)

    def avg(key, field):
        return statistics.mean(r[field] for r in table[key])

    print(f"{args.trace}: {runs[0]['requests']} requests, {args.engines} engines, arrival seeds {args.seeds}; "
          f"mean / p99 TTFT in s, averaged over the seeds")
    print(f"{'state':<12}{'rate':>6}  {args.policy + ' mean/p99':>22}  {'best other mean':>28}  {'best other p99':>28}  verdict")
    wins = total = 0
    for (name, state, rate) in sorted(k for k in table if k[0] == args.policy):
        me = (name, state, rate)
        # Prefix-blind policies run once and are reported without a state: they compete in both.
        rivals = [k for k in table if k[0] != args.policy and k[2] == rate and (k[1] == state or
                  not any(j[0] == k[0] and j[1] != k[1] for j in table))]
        bm = min(rivals, key=lambda k: avg(k, "ttft_mean_s"))
        bp = min(rivals, key=lambda k: avg(k, "ttft_p99_s"))
        rej_ok = max(r["rejection_rate"] for r in table[me]) <= min(max(r["rejection_rate"] for r in table[k]) for k in rivals)
        win = avg(me, "ttft_mean_s") < avg(bm, "ttft_mean_s") and avg(me, "ttft_p99_s") < avg(bp, "ttft_p99_s") and rej_ok
        wins += win
        total += 1
        print(f"{state:<12}{rate:>6}  {avg(me, 'ttft_mean_s'):>10.3f} / {avg(me, 'ttft_p99_s'):>8.2f}  "
              f"{bm[0]:>16} {avg(bm, 'ttft_mean_s'):>10.3f}  {bp[0]:>16} {avg(bp, 'ttft_p99_s'):>10.2f}  "
              f"{'win' if win else '-'}")
    print(f"{args.policy} wins {wins} of {total} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
