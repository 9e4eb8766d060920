#!/usr/bin/env python3
"""Cluster-sync benchmark: what NATS replica sync costs a router replica.

Starts a nats-server and 4 instant engine-sim workers (they answer at once, so the routers
are the bottleneck), then, for each setting, N `kvroute serve` replicas in front of them and
a closed-loop `kvroute bench` round-robin over the replicas (the shared-prefix workload:
long common system prompts, so every request carries a prefix key). Settings: sync off
(no --nats) and sync on (--nats, one cluster), one after the other or, with
--side-by-side, both at once, each group of replicas with its own load generator over the
same window (the way to measure a few percent on a small, noisy machine: whatever state
the machine is in, both groups are in it; read the CPU per request, since the groups also
compete for the cores). From each replica's /metrics and /proc it reads:

  - events published and applied per second (kvroute_sync_events_total);
  - sync lag p50/p99 (kvroute_sync_lag_seconds: publication by a peer -> applied here;
    bucket upper bounds, so "<=");
  - decision time p50/p99/p99.9 (kvroute_decision_seconds, wall clock; bucket upper bounds)
    and the deciding thread's CPU time over the same decisions (kvroute_decision_cpu_seconds:
    the decision's own work; wall minus CPU is time the thread was descheduled);
  - involuntary context switches of the replica's threads per request it routed
    (/proc/PID/task/*/status: the OS took a core from a runnable thread);
  - peak and final RSS (VmHWM, VmRSS);
  - bytes the NATS server took in and sent out (its /varz monitoring endpoint), per
    request routed;
  - throughput (req/s) and failures from kvroute bench's JSON.

Standard library only. Usage:
  python3 scripts/cluster-bench.py --kvroute target/release/kvroute [--replicas 3]
      [--duration 20] [--concurrency 32] [--rounds 2] [--policy cache_aware] [--rate R]
      [--nats-server nats-server] [--nats-nice N] [--own-core] [--unique]
      [--sync-batch-ms MS] [--settings off,on] [--alternate] [--side-by-side] [--json OUT]
The closed loop saturates the machine (the routers' throughput); --rate R sends an open
loop of R requests/s in all, below saturation (decision time without CPU contention).
--nats-nice N runs nats-server at that nice level, so that on a machine shared with the
replicas it yields the cores to them, as a NATS on its own host would. --own-core gives
replica 0 CPU 0 to itself and runs every other process (the other replicas, NATS, the
workers, the load generator) on the remaining CPUs: replica 0's decision times then show
what the sync costs a replica on a core of its own, without the other processes' wake-ups.
--unique sends no prompt twice (by default the closed loop goes round 2,048 prompts, and
a replica sends a prompt the cluster applied within sync_refresh_secs as a repeat: load
only); with it every request adds a question the cluster has not seen.
--settings and --alternate set the settings of a round and their order: one after the
other, the same setting run twice (--settings off,off) differed by -18 to +16 % in
throughput on a 2-core VM, and side by side by -3 to +1 % in CPU per request; --alternate
runs on before off in every other round. --sync-batch-ms sets the replicas' sync_batch_ms
with the sync on. With --side-by-side and 3 rounds or more it ends with the rounds'
median CPU per request and the CPU per request at equal throughput: a group's CPU per
request also rises as its share of the throughput falls (two sync-off groups: -0.5 points
per point), so it reads the least-squares line of CPU against throughput over the rounds
at zero, the setting's own cost with that effect taken out.
Every process is on 127.0.0.1 and ends with the script.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvroute_procs import free_port, wait_ok


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def metrics(url):
    """Prometheus text -> {series_with_labels: value}."""
    out = {}
    for line in get(f"{url}/metrics")[1].splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def histogram(m, name):
    """Cumulative buckets [(le, count)] of histogram `name` (no labels)."""
    buckets = []
    for k, v in m.items():
        mm = re.fullmatch(re.escape(name) + r'_bucket\{le="([^"]+)"\}', k)
        if mm:
            le = float("inf") if mm.group(1) == "+Inf" else float(mm.group(1))
            buckets.append((le, v))
    return sorted(buckets)


def minus(a, b):
    """Bucket counts of a minus those of b (the same bounds)."""
    bb = dict(b)
    return [(le, c - bb.get(le, 0.0)) for le, c in a]


def quantile(buckets, q):
    """The upper bound of the bucket holding quantile q (None when empty)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    for le, c in buckets:
        if c >= target:
            return le
    return buckets[-1][0]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        s = f.read()
    grab = lambda k: int(re.search(rf"{k}:\s+(\d+) kB", s).group(1))
    return grab("VmRSS"), grab("VmHWM")


def involuntary_switches(pid):
    """Involuntary context switches summed over the process's threads."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", f.read()).group(1))
        except (OSError, AttributeError):
            pass  # a thread that ended between the listing and the read
    return total


def cpu_seconds(pid):
    """User + system CPU time of a process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fmt_s(x):
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf"
    if x < 1e-3:
        return f"{x * 1e6:.1f} us"
    return f"{x * 1e3:.2f} ms"


def varz(port):
    return json.loads(get(f"http://127.0.0.1:{port}/varz")[1])


def prompts_per_group(a):
    """Questions per system prompt: 64 (2,048 prompts, sent again and again by the closed
    loop), or enough that none is sent twice in the run (--unique, up to 8,000 requests/s;
    an open loop at --rate)."""
    if a.unique:
        return int(max(a.rate or 0, 8_000) * a.duration / 32) + 1
    return max(64, int(a.rate * a.duration / 32) + 1) if a.rate else 64


def start_group(a, workers, nats_url, sync, cluster):
    """N replicas in front of `workers`, in `cluster` with the sync on; ready."""
    procs, urls = [], []
    for _ in range(a.replicas):
        port = free_port()
        cmd = [a.kvroute, "serve", "--port", str(port), "--worker-urls", ",".join(workers), "--policy", a.policy]
        if sync:
            cmd += ["--nats", nats_url, "--cluster", cluster]
            if a.sync_config:
                cmd += ["--config", a.sync_config]
        # --own-core: replica 0 alone on CPU 0 (the script and its other children run on the rest).
        pin = (lambda: os.sched_setaffinity(0, {0})) if a.own_core and not procs else None
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u in urls:
            wait_ok(f"{u}/readiness", "replica")
    except BaseException:  # wait_ok exits: the replicas go with the script
        stop_group(procs)
        raise
    return procs, urls


def stop_group(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def sample(a, procs, urls):
    """What the results are differences of: the replicas' metrics, switches and CPU."""
    return {"metrics": [metrics(u) for u in urls], "switches": [involuntary_switches(p.pid) for p in procs],
            "cpu": [cpu_seconds(p.pid) for p in procs]}


def load(a, urls, out):
    """The load generator over `urls`, writing its JSON to `out` (not started)."""
    return [a.kvroute, "bench", "--url", ",".join(urls), "--workload", "shared-prefix", "--groups", "32",
            # Open loop: enough requests for the whole duration (the workload is finite).
            "--prompts-per-group", str(prompts_per_group(a)), "--system-tokens", "1024", "--question-tokens", "64",
            "--output-tokens", "1", "--max-concurrency", str(a.concurrency), "--duration",
            str(a.duration), "--no-stream", "--quiet", "--json", out] + (
                ["--rate", str(a.rate)] if a.rate else ["--closed-loop"])


def read_summary(a, out):
    summary = json.load(open(out))["summary"]
    os.unlink(out)
    if a.unique and summary["requests"] > 32 * prompts_per_group(a):
        print(f"  warning: {summary['requests']} requests over {32 * prompts_per_group(a)} prompts: some sent twice",
              flush=True)
    return summary


def result(a, sync, round_no, procs, s0, s1, summary, wall, nats0, nats1):
    """One setting's figures from the samples before and after its load (nats0/nats1: the
    NATS server's varz and CPU seconds, or None when the setting does not use it)."""
    rows = []
    for i, (b, m) in enumerate(zip(s0["metrics"], s1["metrics"])):
        d = lambda k: m.get(k, 0.0) - b.get(k, 0.0)
        dec = minus(histogram(m, "kvroute_decision_seconds"), histogram(b, "kvroute_decision_seconds"))
        cpu = minus(histogram(m, "kvroute_decision_cpu_seconds"), histogram(b, "kvroute_decision_cpu_seconds"))
        lag = minus(histogram(m, "kvroute_sync_lag_seconds"), histogram(b, "kvroute_sync_lag_seconds"))
        rss, hwm = rss_kib(procs[i].pid)
        decisions = dec[-1][1] if dec else 0
        rows.append({
            "replica": i,
            "decisions": decisions,
            "decision_p50_s": quantile(dec, 0.5),
            "decision_p99_s": quantile(dec, 0.99),
            "decision_p999_s": quantile(dec, 0.999),
            "decision_cpu_p50_s": quantile(cpu, 0.5),
            "decision_cpu_p99_s": quantile(cpu, 0.99),
            "decision_cpu_p999_s": quantile(cpu, 0.999),
            "involuntary_switches_per_decision": (s1["switches"][i] - s0["switches"][i]) / max(decisions, 1),
            # CPU time of the whole replica process per request it routed (its share of
            # the sync included), microseconds.
            "cpu_us_per_request": (s1["cpu"][i] - s0["cpu"][i]) * 1e6 / max(decisions, 1),
            "published_per_s": d('kvroute_sync_events_total{outcome="published"}') / wall,
            "applied_per_s": d('kvroute_sync_events_total{outcome="applied"}') / wall,
            "dropped": d('kvroute_sync_events_total{outcome="dropped"}'),
            "gaps": d("kvroute_sync_gaps_total"),
            "unresolved": d('kvroute_sync_events_total{outcome="unresolved"}'),
            # Peers' routed events the cluster had applied in full within
            # sync_refresh_secs: load only, no commit.
            "repeat_per_s": d('kvroute_sync_events_total{outcome="repeat"}') / wall,
            # This replica's requests the cluster had applied in full: not sent (their
            # load goes in the replica's load totals).
            "repeat_skipped_per_s": d('kvroute_sync_events_total{outcome="repeat_skipped"}') / wall,
            "lag_p50_s": quantile(lag, 0.5),
            "lag_p99_s": quantile(lag, 0.99),
            "rss_mib": rss / 1024,
            "peak_rss_mib": hwm / 1024,
        })
    routed = max(summary["requests"], 1)
    v0, c0 = nats0 or ({"in_bytes": 0, "out_bytes": 0, "in_msgs": 0}, 0.0)
    v1, c1 = nats1 or (v0, c0)
    return {"sync": sync, "round": round_no, "wall_s": wall, "requests": summary["requests"],
            "ok": summary["ok"],
            # Over the load generator's own run (its prompts are built before it).
            "req_per_s": summary["ok"] / max(summary.get("wall_s") or wall, 1e-9), "replicas": rows,
            "nats_in_bytes_per_request": (v1["in_bytes"] - v0["in_bytes"]) / routed,
            "nats_out_bytes_per_request": (v1["out_bytes"] - v0["out_bytes"]) / routed,
            "nats_in_msgs": v1["in_msgs"] - v0["in_msgs"],
            # Replicas' CPU time (all of them) and nats-server's, per request routed, us.
            "replicas_cpu_us_per_request": sum(s1["cpu"][i] - s0["cpu"][i] for i in range(len(procs))) * 1e6 / routed,
            "nats_cpu_us_per_request": (c1 - c0) * 1e6 / routed}


def nats_sample(a, monitor):
    return varz(monitor), cpu_seconds(a.nats_pid)


def run_groups(a, workers, nats_url, settings, round_no, monitor, first=0):
    """The settings given at once — one, or two side by side — each group of replicas with
    a load generator of its own over the same window: their results, in that order
    (nats-server's CPU and traffic split evenly between the groups with the sync on; a
    lone group gets them whole). `first` numbers the groups' clusters."""
    groups = []
    try:
        for nth, sync in enumerate(settings):
            groups.append(start_group(a, workers, nats_url, sync, f"bench{round_no}x{first + nth}"))
        outs = [tempfile.NamedTemporaryFile(suffix=".json", delete=False).name for _ in groups]
        s0 = [sample(a, *g) for g in groups]
        n0 = nats_sample(a, monitor)
        t0 = time.time()
        gens = [subprocess.Popen(load(a, g[1], o), stdout=subprocess.DEVNULL) for g, o in zip(groups, outs)]
        for g in gens:
            if g.wait() != 0:
                sys.exit(f"the load generator failed (exit {g.returncode})")
        wall = time.time() - t0
        time.sleep(1.5)  # the last batches and heartbeats arrive
        s1 = [sample(a, *g) for g in groups]
        n1 = nats_sample(a, monitor)
        synced = max(sum(settings), 1)
        share = lambda n: ({k: v / synced for k, v in n[0].items() if k in ("in_bytes", "out_bytes", "in_msgs")},
                           n[1] / synced)
        counted = lambda sync: sync or len(groups) == 1
        return [result(a, sync, round_no, g[0], b, e, read_summary(a, o), wall,
                       share(n0) if counted(sync) else None, share(n1) if counted(sync) else None)
                for sync, g, b, e, o in zip(settings, groups, s0, s1, outs)]
    finally:
        stop_group([p for g in groups for p in g[0]])


def report(a, r, res):
    sync = res['sync']
    print(f"round {r} sync {'on ' if sync else 'off'}: {res['ok']}/{res['requests']} ok, "
          f"{res['req_per_s']:.0f} req/s over {a.replicas} replicas; NATS in "
          f"{res['nats_in_bytes_per_request']:.0f} B, out {res['nats_out_bytes_per_request']:.0f} B "
          f"per request; CPU per request: replicas {res['replicas_cpu_us_per_request']:.1f} us, "
          f"nats-server {res['nats_cpu_us_per_request']:.1f} us", flush=True)
    for x in res["replicas"]:
        print(f"  replica {x['replica']}: decision p50 <= {fmt_s(x['decision_p50_s'])}, "
              f"p99 <= {fmt_s(x['decision_p99_s'])}, p99.9 <= {fmt_s(x['decision_p999_s'])} "
              f"(CPU p50 <= {fmt_s(x['decision_cpu_p50_s'])}, p99 <= {fmt_s(x['decision_cpu_p99_s'])}, "
              f"p99.9 <= {fmt_s(x['decision_cpu_p999_s'])}; "
              f"{x['involuntary_switches_per_decision']:.2f} involuntary switches a request); "
              f"events out {x['published_per_s']:.0f}/s, in {x['applied_per_s']:.0f}/s "
              f"(+ {x['repeat_per_s']:.0f}/s repeats; {x['repeat_skipped_per_s']:.0f}/s not sent), "
              f"dropped {x['dropped']:.0f}, gaps {x['gaps']:.0f}, prompts unresolved {x['unresolved']:.0f}; lag p50 <= {fmt_s(x['lag_p50_s'])}, "
              f"p99 <= {fmt_s(x['lag_p99_s'])}; RSS {x['rss_mib']:.1f} MiB (peak {x['peak_rss_mib']:.1f})",
              flush=True)


def start_nats(a, tries=3):
    """nats-server on free ports, answering its monitoring endpoint: (process, client port,
    monitoring port). A port found free can be taken by another connection before the
    server binds it (the load generator opens thousands); the server then exits, and is
    started again on other ports."""
    nice = ["nice", "-n", str(a.nats_nice)] if a.nats_nice else []
    for _ in range(tries):
        port, monitor = free_port(), free_port()
        nats = subprocess.Popen(nice + [a.nats_server, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.time() + 30
        while time.time() < end and nats.poll() is None:
            try:
                varz(monitor)
                return nats, port, monitor
            except OSError:
                time.sleep(0.05)
        if nats.poll() is None:
            nats.kill()
            sys.exit(f"nats-server monitoring (http://127.0.0.1:{monitor}/varz) did not answer within 30 s")
    sys.exit(f"nats-server exited at start {tries} times (its ports taken?)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvroute", required=True, help="the kvroute binary (a release build)")
    ap.add_argument("--nats-server", default=shutil.which("nats-server") or "nats-server")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--rate", type=float, help="open loop at this many requests/s (Poisson) instead of the "
                    "closed loop, to measure below saturation")
    ap.add_argument("--nats-nice", type=int, default=0,
                    help="nice level of nats-server (0..19): >0 lets it yield the cores to the replicas")
    ap.add_argument("--own-core", action="store_true",
                    help="replica 0 on CPU 0 alone, every other process on the other CPUs")
    ap.add_argument("--unique", action="store_true",
                    help="no prompt sent twice (enough distinct questions for 8,000 requests/s): "
                    "every request adds a question the cluster has not seen")
    ap.add_argument("--sync-batch-ms", type=int,
                    help="the replicas' sync_batch_ms with the sync on (default: theirs, 5)")
    ap.add_argument("--settings", default="off,on",
                    help="the settings of a round, in order: off and on, comma-separated (default off,on; "
                         "off,off measures what running second does to a setting on this machine)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run both settings at once, each group of replicas with its own load generator "
                         "(the machine's drift then hits both alike)")
    ap.add_argument("--alternate", action="store_true",
                    help="run every other round's settings in reverse order (on before off)")
    ap.add_argument("--json", help="write every result here")
    a = ap.parse_args()
    if not (1 <= a.replicas <= 16 and 1 <= a.workers <= 64 and 0 < a.duration <= 600 and 1 <= a.concurrency <= 1024):
        sys.exit("--replicas 1..16, --workers 1..64, --duration 0..600, --concurrency 1..1024")
    if not 0 <= a.nats_nice <= 19:
        sys.exit("--nats-nice 0..19")
    if not shutil.which(a.nats_server) and not os.path.isfile(a.nats_server):
        sys.exit(f"no nats-server at {a.nats_server}: install the Debian package nats-server")
    try:
        a.settings = [{"off": False, "on": True}[x.strip()] for x in a.settings.split(",")]
    except KeyError:
        sys.exit(f"--settings {a.settings}: expected off and on, comma-separated")
    if a.side_by_side and len(a.settings) != 2:
        sys.exit("--side-by-side runs two settings at once: --settings A,B")
    if a.side_by_side and a.own_core:
        sys.exit("--own-core gives one replica a core of its own: not with --side-by-side")
    if a.sync_batch_ms is not None and not 1 <= a.sync_batch_ms <= 1000:
        sys.exit("--sync-batch-ms 1..1000")
    a.sync_config = None
    if a.sync_batch_ms is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(f"sync_batch_ms = {a.sync_batch_ms}\n")
            a.sync_config = f.name
    if a.own_core:
        cpus = os.sched_getaffinity(0) - {0}
        if not cpus:
            sys.exit("--own-core needs at least 2 CPUs, CPU 0 among them")
        os.sched_setaffinity(0, cpus)  # inherited by every process started from here on
    nats, nats_port, monitor = start_nats(a)
    a.nats_pid = nats.pid
    workers, wprocs = [], []
    try:
        for _ in range(a.workers):
            port = free_port()
            wprocs.append(subprocess.Popen([a.kvroute, "engine-sim", "--port", str(port), "--instant"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            workers.append(f"http://127.0.0.1:{port}")
        for w in workers:
            wait_ok(f"{w}/health", "worker")
        results, pairs = [], []
        for r in range(a.rounds):
            url = f"nats://127.0.0.1:{nats_port}"
            if a.side_by_side:
                batch = run_groups(a, workers, url, a.settings, r, monitor)
            else:
                settings = a.settings[::-1] if a.alternate and r % 2 else a.settings
                batch = (res for nth, sync in enumerate(settings)
                         for res in run_groups(a, workers, url, [sync], r, monitor, first=nth))
            for res in batch:
                results.append(res)
                report(a, r, res)
            if a.side_by_side:
                x, y = results[-2], results[-1]
                name = lambda res: "on" if res["sync"] else "off"
                thr = y['req_per_s'] / x['req_per_s'] - 1
                cpu = y['replicas_cpu_us_per_request'] / x['replicas_cpu_us_per_request'] - 1
                pairs.append((thr, cpu))
                print(f"round {r} side by side, {name(y)} against {name(x)}: "
                      f"{thr:+.1%} throughput, replicas' CPU per request {cpu:+.1%} "
                      f"(nats-server's: {x['nats_cpu_us_per_request']:.1f} and {y['nats_cpu_us_per_request']:.1f} us)",
                      flush=True)
        if len(pairs) >= 3:
            report_pairs(pairs)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "results": results}, f, indent=1)
    finally:
        for p in wprocs + [nats]:
            p.terminate()
        for p in wprocs + [nats]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if a.sync_config:
            os.unlink(a.sync_config)


def report_pairs(pairs):
    """Side-by-side rounds' summary: the median CPU per request, and the CPU per request at
    equal throughput. A group's CPU per request also depends on how busy it is (a less busy
    replica wakes more often per request): over rounds it falls as the group's share of
    the throughput rises, so the least-squares line of CPU against throughput, read at
    equal throughput, is the setting's own cost with that effect taken out."""
    thr = [t for t, _ in pairs]
    cpu = [c for _, c in pairs]
    line = f"{len(pairs)} rounds: replicas' CPU per request, median {statistics.median(cpu):+.1%}"
    if len(set(thr)) > 1:
        fit = statistics.linear_regression(thr, cpu)
        r = statistics.correlation(thr, cpu) if len(set(cpu)) > 1 else float("nan")
        line += (f"; at equal throughput {fit.intercept:+.1%} (least squares over the rounds: "
                 f"{fit.slope:+.2f} points per point of throughput, r = {r:.2f})")
        if not min(thr) <= 0 <= max(thr):
            line += ("; extrapolated: no round's throughput figure was on the other side of "
                     "zero, take more rounds")
    print(line, flush=True)


if __name__ == "__main__":
    main()
