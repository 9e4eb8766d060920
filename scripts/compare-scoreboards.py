#!/usr/bin/env python3
"""Compares two saved scoreboards (scripts/scoreboard.py --out X writes X.json) point by
point: kvroute's default (least_ttft) against the best reference policy (every policy but
kvroute's own), under each, and which policy is first where.

usage: scripts/compare-scoreboards.py BEFORE.json AFTER.json [--bound-before B.json --bound-after A.json]

Prints, per family: the first places on mean TTFT, and the points where least_ttft's mean
or p99 is over 1.02x the best reference policy's at loads up to the knee (the issue #44
goal below the knee), with each ratio before and after. With the bound files
(scoreboard.py --bound SAVED --out ...), at each knee: least_ttft's mean over the
fleet-oracle bound's, before and after (goal: within 1.05x and <= the best reference).
Standard library only.
"""
import json
import sys

OWN = {"least_ttft", "prefill_cost"}


def load(path):
    with open(path) as f:
        return json.load(f)


def index(doc):
    out = {}
    for p in doc["points"]:
        out[(p["family"], p["engines"], p["load"])] = {x["policy"]: x for x in p["policies"]}
    return out


def ratios(pols):
    refs = [x for n, x in pols.items() if n not in OWN]
    best_mean = min(refs, key=lambda x: x["ttft_mean_s"])
    best_p99 = min(refs, key=lambda x: x["ttft_p99_s"])
    me = pols["least_ttft"]
    return (me["ttft_mean_s"] / best_mean["ttft_mean_s"], best_mean["policy"],
            me["ttft_p99_s"] / best_p99["ttft_p99_s"], best_p99["policy"])


def firsts(ix):
    count = {}
    for key, pols in ix.items():
        best = min(x["ttft_mean_s"] for x in pols.values())
        for n, x in pols.items():
            if x["ttft_mean_s"] <= best * (1 + 5e-4):
                count.setdefault((key[0], n), 0)
                count[(key[0], n)] += 1
    return count


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    before, after = index(load(args[0])), index(load(args[1]))
    fams = sorted({k[0] for k in after})
    print("## First places on mean TTFT (before -> after)\n")
    fb, fa = firsts(before), firsts(after)
    pols = sorted({n for (_, n) in list(fb) + list(fa)})
    print("| policy | " + " | ".join(fams) + " |")
    print("|---|" + "---:|" * len(fams))
    for n in pols:
        cells = [f"{fb.get((f, n), 0)} -> {fa.get((f, n), 0)}" for f in fams]
        if any(c != "0 -> 0" for c in cells):
            print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n## least_ttft / best reference, loads up to the knee (goal <= 1.02 mean and p99)\n")
    print("| family | engines | load | mean before | mean after | p99 before | p99 after | best ref after (mean, p99) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    met = {"before": 0, "after": 0}
    total = 0
    for key in sorted(after):
        if key[2] > 1 or key not in before:
            continue
        total += 1
        mb, _, pb, _ = ratios(before[key])
        ma, rm, pa, rp = ratios(after[key])
        met["before"] += mb <= 1.02 and pb <= 1.02
        met["after"] += ma <= 1.02 and pa <= 1.02
        if max(mb, pb, ma, pa) > 1.02:
            print(f"| {key[0]} | {key[1]} | {key[2]} | {mb:.3f} | {ma:.3f} | {pb:.3f} | {pa:.3f} | {rm}, {rp} |")
    print(f"\nmet at {met['before']} of {total} points before, {met['after']} of {total} after "
          "(rows listed only where a ratio is over 1.02)")
    if "--bound-before" in args and "--bound-after" in args:
        bb = load(args[args.index("--bound-before") + 1])
        ba = load(args[args.index("--bound-after") + 1])
        print("\n## At the knee: least_ttft against the fleet-oracle bound and the best reference\n")
        print("| family | engines | before: least_ttft / bound | / best ref | after: least_ttft / bound | / best ref | goal after |")
        print("|---|---:|---:|---:|---:|---:|---|")
        kb = {(r["family"], r["engines"]): r for r in bb["points"]}
        met, met_before = 0, 0
        for r in ba["points"]:
            key = (r["family"], r["engines"])
            cells = []
            for doc, ix in ((kb.get(key), before), (r, after)):
                knee = ix.get((key[0], key[1], 1.0))
                if not (doc and knee):
                    cells += ["-", "-"]
                    continue
                me = knee["least_ttft"]["ttft_mean_s"]
                bound = min(x["ttft_mean_s"] for x in doc["oracle"])
                cells += [f"{me / bound:.2f}", f"{me / doc['best_reference']['ttft_mean_s']:.2f}"]
            ok = cells[2] != "-" and float(cells[2]) <= 1.05 and float(cells[3]) <= 1.0
            met += ok
            met_before += cells[0] != "-" and float(cells[0]) <= 1.05 and float(cells[1]) <= 1.0
            print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {'met' if ok else '**not met**'} |")
        print(f"\nknee goal (mean <= 1.05x the bound and <= the best reference) met at {met_before} of "
              f"{len(bb['points'])} knees before, {met} of {len(ba['points'])} after")

main()
