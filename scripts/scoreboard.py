#!/usr/bin/env python3
"""Scoreboard: every routing policy on several workload families, fleets and loads.

    scripts/scoreboard.py [--out docs/results/scoreboard] [--families mooncake,agentic]
        [--fleets 4,8,16] [--seeds 1,2,3] [--loads 0.25,0.5,0.8,1,1.2] [--limit rag=3000]

For each workload family x fleet (4, 8 and 16 simulated engines, profile `--profile`,
default h100-llama3-8b):

1. **Knee.** round_robin's mean TTFT, averaged over the arrival seeds, is measured on a
   geometric ladder of rate multipliers (`--rate-scale`): from 0.125 (halved while that is
   not yet light: while halving still lowers the mean by more than 10 %) up by 2^(1/4) per
   rung until the mean exceeds `--knee-factor` (4) x the light-load mean, then refined
   between the last two rungs in steps of 2^(1/16). The knee is the smallest probed
   multiplier at which round_robin's mean exceeds 4x its light-load mean (precision ~4 %).
   It is round_robin's knee: prefix-aware policies reach theirs later.
2. **Loads.** `--loads` x knee (default 0.25, 0.5, 0.8, 1.0, 1.2: light to just past the knee).
3. **Replays.** `kvroute replay --policy all --rate-scale <loads> --arrival-seed K --json` for
   every seed K (default 1, 2, 3: each whole second's requests at seeded random instants,
   another realisation of the same trace at the same load). The Azure traces have recorded
   sub-second arrival times, which `--arrival-seed` does not change, so they run once.
4. **Ranks.** Per (family, fleet, load) each policy's mean TTFT, p99 TTFT, goodput (requests
   per second meeting TTFT <= 2 s and TPOT <= 0.1 s) and rejection rate are averaged over the
   seeds. Policies are ranked by mean TTFT, ties (equal to 3 significant digits) broken by p99
   (also to 3 digits); fully tied policies share a rank. "First on p99" ranks by p99 alone.
   Several policies can share a first place.

Families (`--families`, default all six):
  mooncake    data/traces/mooncake_conversation_trace.jsonl (vendored; Kimi chat, 12,031 req).
  azure_code  <--azure-dir>/azure_llm_2023_code.csv  (Azure LLM inference 2023, lengths only:
  azure_conv  <--azure-dir>/azure_llm_2023_conv.csv   no prefix reuse). Skipped, with a
              message, when the files are absent (default --azure-dir data/traces;
              not vendored, data/traces/README.md says where to get them).
  agentic     scripts/gen-traces.py agentic --seed <--gen-seed>  (defaults: see that script)
  rag         scripts/gen-traces.py rag     --seed <--gen-seed>
  mtbench     scripts/gen-traces.py mtbench --seed <--gen-seed>
Generated traces are written into --work (default a temporary directory).

Cost: the default run (6 families x 3 fleets x 5 loads x 3 seeds x 13 policies, full traces)
took 100 s wall (knee searches included) on this 2-core machine (Intel Xeon, 2 vCPUs) with a
release build; the generated traces take ~2 s. `--families`,
`--fleets`, `--seeds`, `--loads` and `--limit` (first N requests of a family's trace, e.g.
`--limit 3000` for all or `--limit rag=3000,agentic=4000`) cut it down.

Recheck (`--recheck SAVED.json [--knobs JSON]`): replays only the default policy
(least_ttft), with `--knobs` if given, over the points of a saved scoreboard — the same
families, fleets, rates, seeds, generator seed and limits — puts its numbers in place of the
saved ones, and prints the goal check. The reference policies keep their saved numbers, so
a knob setting is checked against all 72 points in about 15 s instead of a full run. It
writes nothing.

Bound (`--bound SAVED.json [--kv-oracle fleet|store] [--out OUT]`): at the knee of each
family with prefix reuse of a saved scoreboard, replays every policy with
`kvroute replay --kv-oracle` (each request finds, wherever it is sent, the longest prefix
of it that any engine holds (`fleet`) or has ever computed (`store`), copied at no cost), and
prints the best of them against the best reference policy: where even that misses the knee
goal, no router choosing among the same engines meets it. Writes OUT.md/.json with `--out`.

Pull (`--pull SAVED.json [--kv-pull GB_PER_SEC] [--bound-json BOUND.json] [--out OUT]`): at
the knee of each family with prefix reuse of a saved scoreboard, replays the default
policy with `kvroute replay --prefix-state precise --kv-pull` (a request's engine first
pulls the longer prefix another engine holds when the copy beats recomputing it;
docs/kv-migration.md), and prints its mean TTFT against the saved one without the pull,
the best reference policy's and, with `--bound-json` (a `--bound --out` file), the
fleet-oracle bound's. Writes OUT.md/.json with `--out`.

Output: `<--out>.md` (tables per family, fleet and load, and "where each policy is best") and
`<--out>.json` (every averaged number, the knees, the run's settings). Needs only the Python
standard library and a release build of kvroute (`cargo build --release -p kvroute`).
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = ["mooncake", "azure_code", "azure_conv", "agentic", "rag", "mtbench"]
REFERENCE = "least_ttft"  # kvroute's default policy, called out in the report
# kvroute's own policies; every other one is a reference ("seed") policy of the goal check:
# the source systems' (SGLang router, Ray Serve, Cognitora cgn-router, B3) and the baselines.
OWN = {"least_ttft", "prefill_cost"}
# Families without prefix reuse (the knee goal applies to the others).
NO_REUSE = {"azure_code", "azure_conv"}


def sig3(x: float) -> float:
    """x to 3 significant digits (the tie rule)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, 2 - int(math.floor(math.log10(abs(x)))))


def fmt_rate(r: float) -> str:
    return f"{r:.4g}"


class Runner:
    def __init__(self, args, work: pathlib.Path):
        self.kvroute = args.kvroute
        self.work = work
        self.prefix_state = args.prefix_state
        self.profile = args.profile
        self.kv_oracle = None
        self.kv_pull = None
        self.calls = 0

    def replay(self, trace, engines, rates, seed, policy, limit, tag, knobs=None):
        """Runs one `kvroute replay`; returns {rate string: {policy: report}}."""
        out = self.work / f"{tag}_e{engines}_s{seed}_{self.calls}.json"
        self.calls += 1
        cmd = [self.kvroute, "replay", "--trace", str(trace), "--policy", policy, "--engines", str(engines),
               "--rate-scale", ",".join(fmt_rate(r) for r in rates), "--quiet", "--json", str(out),
               "--prefix-state", self.prefix_state, "--profile", self.profile]
        if seed is not None:
            cmd += ["--arrival-seed", str(seed)]
        if limit:
            cmd += ["--limit", str(limit)]
        if knobs:
            cmd += ["--knobs", knobs]
        if self.kv_oracle:
            cmd += ["--kv-oracle", self.kv_oracle]
        if self.kv_pull:
            cmd += ["--kv-pull", str(self.kv_pull)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(out.read_text())
        res: dict = {}
        for r in doc["reports"]:
            key = min(rates, key=lambda x: abs(x - r["rate_scale"]))
            res.setdefault(fmt_rate(key), {})[r["policy"]] = r
        return res, doc["requests"]


def rr_means(run, fam, engines, rates, seeds):
    """round_robin's mean TTFT per rate, averaged over the seeds."""
    per = {fmt_rate(r): [] for r in rates}
    for s in seeds:
        res, _ = run.replay(fam["trace"], engines, rates, s, "round_robin", fam["limit"], f"{fam['name']}_knee")
        for r in rates:
            per[fmt_rate(r)].append(res[fmt_rate(r)]["round_robin"]["ttft_mean_s"])
    return {k: statistics.mean(v) for k, v in per.items()}


def find_knee(run, fam, engines, seeds, factor):
    """(knee multiplier, light-load mean TTFT, probes {rate: mean}) for round_robin."""
    probes = {}
    r0 = 0.125
    probes.update(rr_means(run, fam, engines, [r0, r0 / 2], seeds))
    for _ in range(6):  # walk down until halving the load no longer lowers the mean by > 10 %
        if probes[fmt_rate(r0 / 2)] >= 0.9 * probes[fmt_rate(r0)]:
            break
        r0 /= 2
        probes.update(rr_means(run, fam, engines, [r0 / 2], seeds))
    light = probes[fmt_rate(r0)]
    threshold = factor * light
    k = 0
    while True:
        rungs = [r0 * 2 ** ((k + j) / 4) for j in range(1, 5)]
        k += 4
        m = rr_means(run, fam, engines, rungs, seeds)
        probes.update(m)
        above = next((r for r in rungs if m[fmt_rate(r)] > threshold), None)
        if above is not None:
            break
        if rungs[-1] > 512:
            return None, light, probes
    prev = above / 2 ** 0.25
    fine = [prev * 2 ** (j / 16) for j in range(1, 4)]
    fine = [r for r in fine if r < above]
    m = rr_means(run, fam, engines, fine, seeds) if fine else {}
    probes.update(m)
    knee = next((r for r in fine if m[fmt_rate(r)] > threshold), above)
    return knee, light, probes


def prepare_families(args, work):
    """[{name, trace, limit, realisations, source}] for the families asked for and present."""
    limits = {}
    for part in (args.limit or "").split(","):
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            limits[k.strip()] = int(v)
        else:
            limits["*"] = int(part)
    fams = []
    azure = pathlib.Path(args.azure_dir)
    for name in args.families.split(","):
        name = name.strip()
        if name not in FAMILIES:
            raise SystemExit(f"--families: unknown family `{name}` (known: {', '.join(FAMILIES)})")
        lim = limits.get(name, limits.get("*"))
        if name == "mooncake":
            trace = REPO / "data/traces/mooncake_conversation_trace.jsonl"
            fams.append(dict(name=name, trace=trace, limit=lim, realisations=True,
                             source="data/traces/mooncake_conversation_trace.jsonl (vendored)"))
        elif name.startswith("azure_"):
            trace = azure / f"azure_llm_2023_{name[6:]}.csv"
            if not trace.exists():
                print(f"skipping {name}: {trace} not found (give --azure-dir)", file=sys.stderr)
                continue
            fams.append(dict(name=name, trace=trace, limit=lim, realisations=False,
                             source=f"azure_llm_2023_{name[6:]}.csv (outside the repository)"))
        else:
            trace = work / f"{name}.jsonl"
            cmd = [sys.executable, str(REPO / "scripts/gen-traces.py"), name, "--out", str(trace),
                   "--seed", str(args.gen_seed)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            fams.append(dict(name=name, trace=trace, limit=lim, realisations=True,
                             source=f"scripts/gen-traces.py {name} --seed {args.gen_seed}",
                             ))
    return fams


def trace_stats(path, limit):
    """(requests, mean prompt tokens, mean output tokens) of the first `limit` requests."""
    ins, outs = [], []
    with open(path) as f:
        if str(path).endswith(".csv"):
            f.readline()
            for line in f:
                parts = line.strip().split(",")
                if len(parts) >= 3:
                    ins.append(int(parts[1]))
                    outs.append(int(parts[2]))
                if limit and len(ins) == limit:
                    break
        else:
            for line in f:
                if line.strip():
                    j = json.loads(line)
                    ins.append(j["input_length"])
                    outs.append(j["output_length"])
                if limit and len(ins) == limit:
                    break
    return len(ins), statistics.mean(ins), statistics.mean(outs)


def rank(rows):
    """Competition ranks by (mean, p99) to 3 significant digits; and by p99 alone."""
    key = lambda r: (sig3(r["ttft_mean_s"]), sig3(r["ttft_p99_s"]))
    ordered = sorted(rows, key=lambda r: (key(r), r["policy"]))
    for r in ordered:
        r["rank"] = 1 + sum(1 for o in rows if key(o) < key(r))
        r["rank_p99"] = 1 + sum(1 for o in rows if sig3(o["ttft_p99_s"]) < sig3(r["ttft_p99_s"]))
    return ordered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    default_bin = pathlib.Path.home() / ".cache/kvroute/target-rel/release/kvroute"
    if not default_bin.exists():
        default_bin = REPO / "target/release/kvroute"
    ap.add_argument("--kvroute", default=str(default_bin), help="kvroute binary (release build)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--fleets", default="4,8,16", help="engine counts")
    ap.add_argument("--seeds", default="1,2,3", help="arrival seeds (realisations)")
    ap.add_argument("--loads", default="0.25,0.5,0.8,1,1.2", help="multiples of round_robin's knee")
    ap.add_argument("--knee-factor", type=float, default=4.0,
                    help="knee: round_robin's mean TTFT exceeds this x its light-load mean")
    ap.add_argument("--azure-dir", default=str(REPO / "data/traces"))
    ap.add_argument("--limit", help="first N requests of each trace: N, or FAMILY=N,...")
    ap.add_argument("--gen-seed", type=int, default=1, help="seed of the generated traces")
    ap.add_argument("--prefix-state", default="approximate", help="passed to kvroute replay")
    ap.add_argument("--profile", default="h100-llama3-8b", help="engine profile, passed to kvroute replay")
    ap.add_argument("--work", help="directory for traces and per-run JSON (default: a temporary one)")
    ap.add_argument("--out", help="writes OUT.md and OUT.json (default docs/results/scoreboard; with --bound, "
                                  "nothing unless given)")
    ap.add_argument("--recheck", metavar="SAVED_JSON",
                    help=f"replay only {REFERENCE} over a saved scoreboard's points and print the goal check")
    ap.add_argument("--knobs", help=f"with --recheck: {REFERENCE}'s knobs as a JSON object")
    ap.add_argument("--bound", metavar="SAVED_JSON",
                    help="replay every policy with a KV oracle at the knees of a saved scoreboard and print "
                         "how far below the best reference policy the best of them gets")
    ap.add_argument("--kv-oracle", choices=["fleet", "store"],
                    help="with --bound: the oracle (kvroute replay --kv-oracle; default fleet)")
    ap.add_argument("--pull", metavar="SAVED_JSON",
                    help=f"replay {REFERENCE} with KV pulls at the knees of a saved scoreboard")
    ap.add_argument("--kv-pull", type=float, default=50.0, metavar="GB_PER_SEC",
                    help="with --pull: the link between engines (kvroute replay --kv-pull; default 50)")
    ap.add_argument("--bound-json", metavar="BOUND_JSON", help="with --pull: a `--bound --out` JSON to compare with")
    args = ap.parse_args()
    if sum(bool(x) for x in (args.recheck, args.bound, args.pull)) > 1:
        raise SystemExit("--recheck, --bound and --pull: one at a time")
    if args.bound_json and not args.pull:
        raise SystemExit("--bound-json needs --pull")
    if args.pull:
        with tempfile.TemporaryDirectory(prefix="kvroute-pull-") as tmp:
            return pull(args, pathlib.Path(tmp))
    if args.knobs and not args.recheck:
        raise SystemExit("--knobs needs --recheck (a full run replays every policy with its defaults)")
    if args.recheck and args.bound:
        raise SystemExit("--recheck and --bound: one at a time")
    if args.kv_oracle and not args.bound:
        raise SystemExit("--kv-oracle needs --bound (the scoreboard itself replays without an oracle)")
    if args.bound:
        args.kv_oracle = args.kv_oracle or "fleet"
        with tempfile.TemporaryDirectory(prefix="kvroute-bound-") as tmp:
            return bound(args, pathlib.Path(tmp))
    if args.recheck:
        with tempfile.TemporaryDirectory(prefix="kvroute-recheck-") as tmp:
            return recheck(args, pathlib.Path(tmp))
    args.out = args.out or str(REPO / "docs/results/scoreboard")

    t0 = time.monotonic()
    tmp = None
    if args.work:
        work = pathlib.Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="kvroute-scoreboard-")
        work = pathlib.Path(tmp)
    fleets = [int(x) for x in args.fleets.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    run = Runner(args, work)
    fams = prepare_families(args, work)
    points = []
    fam_meta = {}
    for fam in fams:
        fseeds = seeds if fam["realisations"] else [None]
        meta = fam_meta[fam["name"]] = {k: str(v) if isinstance(v, pathlib.Path) else v
                                        for k, v in fam.items() if k != "trace"}
        meta["knees"] = {}
        meta["requests"], meta["mean_prompt_tokens"], meta["mean_output_tokens"] = trace_stats(fam["trace"], fam["limit"])
        for engines in fleets:
            knee, light, probes = find_knee(run, fam, engines, fseeds, args.knee_factor)
            meta["knees"][str(engines)] = {"knee": knee, "light_mean_ttft_s": light, "probes": probes}
            if knee is None:
                print(f"{fam['name']} on {engines} engines: no knee up to x512; skipped", file=sys.stderr)
                continue
            rates = [knee * f for f in loads]
            acc = seeded_reports(run, fam, engines, rates, fseeds, "all", fam["name"])
            meta["infinite_cache_hit"] = next(iter(acc.values()))[-1]["infinite_cache_hit_ratio"]
            for f, r in zip(loads, rates):
                rows = []
                for (rk, pol), reps in acc.items():
                    if rk != fmt_rate(r):
                        continue
                    rows.append(averaged(pol, reps))
                points.append({"family": fam["name"], "engines": engines, "load": f, "rate_scale": r,
                               "policies": rank(rows)})
            print(f"{fam['name']} on {engines} engines: knee x{fmt_rate(knee)} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    elapsed = time.monotonic() - t0
    write_reports(args, fams, fam_meta, points, fleets, seeds, loads, elapsed)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def seeded_reports(run, fam, engines, rates, seeds, policy, tag, knobs=None):
    """{(rate string, policy): [one report per seed]} of `policy` (a name or "all") on `fam`."""
    acc: dict = {}
    for s in seeds:
        res, _ = run.replay(fam["trace"], engines, rates, s, policy, fam["limit"], tag, knobs)
        for r in rates:
            for pol, rep in res[fmt_rate(r)].items():
                acc.setdefault((fmt_rate(r), pol), []).append(rep)
    return acc


def best_of(rows):
    """(the row best on mean TTFT, ties broken by p99; the row best on p99) of a point's rows."""
    return (min(rows, key=lambda p: (p["ttft_mean_s"], p["ttft_p99_s"])),
            min(rows, key=lambda p: p["ttft_p99_s"]))


def averaged(policy, reps):
    """One policy's row of a point: its reports averaged over the seeds."""
    return {
        "policy": policy,
        "ttft_mean_s": statistics.mean(x["ttft_mean_s"] for x in reps),
        "ttft_p99_s": statistics.mean(x["ttft_p99_s"] for x in reps),
        "goodput_rps": statistics.mean(x["goodput_rps"] for x in reps),
        "rejection_rate": statistics.mean(x["rejection_rate"] for x in reps),
        "hit_ratio": statistics.mean(x["hit_ratio"] for x in reps),
        "offered_rps": statistics.mean(x["offered_rps"] for x in reps),
        "seeds": len(reps),
    }


def load_saved(args, path, flag, work):
    """A saved scoreboard's points and seeds, with the Runner and families (same generator
    seed, limits and prefix state) to replay them: (points, seeds, run, {name: family})."""
    try:
        saved = json.loads(pathlib.Path(path).read_text())
        points, seeds, families = saved["points"], saved["seeds"], saved["families"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{flag} {path}: not a scoreboard JSON ({e})")
    args.families = ",".join(families)
    args.prefix_state = saved.get("prefix_state", args.prefix_state)
    args.profile = saved.get("profile", args.profile)
    args.limit = ",".join(f"{n}={m['limit']}" for n, m in families.items() if m.get("limit"))
    for m in families.values():
        src = m.get("source", "")
        if "--seed " in src:
            args.gen_seed = int(src.rsplit("--seed ", 1)[1].split()[0])
    run = Runner(args, work)
    fams = {f["name"]: f for f in prepare_families(args, work)}
    return points, seeds, run, fams


def recheck(args, work) -> int:
    """`--recheck`: REFERENCE alone (with `--knobs`) over a saved scoreboard's points."""
    if args.knobs:
        try:
            if not isinstance(json.loads(args.knobs), dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise SystemExit(f"--knobs: must be a JSON object ({e})")
    points, seeds, run, fams = load_saved(args, args.recheck, "--recheck", work)
    groups: dict = {}
    for pt in points:
        groups.setdefault((pt["family"], pt["engines"]), []).append(pt)
    for (name, engines), pts in groups.items():
        fam = fams.get(name)
        if fam is None:
            raise SystemExit(f"--recheck: family {name} of the saved run is not available here")
        rates = [pt["rate_scale"] for pt in pts]
        acc = seeded_reports(run, fam, engines, rates, seeds if fam["realisations"] else [None], REFERENCE,
                             f"{name}_recheck", args.knobs)
        for pt in pts:
            rows = [p for p in pt["policies"] if p["policy"] != REFERENCE]
            pt["policies"] = rank(rows + [averaged(REFERENCE, acc[(fmt_rate(pt["rate_scale"]), REFERENCE)])])
    print(f"{REFERENCE} with knobs {args.knobs or '{}'} against {args.recheck}")
    print("\n".join(goal_check(points)))
    return 0


def bound(args, work) -> int:
    """`--bound`: every policy with `--kv-oracle` at the knee of every family with prefix
    reuse of a saved scoreboard; prints (and with `--out`, writes) how far below the best
    reference policy that oracle gets."""
    points, seeds, run, fams = load_saved(args, args.bound, "--bound", work)
    run.kv_oracle = args.kv_oracle
    pts = [pt for pt in points if pt["load"] == 1.0 and pt["family"] not in NO_REUSE]
    out = [f"# Oracle bound at the knee ({args.kv_oracle})", "",
           f"`scripts/scoreboard.py --bound {args.bound} --kv-oracle {args.kv_oracle}` "
           f"({datetime.date.today()}, {machine()}). At the knee of each family with prefix reuse, "
           f"every policy (`--policy all`) replayed with `kvroute replay --kv-oracle {args.kv_oracle}` "
           "(each request finds, wherever it is sent, the longest prefix of it that "
           + ("any engine's KV cache holds at its arrival" if args.kv_oracle == "fleet"
              else "any engine has computed so far, kept without bound")
           + ", copied to its engine at no cost), averaged over the saved run's seeds. The best of them "
           "is the bound (the load-only policies are no longer torn between cache and balance); the goal (mean <= 0.85x, p99 <= 0.9x the best reference policy) is out of reach "
           "for a router choosing among these engines where even the bound misses it.", "",
           "| family | engines | best ref (mean) | mean s | hit | least_ttft mean s | oracle best (mean) | mean s | hit "
           "| mean / best ref | best ref p99 s | oracle p99 s | p99 / best ref | goal reachable (what misses) |",
           "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    rows = []
    for pt in pts:
        acc = knee_reports(run, fams, pt, seeds, "all", "--bound")
        avg = [averaged(pol, reps) for (_, pol), reps in acc.items()]
        om, op = best_of(avg)
        bm, bp = best_of([p for p in pt["policies"] if p["policy"] not in OWN])
        me = next((p for p in pt["policies"] if p["policy"] == REFERENCE), None)
        rm, rp = om["ttft_mean_s"] / bm["ttft_mean_s"], op["ttft_p99_s"] / bp["ttft_p99_s"]
        reach = ("yes" if rm <= 0.85 and rp <= 0.9 else "**no** (p99)" if rm <= 0.85 else
                 "**no** (mean)" if rp <= 0.9 else "**no** (both)")
        out.append(f"| {pt['family']} | {pt['engines']} | {bm['policy']} | {bm['ttft_mean_s']:.3f} | "
                   f"{bm['hit_ratio']:.3f} | {me['ttft_mean_s'] if me else float('nan'):.3f} | {om['policy']} | "
                   f"{om['ttft_mean_s']:.3f} | {om['hit_ratio']:.3f} | {rm:.2f} | {bp['ttft_p99_s']:.2f} | "
                   f"{op['ttft_p99_s']:.2f} | {rp:.2f} | {reach} |")
        rows.append({"family": pt["family"], "engines": pt["engines"], "rate_scale": pt["rate_scale"],
                     "best_reference": bm, "best_reference_p99": bp, "oracle": avg,
                     "mean_ratio": rm, "p99_ratio": rp, "reachable": reach})
        print(out[-1], file=sys.stderr)
    write_out(args, out, {"kv_oracle": args.kv_oracle, "seeds": seeds, "points": rows})
    return 0


def knee_reports(run, fams, pt, seeds, policy, flag):
    """{(rate, policy): [one report per seed]} of `policy` (a name or "all") at a saved
    scoreboard's point `pt`."""
    fam = fams.get(pt["family"])
    if fam is None:
        raise SystemExit(f"{flag}: family {pt['family']} of the saved run is not available here")
    return seeded_reports(run, fam, pt["engines"], [pt["rate_scale"]], seeds if fam["realisations"] else [None],
                          policy, f"{pt['family']}_{flag.strip('-')}")


def write_out(args, lines, doc):
    """Prints the report `lines`; with `--out`, writes them to OUT.md and `doc` (with the
    command, date and machine) to OUT.json."""
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out + ".md").write_text(text)
        head = {"command": " ".join(sys.argv), "date": str(datetime.date.today()), "machine": machine()}
        pathlib.Path(args.out + ".json").write_text(json.dumps({**head, **doc}, indent=1) + "\n")


def pull(args, work) -> int:
    """`--pull`: the default policy with KV pulls (`--prefix-state precise --kv-pull`) at the
    knee of every family with prefix reuse of a saved scoreboard, against the saved run and,
    with `--bound-json`, the fleet-oracle bound."""
    points, seeds, run, fams = load_saved(args, args.pull, "--pull", work)
    run.prefix_state, run.kv_pull = "precise", args.kv_pull
    oracle = {}
    if args.bound_json:
        try:
            for r in json.loads(pathlib.Path(args.bound_json).read_text())["points"]:
                oracle[(r["family"], r["engines"])] = best_of(r["oracle"])[0]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--bound-json {args.bound_json}: not a `--bound --out` JSON ({e})")
    pts = [pt for pt in points if pt["load"] == 1.0 and pt["family"] not in NO_REUSE]
    out = [f"# {REFERENCE} with KV pulls at the knee ({args.kv_pull} GB/s)", "",
           f"`scripts/scoreboard.py --pull {args.pull} --kv-pull {args.kv_pull}"
           + (f" --bound-json {args.bound_json}" if args.bound_json else "") + f"` ({datetime.date.today()}, "
           f"{machine()}). {REFERENCE} replayed with `kvroute replay --prefix-state precise --kv-pull "
           f"{args.kv_pull}`, averaged over the saved run's seeds, against the saved run's {REFERENCE} "
           "(no pull), its best reference policy and the fleet-oracle bound (the best policy with free copies).",
           "", "| family | engines | best ref mean s | no pull mean s | pull mean s | pulls / request | "
           "pull / no pull | pull / best ref | bound mean s | pull / bound | pull p99 s | no pull p99 s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for pt in pts:
        acc = knee_reports(run, fams, pt, seeds, REFERENCE, "--pull")
        reps = next(iter(acc.values()))
        me = averaged(REFERENCE, reps)
        pulls = statistics.mean(r.get("kv_pulls", 0) / max(r["requests"], 1) for r in reps)
        bm, _ = best_of([p for p in pt["policies"] if p["policy"] not in OWN])
        old = next(p for p in pt["policies"] if p["policy"] == REFERENCE)
        o = oracle.get((pt["family"], pt["engines"]))
        bound_s = f"{o['ttft_mean_s']:.3f} | {me['ttft_mean_s'] / o['ttft_mean_s']:.2f}" if o else "- | -"
        out.append(f"| {pt['family']} | {pt['engines']} | {bm['ttft_mean_s']:.3f} | {old['ttft_mean_s']:.3f} | "
                   f"{me['ttft_mean_s']:.3f} | {pulls:.2f} | {me['ttft_mean_s'] / old['ttft_mean_s']:.2f} | "
                   f"{me['ttft_mean_s'] / bm['ttft_mean_s']:.2f} | {bound_s} | {me['ttft_p99_s']:.2f} | "
                   f"{old['ttft_p99_s']:.2f} |")
        rows.append({"family": pt["family"], "engines": pt["engines"], "rate_scale": pt["rate_scale"],
                     "pull": me, "pulls_per_request": pulls, "no_pull": old, "best_reference": bm, "bound": o})
        print(out[-1], file=sys.stderr)
    write_out(args, out, {"kv_pull_gb_per_s": args.kv_pull, "seeds": seeds, "points": rows})
    return 0


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({model})"


def summary(points, fams):
    """{policy: {family: [mean firsts, p99 firsts]}}, with family "all"."""
    pols = sorted({p["policy"] for pt in points for p in pt["policies"]})
    s = {p: {f: [0, 0] for f in fams + ["all"]} for p in pols}
    for pt in points:
        for p in pt["policies"]:
            for f in (pt["family"], "all"):
                s[p["policy"]][f][0] += p["rank"] == 1
                s[p["policy"]][f][1] += p["rank_p99"] == 1
    return s


def goal_check(points):
    """Lines of the goal check: at each point the default's mean and p99 TTFT over the best
    reference (non-kvroute) policy's, and whether it meets the goal there: up to the knee
    (load <= 1) both <= 1.02; at the knee of a family with prefix reuse mean <= 0.85 and
    p99 <= 0.9; never more rejections than the best reference policy on mean."""
    out = ["", f"## Goal check: {REFERENCE} against the best reference policy", "",
           f"Reference policies: every policy but kvroute's own ({', '.join(sorted(OWN))}). Goal: at loads "
           "up to the knee, mean and p99 TTFT <= 1.02x the best reference policy's (each its own best); at the "
           "knee of a family with prefix reuse, mean <= 0.85x and p99 <= 0.9x; never more rejections. Past "
           "the knee (1.2) the ratios are shown without a goal.", "",
           "| family | engines | load | mean / best ref | best ref (mean) | p99 / best ref | best ref (p99) | "
           "rejected % (best ref) | goal |",
           "|---|---:|---:|---:|---|---:|---|---:|---|"]
    met = total = 0
    for pt in points:
        ps = pt["policies"]
        me = next((p for p in ps if p["policy"] == REFERENCE), None)
        refs = [p for p in ps if p["policy"] not in OWN]
        if me is None or not refs:
            continue
        bm, bp = best_of(refs)
        rm, rp = me["ttft_mean_s"] / bm["ttft_mean_s"], me["ttft_p99_s"] / bp["ttft_p99_s"]
        rej_ok = me["rejection_rate"] <= bm["rejection_rate"] + 1e-9
        if pt["load"] > 1.0:
            verdict = "-"
        else:
            if pt["load"] == 1.0 and pt["family"] not in NO_REUSE:
                ok = rm <= 0.85 and rp <= 0.9 and rej_ok
            else:
                ok = rm <= 1.02 and rp <= 1.02 and rej_ok
            verdict = "met" if ok else "**not met**"
            met += ok
            total += 1
        out.append(f"| {pt['family']} | {pt['engines']} | {pt['load']:g} | {rm:.2f} | {bm['policy']} | {rp:.2f} | "
                   f"{bp['policy']} | {100 * me['rejection_rate']:.2f} ({100 * bm['rejection_rate']:.2f}) | {verdict} |")
    out += ["", f"Goal met at {met} of {total} points (loads up to the knee).", ""]
    return out


def write_reports(args, fams, fam_meta, points, fleets, seeds, loads, elapsed):
    names = [f["name"] for f in fams]
    summ = summary(points, names)
    cmd = "scripts/scoreboard.py " + " ".join(a for a in sys.argv[1:])
    lines = [
        "# Scoreboard: every policy on every workload family",
        "",
        f"Written by `{cmd.strip()}` on {datetime.date.today().isoformat()}, "
        f"{machine()}, in {elapsed / 60:.1f} min. Profile h100-llama3-8b, prefix state "
        f"`{args.prefix_state}`, arrival seeds {','.join(map(str, seeds))} (Azure: its recorded "
        f"arrivals, one run), loads {', '.join(f'{x:g}' for x in loads)} x round_robin's knee "
        f"(the smallest rate multiplier at which round_robin's mean TTFT exceeds "
        f"{args.knee_factor:g}x its light-load mean). Numbers are means over the seeds. Rank: by "
        f"mean TTFT, ties (3 significant digits) by p99; goodput = requests/s with TTFT <= 2 s "
        f"and TPOT <= 0.1 s. See `scripts/scoreboard.py` for the method and "
        f"`scripts/gen-traces.py` for the generated families.",
        "",
        "## Families",
        "",
        "| family | trace | requests | mean prompt | mean output | infinite-cache hit | knee (x trace rate) on "
        + ", ".join(f"{e}" for e in fleets) + " engines |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for f in fams:
        m = fam_meta[f["name"]]
        knees = ", ".join("-" if m["knees"][str(e)]["knee"] is None else f"x{m['knees'][str(e)]['knee']:.3g}"
                          for e in fleets)
        hit = f"{100 * m['infinite_cache_hit']:.1f} %" if "infinite_cache_hit" in m else "-"
        lines.append(f"| {f['name']} | {m['source']} | {m['requests']} | {m['mean_prompt_tokens']:.0f} | "
                     f"{m['mean_output_tokens']:.0f} | {hit} | {knees} |")
    lines += ["", "## Where each policy is best", "",
              "First places over the (fleet, load) points of each family: `mean / p99` = points where the "
              "policy is first on mean TTFT (ties by p99) / first on p99 TTFT. Shared first places count for "
              "each policy sharing them.", ""]
    head = "| policy | " + " | ".join(names) + " | all |"
    lines += [head, "|---|" + "---:|" * (len(names) + 1)]
    npts = {f: sum(1 for p in points if p["family"] == f) for f in names}
    order = sorted(summ, key=lambda p: (-summ[p]["all"][0], -summ[p]["all"][1], p))
    for p in order:
        cells = [f"{summ[p][f][0]} / {summ[p][f][1]}" for f in names + ["all"]]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| (points) | " + " | ".join(str(npts[f]) for f in names) + f" | {len(points)} |")

    # Ranks at a glance, per family.
    lines += ["", "## Ranks at a glance", "",
              "Rank on mean TTFT (ties by p99) at each fleet (engines) and load (x knee).", ""]
    for fam in names:
        pts = [p for p in points if p["family"] == fam]
        if not pts:
            continue
        cols = [f"{p['engines']}e x{p['load']:g}" for p in pts]
        lines += [f"**{fam}**", "", "| policy | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        pols = sorted({q["policy"] for p in pts for q in p["policies"]},
                      key=lambda n: (sum(next(q["rank"] for q in p["policies"] if q["policy"] == n) for p in pts), n))
        for n in pols:
            ranks = [str(next(q["rank"] for q in p["policies"] if q["policy"] == n)) for p in pts]
            lines.append(f"| {n} | " + " | ".join(ranks) + " |")
        lines.append("")

    # The reference policy against the best.
    lines += ["", f"## {REFERENCE} against the best policy", "",
              f"Each point where {REFERENCE} (the default) is not first on mean or on p99: its ratio "
              "to the best policy's number, and which policy that is.", "",
              "| family | engines | load | rank mean / p99 | mean / best mean | best on mean | p99 / best p99 | best on p99 |",
              "|---|---:|---:|---:|---:|---|---:|---|"]
    for pt in points:
        ps = pt["policies"]
        me = next((p for p in ps if p["policy"] == REFERENCE), None)
        if me is None or (me["rank"] == 1 and me["rank_p99"] == 1):
            continue
        bm, bp = best_of(ps)
        lines.append(f"| {pt['family']} | {pt['engines']} | {pt['load']:g} | {me['rank']} / {me['rank_p99']} | "
                     f"{me['ttft_mean_s'] / bm['ttft_mean_s']:.2f} | {bm['policy']} | "
                     f"{me['ttft_p99_s'] / bp['ttft_p99_s']:.2f} | {bp['policy']} |")

    # The goal (docs/lab/2026-11-26-replay-measurements.md, "least_ttft, the default, against
    # the goal"): the default against the best reference policy.
    lines += goal_check(points)

    lines += ["", "## Every point", ""]
    for pt in points:
        ps = pt["policies"]
        offered = statistics.mean(p["offered_rps"] for p in ps)
        lines += [f"### {pt['family']}, {pt['engines']} engines, {pt['load']:g} x knee "
                  f"(rate x{pt['rate_scale']:.3g}, {offered:.2f} req/s)", "",
                  "| rank | policy | mean TTFT s | p99 TTFT s | goodput req/s | rejected % | hit % |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for p in ps:
            lines.append(f"| {p['rank']} | {p['policy']} | {p['ttft_mean_s']:.3g} | {p['ttft_p99_s']:.3g} | "
                         f"{p['goodput_rps']:.2f} | {100 * p['rejection_rate']:.2f} | {100 * p['hit_ratio']:.1f} |")
        lines.append("")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    doc = {
        "command": cmd.strip(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "elapsed_s": round(elapsed, 1),
        "profile": args.profile,
        "prefix_state": args.prefix_state,
        "seeds": seeds,
        "loads": loads,
        "knee_factor": args.knee_factor,
        "families": fam_meta,
        "summary": {p: {f: {"first_mean": v[0], "first_p99": v[1]} for f, v in d.items()} for p, d in summ.items()},
        "points": points,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} ({elapsed:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
