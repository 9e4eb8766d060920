#!/usr/bin/env python3
"""A three-model cascade on engine-sim: escalation rate and large-model tokens saved.

Starts three `kvroute engine-sim` workers serving `small`, `medium` and `large`, whose
answers have a mean log-probability per token of QUALITY + SPREAD x u, u in [-1, 1] drawn
from a hash of the prompt (the same u on every model: a hard prompt is hard for all of
them), and a `kvroute serve` with one chain:

    [[cascade.chain]]
    model = "auto"
    models = ["small", "medium", "large"]
    confidence_threshold = THRESHOLD

It sends N distinct prompts to `auto`, then the same prompts to `large` directly, and
prints where the cascade answered, the escalation rate, and the tokens each model
processed against always using the large model (from the answers' `usage` and the
router's kvroute_cascade_* metrics).

Standard library only. Usage:
  python3 scripts/cascade-example.py --kvroute target/release/kvroute [--requests 200]
      [--threshold -1.0] [--concurrency 8] [--max-tokens 64]
Every process is on 127.0.0.1 and ends with the script.
"""

import argparse
import concurrent.futures
import json
import subprocess
import tempfile
import urllib.request

from kvroute_procs import free_port, wait_ok

MODELS = [("small", -1.6, 1.2), ("medium", -0.9, 0.6), ("large", -0.3, 0.2)]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvroute", default="target/release/kvroute")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--threshold", type=float, default=-1.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    procs = []
    try:
        urls = {}
        for name, q, spread in MODELS:
            port = free_port()
            procs.append(subprocess.Popen(
                [a.kvroute, "engine-sim", "--port", str(port), "--model", name, "--time-scale", "20",
                 "--quality", str(q), "--quality-spread", str(spread)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls[name] = f"http://127.0.0.1:{port}"
        for u in urls.values():
            wait_ok(u + "/health", "engine-sim")
        cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        cfg.write('policy = "cache_aware"\n')
        # The example reads each answer's cascade trail (x-kvroute-cascade): one client, ours.
        cfg.write('expose_decision_headers = true\n')
        cfg.write("worker_urls = [%s]\n" % ", ".join(f'"{u}"' for u in urls.values()))
        cfg.write('[[cascade.chain]]\nmodel = "auto"\nmodels = ["small", "medium", "large"]\n')
        cfg.write(f"confidence_threshold = {a.threshold}\n")
        cfg.close()
        rport = free_port()
        procs.append(subprocess.Popen([a.kvroute, "serve", "--config", cfg.name, "--port", str(rport)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{rport}"
        wait_ok(router + "/readiness", "router")

        def ask(model, i):
            body = {"model": model, "max_tokens": a.max_tokens,
                    "messages": [{"role": "user", "content": f"Question {i}: explain topic number {i * 7919 % 10007} in detail."}]}
            h, v = post(router + "/v1/chat/completions", body)
            u = v.get("usage", {})
            return h.get("x-kvroute-cascade", h.get("X-Kvroute-Cascade", "")), u.get("prompt_tokens", 0), u.get("completion_tokens", 0)

        with concurrent.futures.ThreadPoolExecutor(a.concurrency) as ex:
            cascade = list(ex.map(lambda i: ask("auto", i), range(a.requests)))
            direct = list(ex.map(lambda i: ask("large", i), range(a.requests)))
        with urllib.request.urlopen(router + "/metrics") as r:
            metrics = r.read().decode()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()

    def metric(series):
        for line in metrics.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0

    ended = {name: 0 for name, _, _ in MODELS}
    for trail, _, _ in cascade:
        ended[trail.split(">")[-1].split(":")[0]] += 1
    n = a.requests
    print(f"{n} requests to `auto` (chain small > medium > large, threshold {a.threshold}), {a.max_tokens} tokens each")
    print("answered by:   " + ", ".join(f"{m} {ended[m]} ({100 * ended[m] / n:.1f} %)" for m in ended))
    escalated = metric('kvroute_cascade_steps_total{model="small",outcome="escalated"}') + \
        metric('kvroute_cascade_steps_total{model="medium",outcome="escalated"}')
    steps = sum(metric(f'kvroute_cascade_steps_total{{model="{m}",outcome="{o}"}}')
                for m, _, _ in MODELS for o in ("accepted", "escalated"))
    print(f"escalations:   {escalated:.0f} of {steps:.0f} steps; {100 * (n - ended['small']) / n:.1f} % of requests escalated at least once")
    print()
    print("| model | prompt tokens | completion tokens | (always large) prompt | completion |")
    print("|---|---|---|---|---|")
    base_p = sum(p for _, p, _ in direct)
    base_c = sum(c for _, _, c in direct)
    for m, _, _ in MODELS:
        p = metric(f'kvroute_cascade_tokens_total{{model="{m}",outcome="prompt"}}')
        c = metric(f'kvroute_cascade_tokens_total{{model="{m}",outcome="completion"}}')
        bp, bc = (base_p, base_c) if m == "large" else (0, 0)
        print(f"| {m} | {p:.0f} | {c:.0f} | {bp} | {bc} |")
    large = metric('kvroute_cascade_tokens_total{model="large",outcome="prompt"}') + \
        metric('kvroute_cascade_tokens_total{model="large",outcome="completion"}')
    total = sum(p + c for _, p, c in cascade)
    print()
    print(f"large-model tokens: {large:.0f} with the cascade, {base_p + base_c} always large "
          f"({100 * (1 - large / max(1, base_p + base_c)):.1f} % saved); all models together: {total} "
          f"({100 * (total / max(1, base_p + base_c) - 1):+.1f} % against always large)")


if __name__ == "__main__":
    main()
