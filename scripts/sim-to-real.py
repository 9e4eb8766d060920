#!/usr/bin/env python3
"""Sim-to-real check: replay the traffic kvroute recorded on llama.cpp workers through the
engine model and compare the replay's TTFT with the one measured.

Each run is one `kvroute bench compare --engine llama` of a single kvroute policy with
`KVROUTE_RECORD=FILE` set (its `kvroute serve` then writes the traffic it routed as a
privacy-safe trace, docs/replay.md) and `--log-dir DIR` (the llama-server logs).

    python3 scripts/sim-to-real.py --kvroute target/release/kvroute --engines 4 \\
        --run round_robin:/tmp/s2r/round_robin.jsonl:/tmp/s2r/round_robin.json:/tmp/s2r/logs-round_robin \\
        --run least_ttft/slots:/tmp/s2r/least_ttft-slots.jsonl:/tmp/s2r/least_ttft-slots.json:/tmp/s2r/logs-least_ttft-slots

Calibration (one profile for every run, pooled over all their llama-server logs): the
`cpu-smollm2-135m` profile with
- `prefill_per_token_s` = total `prompt eval time` / total prompt tokens computed;
- `step_overhead_s` = (total `eval time` − total `prompt eval time`) / total tokens decoded
  (requests that decoded more than one token): the time per decoded token a request saw
  under the run's own CPU sharing (4 one-thread workers on this machine's 2 cores), less
  the prefills of the other slot that ran inside its decode (the engine model charges
  those in their own step; with 2 slots busy most of the time, nearly every prefill
  overlaps a decoding request);
- `decode_per_seq_s` 0 (the measured per-token time already includes the other slot).
A policy name ending in `/slots` is replayed with `--prefix-state slots`. Every replay runs
with `--closed-sessions`: the bench's conversations send a turn when the previous one has
answered, so a turn arrives in the replay when its previous turn ends there, not at the
time it was recorded.

With `--calibration FILE` (from `scripts/llama-calibrate.py --json`) the profile is instead
one worker's alone on a core, and `--host-cores 2` makes the replay's engines share the
host's cores as the real workers do (each busy engine at min(1, cores / busy engines) of
its speed); `--session-concurrency N` starts a conversation when one ends, N at a time, as
the bench's client (`--conversation-concurrency N`) does:

    python3 scripts/sim-to-real.py --kvroute target/release/kvroute --engines 4 \\
        --calibration docs/results/sim_to_real/calibration.json --host-cores 2 --session-concurrency 8 \\
        --run round_robin:... --run round_robin:... --run least_ttft/slots:...

A run given a fifth field, `:CALIBRATION.json` (`scripts/llama-calibrate.py --workers 4
--levels 1,2,3,4 --json FILE` taken right before that run), is replayed with that
one-worker-alone profile (with its prefill attention, when the file has it): the machine's
speed drifts, and this follows it without taking anything from the run itself (use it with
`--host-cores`).

With `--contention` the replay's engines slow each other down as measured: the calibration
file's slow-down at 1, 2, … busy workers (its `host_slowdown`, or its `levels`: take it with
`--levels 1,2,3,4`) goes to `kvroute replay --host-slowdown` in place of `--host-cores`'
processor sharing, which leaves out the caches and memory bandwidth the workers share
(1.06× at 2 busy workers on this machine's 2 cores one evening, 0.94–1.12× the next day).
A run with its own calibration file
takes the slow-down from that file.

With `--calibrate-per-run` each run is replayed with the profile of its own logs instead
of one profile pooled over all runs' logs (when the machine's speed drifts between runs;
that profile then carries the run's own contention, so it predicts less).

Prints, per run: measured and replayed mean and p99 TTFT and the replay's error; with
several runs of a policy, their averages and whether the ranking by mean TTFT is the same.
"""
import argparse
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import tempfile

_spec = importlib.util.spec_from_file_location("llama_calibrate", pathlib.Path(__file__).resolve().parent / "llama-calibrate.py")
llama_calibrate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_calibrate)

PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
DECODE = re.compile(r"\s eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def calibrate(log_dirs):
    p_ms = p_tok = d_ms = d_tok = 0.0
    for d in log_dirs:
        for f in sorted(pathlib.Path(d).glob("*llama*.log")):
            for line in f.read_text(errors="replace").splitlines():
                m = PROMPT.search(line)
                if m:
                    p_ms += float(m.group(1))
                    p_tok += int(m.group(2))
                    continue
                m = DECODE.search(line)
                if m and int(m.group(2)) > 1:
                    d_ms += float(m.group(1))
                    d_tok += int(m.group(2))
    if p_tok == 0 or d_tok == 0:
        sys.exit("sim-to-real: no `prompt eval time` / `eval time` lines in the llama-server logs")
    step_ms = max(d_ms - p_ms, 0.1 * d_ms) / d_tok
    return {"prefill_per_token_s": p_ms / p_tok / 1000, "step_overhead_s": step_ms / 1000, "decode_per_seq_s": 0.0}


def contention(path):
    """The slow-down at 1, 2, … busy workers in a `scripts/llama-calibrate.py --json` file
    (its `host_slowdown`, or computed from its `levels` for files written before it)."""
    cal = json.loads(pathlib.Path(path).read_text())
    out = cal.get("host_slowdown") or llama_calibrate.host_slowdown(cal.get("levels", []))
    if len(out) < 2:
        sys.exit(f"--contention: {path} measured one busy level only (take it with --levels 1,2,3,4)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvroute", required=True)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--run", action="append", required=True,
                    help="POLICY:RECORD.jsonl:BENCH.json:LOGDIR[:CALIBRATION.json] (repeat a policy for several "
                    "runs; a fifth field replays that run with the one-worker-alone profile of a "
                    "`scripts/llama-calibrate.py --json` file taken right before it)")
    ap.add_argument("--calibration", help="a `scripts/llama-calibrate.py --json` file: its one-worker-alone "
                    "profile instead of the runs' logs")
    ap.add_argument("--calibrate-per-run", action="store_true",
                    help="calibrate each run on its own llama-server logs instead of pooling all runs' logs "
                    "(the machine's speed drifts between runs)")
    ap.add_argument("--host-cores", type=int, default=0, help="kvroute replay --host-cores (0: engines independent)")
    ap.add_argument("--contention", action="store_true",
                    help="replay with the calibration file's measured slow-down per busy worker count "
                    "(kvroute replay --host-slowdown) instead of --host-cores' processor sharing")
    ap.add_argument("--session-concurrency", type=int, default=0,
                    help="kvroute replay --session-concurrency (the bench's --conversation-concurrency)")
    a = ap.parse_args()
    runs = []
    for spec in a.run:
        parts = spec.split(":")
        if len(parts) not in (4, 5):
            sys.exit(f"--run {spec}: expected POLICY:RECORD.jsonl:BENCH.json:LOGDIR[:CALIBRATION.json]")
        runs.append(parts if len(parts) == 5 else [*parts, None])
    if any(r[4] for r in runs) and (a.calibration or a.calibrate_per_run):
        sys.exit("a run's own calibration file excludes --calibration and --calibrate-per-run")
    if a.calibration and a.calibrate_per_run:
        sys.exit("--calibration and --calibrate-per-run exclude each other")
    if a.contention and not (a.calibration or all(r[4] for r in runs)):
        sys.exit("--contention takes the slow-down from a calibration file: --calibration FILE, or one per run")
    if a.calibration:
        cal = json.loads(pathlib.Path(a.calibration).read_text())["profile"]
        print(f"cpu-smollm2-135m from {a.calibration} (one worker alone):", end=" ")
    elif a.calibrate_per_run:
        cal = None
        print("cpu-smollm2-135m calibrated on each run's own logs (prefill ms/token and step ms per run below)", end=" ")
    else:
        cal = calibrate([r[3] for r in runs if not r[4]]) if not all(r[4] for r in runs) else None
        if cal is None:
            print("cpu-smollm2-135m from each run's own calibration file (one worker alone, right before the run)",
                  end=" ")
        else:
            print("cpu-smollm2-135m calibrated on the runs' logs:", end=" ")
    if cal is not None:
        print(", ".join(f"{k} {v * 1000:.2f} ms" for k, v in cal.items()), end=" ")
    host = "measured slow-down per busy worker count" if a.contention else (a.host_cores or "independent")
    print(f"| host cores {host} | sessions at a time {a.session_concurrency or 'any'}")
    print("| policy | measured TTFT mean / p99 (s) | replay mean / p99 (s) | replay error mean / p99 "
          "| hit %, measured / replay | TPOT p50 (ms), measured / replay |")
    print("|---|---|---|---|---|---|")
    per_policy = {}
    for policy, record, bench, logs, cal_file in runs:
        if cal_file:
            run_cal = json.loads(pathlib.Path(cal_file).read_text())["profile"]
            print(f"{policy} ({cal_file}): prefill {1000 * run_cal['prefill_per_token_s']:.2f} ms/token "
                  f"+ {1e6 * run_cal.get('prefill_attention_s', 0.0):.2f} µs per attended pair, "
                  f"decode {1000 * run_cal['decode_per_seq_s']:.1f} ms per sequence", file=sys.stderr)
        else:
            run_cal = cal if cal is not None else calibrate([logs])
        if cal is None and not cal_file:
            print(f"{policy} ({logs}): prefill {1000 * run_cal['prefill_per_token_s']:.2f} ms/token, "
                  f"step {1000 * run_cal['step_overhead_s']:.1f} ms", file=sys.stderr)
        slowdown = contention(cal_file or a.calibration) if a.contention else []
        if slowdown:
            print(f"{policy}: host slow-down {','.join(f'{x:.3f}' for x in slowdown)}", file=sys.stderr)
        rows = json.loads(pathlib.Path(bench).read_text())["rows"]
        q = next(r["quality"] for r in rows if r["router"] == "kvroute" and r["policy"] == policy)
        name, slots = (policy[: -len("/slots")], True) if policy.endswith("/slots") else (policy, False)
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "replay.json"
            cmd = [a.kvroute, "replay", "--trace", record, "--engines", str(a.engines), "--profile", "cpu-smollm2-135m",
                   "--profile-set", json.dumps(run_cal), "--policy", name,
                   "--prefix-state", "slots" if slots else "approximate", "--closed-sessions",
                   "--host-cores", str(a.host_cores), "--session-concurrency", str(a.session_concurrency),
                   "--quiet", "--json", str(out)]
            if slowdown:
                cmd += ["--host-slowdown", ",".join(str(x) for x in slowdown)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            rep = json.loads(out.read_text())["reports"][0]
        m = (q["ttft_mean_s"], q["ttft_p99_s"], q["cached_token_ratio"], q["tpot_p50_s"])
        r = (rep["ttft_mean_s"], rep["ttft_p99_s"], rep["hit_ratio"], rep["tpot_p50_s"])
        per_policy.setdefault(policy, []).append((m, r))
        print(row(policy, m, r))
    if any(len(v) > 1 for v in per_policy.values()):
        print("\nAveraged over the runs of each policy (each run's mean, p99, hit ratio and TPOT p50, then their average):")
        print("| policy | runs | measured TTFT mean / p99 (s) | replay mean / p99 (s) | replay error mean / p99 "
              "| hit %, measured / replay | TPOT p50 (ms), measured / replay |")
        print("|---|---:|---|---|---|---|---|")
        avg = {}
        for policy, xs in per_policy.items():
            m = tuple(sum(x[0][j] for x in xs) / len(xs) for j in range(4))
            r = tuple(sum(x[1][j] for x in xs) / len(xs) for j in range(4))
            avg[policy] = (m, r)
            print(row(policy, m, r, runs=len(xs)))
        measured = sorted(avg, key=lambda p: avg[p][0][0])
        replayed = sorted(avg, key=lambda p: avg[p][1][0])
        print(f"\nranking by mean TTFT: measured {', '.join(measured)}; replay {', '.join(replayed)}"
              f" ({'the same' if measured == replayed else 'different'})")


def row(policy, m, r, runs=None):
    (mm, mp, mh, mt), (rm, rp, rh, rt) = m, r
    n = "" if runs is None else f" {runs} |"
    return (f"| {policy} |{n} {mm:.3f} / {mp:.2f} | {rm:.3f} / {rp:.2f} | {100 * (rm - mm) / mm:+.0f} % / "
            f"{100 * (rp - mp) / mp:+.0f} % | {100 * mh:.1f} / {100 * rh:.1f} | {1000 * mt:.0f} / {1000 * rt:.0f} |")


if __name__ == "__main__":
    main()
