#!/usr/bin/env python3
"""Calibrate the engine model's `cpu-smollm2-135m` profile on this machine: one llama.cpp
worker alone on a core, and how N busy workers share the host's cores.

Starts `scripts/llama-workers.sh start N PORT` (llama-server `-t 1 -np 2 --cache-ram 0`, the
workers `kvroute bench compare --engine llama` runs), then for each level k in --levels sends
one request at a time to each of k workers at once (the others idle), --rounds rounds: a
prompt of --prompt-tokens random common words (never cached: `cache_prompt` false) and
--output-tokens tokens to generate (`ignore_eos`). llama.cpp reports each answer's
`timings.prompt_per_token_ms` and `timings.predicted_per_token_ms`; the script prints their
medians per level and the slow-down against one worker alone. Prefill is fitted on one worker
alone as ms = a + p × tokens + q × pairs (fresh prompts of 25, 100 and --prompt-tokens words,
and 25 and 100 words after --prompt-tokens cached ones, on slot 0): a continued prefill's
tokens attend to the cached context, so a conversation's next turn costs more per token
than a fresh prompt (179–228 ms for 25 tokens after 300 cached, 141–154 ms fresh, over 12
calibrations on 2026-11-26); p and
q are the profile's `prefill_per_token_s` and `prefill_attention_s`.

With one thread per worker on a host of C cores, processor sharing predicts a slow-down of
max(1, k / C) at k busy workers: what `kvroute replay --host-cores C` models. Workers on
one host also share caches and memory bandwidth, so the measured slow-down can be larger
(here 1.06× with 2 busy workers on 2 cores one evening; 0.94–1.12× the next day); the JSON's `host_slowdown` (slow-down at 1, 2, …
busy workers, the mean of the prefill and decode ones, levels between those measured
interpolated) is what `kvroute replay --host-slowdown` takes instead. The script
prints the profile of one worker alone (`prefill_per_token_s`, `prefill_attention_s`, `step_overhead_s`,
`decode_per_seq_s`, `context_per_token_s`) as the JSON `kvroute replay --profile-set` takes, for such a replay:

    python3 scripts/llama-calibrate.py --workers 4 --levels 1,2,4 --rounds 3

Needs the llama.cpp build and model (`scripts/llama-workers.sh install`); sends traffic to
127.0.0.1 only and stops its workers on exit. Run it on an idle machine.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import urllib.request

import kvroute_procs

HERE = pathlib.Path(__file__).resolve().parent
# Common English words, one token each in SmolLM2's tokenizer (mostly): a random sequence of
# them is a prompt of about as many tokens as words that no cache holds.
WORDS = ("the of and to in is was for on that with as by at from his her they this have "
         "had not are but be one all were we when there can an which their said if do will each "
         "about how up out them then she many some so these would other into has more two like "
         "time see way could people my than first water been call who its now find long down day "
         "did get come made may part over new sound take only little work know place year live me "
         "back give most very after thing our just name good sentence man think say great where help "
         "through much before line right too mean old any same tell boy follow came want show also "
         "around form three small set put end does another well large must big even such because "
         "turn here why ask went men read need land different home us move try kind hand picture "
         "again change off play spell air away animal house point page letter mother answer found "
         "study still learn should world high every near add food between own below country plant "
         "last school father keep tree never start city earth eye light thought head under story").split()


def free_port_block(n):
    """A base port with n free consecutive ports after it (best effort)."""
    for _ in range(50):
        base = kvroute_procs.free_port()
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    sys.exit("llama-calibrate: no block of free ports")


def completion(url, **fields):
    """POST `fields` as JSON to llama-server's `/completion` at `url`; its `timings`."""
    req = urllib.request.Request(url + "/completion", data=json.dumps(fields).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["timings"]


def complete(url, prompt_words, output_tokens, rng):
    words = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
    t = completion(url, prompt=words, n_predict=output_tokens, cache_prompt=False, ignore_eos=True, temperature=0)
    return t["prompt_n"], t["prompt_per_token_ms"], t["predicted_n"], t["predicted_per_token_ms"]


def measure(urls, k, per_worker, rounds, a, rng, prompt_words=None):
    """Medians of (prompt tokens, prefill ms/token, decode ms/token) with `per_worker`
    requests at once on each of the first k workers, `rounds` times."""
    samples = []
    words = a.prompt_tokens if prompt_words is None else prompt_words
    with concurrent.futures.ThreadPoolExecutor(k * per_worker) as ex:
        for _ in range(rounds):
            futs = [ex.submit(complete, urls[i % k], words, a.output_tokens, random.Random(rng.random()))
                    for i in range(k * per_worker)]
            samples += [f.result() for f in futs]
    return tuple(statistics.median(s[j] for s in samples) for j in (0, 1, 3))


def prefill_sample(url, fresh_words, cached_words, rng):
    """One prefill on slot 0 of `url`: `fresh_words` new words after `cached_words` words
    already in the slot (sent first, so cached). Returns (tokens computed, tokens cached
    before them, prefill ms) from llama.cpp's `timings` (`prompt_n`, `cache_n`,
    `prompt_ms`)."""
    def post(prompt, cache):
        return completion(url, prompt=prompt, n_predict=1, cache_prompt=cache, id_slot=0, temperature=0)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    if cached_words == 0:
        t = post(words(fresh_words), False)
        return t["prompt_n"], 0, t["prompt_ms"]
    base = words(cached_words)
    post(base, True)
    t = post(base + " " + words(fresh_words), True)
    return t["prompt_n"], t.get("cache_n", 0), t["prompt_ms"]


def fit_prefill(samples):
    """Least squares of prefill ms = a + p × n + q × pairs over `samples` (n computed, c
    cached, ms), pairs = n × c + n (n + 1) / 2 (each computed token attends to the cached
    ones and the prompt's tokens before it): returns (p, q) in ms, the per-token and
    per-pair costs (a, a fixed cost per prefill, is left out of the profile: the step
    overhead carries it)."""
    rows = [(1.0, float(n), n * c + n * (n + 1) / 2.0, ms) for n, c, ms in samples]
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    # Gauss-Jordan on the 3×3 normal equations.
    for i in range(3):
        piv = max(range(i, 3), key=lambda k: abs(m[k][i]))
        m[i], m[piv], v[i], v[piv] = m[piv], m[i], v[piv], v[i]
        if abs(m[i][i]) < 1e-12:
            return None
        for k in range(3):
            if k != i:
                f = m[k][i] / m[i][i]
                m[k] = [x - f * y for x, y in zip(m[k], m[i])]
                v[k] -= f * v[i]
    a, p, q = (v[i] / m[i][i] for i in range(3))
    return (p, q) if p > 0 and q >= 0 else None


def host_slowdown(levels):
    """The slow-down of a busy worker at 1, 2, … up to the highest measured level of busy
    workers: at each measured level the mean of its prefill and decode slow-downs against
    one worker alone (level 1, which must be measured), levels in between interpolated
    linearly. `levels`: the JSON's `levels` rows."""
    by = {r["busy"]: r for r in levels}
    if 1 not in by:
        return []
    p1, d1 = by[1]["prefill_ms_per_token"], by[1]["decode_ms_per_token"]
    known = {k: (r["prefill_ms_per_token"] / p1 + r["decode_ms_per_token"] / d1) / 2 for k, r in by.items()}
    ks = sorted(known)
    out = []
    for k in range(1, ks[-1] + 1):
        if k in known:
            out.append(round(known[k], 4))
            continue
        lo = max(x for x in ks if x < k)
        hi = min(x for x in ks if x > k)
        out.append(round(known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo), 4))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--levels", default="1,2,4", help="busy workers at once, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=300, help="common words in each prompt (about that many tokens)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the profile and the medians here")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",") if x]
    if not levels or min(levels) < 1 or max(levels) > a.workers:
        sys.exit("llama-calibrate: --levels must be between 1 and --workers")
    base = free_port_block(a.workers)
    script = str(HERE / "llama-workers.sh")
    subprocess.run([script, "start", str(a.workers), str(base)], check=True, stdout=subprocess.DEVNULL)
    try:
        urls = [f"http://127.0.0.1:{base + i}" for i in range(a.workers)]
        for u in urls:
            kvroute_procs.wait_ok(u + "/health", "llama-server", secs=120)
        rng = random.Random(7)
        # Warm-up: one request of the measured size per worker, alone. A short one left the
        # first level cold: one worker alone then decoded at 18.6 ms/token, two at once at
        # 14.5 (2026-11-26), a slow-down below 1 at every level after it.
        for u in urls:
            complete(u, a.prompt_tokens, a.output_tokens, rng)
        print(f"{os.cpu_count()} cores; prompt ≈{a.prompt_tokens} tokens, {a.output_tokens} generated, "
              f"{a.rounds} rounds per level")
        # One worker alone: prefill and decode of one request; then the decode step with one
        # and with two sequences, from short prompts (so that one request's decode does not
        # wait for the other's prefill): the step's fixed cost and its cost per sequence.
        _, p1, d1 = measure(urls, 1, 1, a.rounds, a, rng)
        _, _, s1 = measure(urls, 1, 1, a.rounds, a, rng, prompt_words=8)
        _, _, d2 = measure(urls, 1, 2, a.rounds, a, rng, prompt_words=8)
        per_seq = max(d2 - s1, 0.0)
        # The decode step grows with the context it reads: 8-word against --prompt-tokens
        # prompts, at the mean context of their decodes.
        short_ctx, long_ctx = 8 + a.output_tokens / 2, a.prompt_tokens + a.output_tokens / 2
        per_ctx = max(d1 - s1, 0.0) / max(long_ctx - short_ctx, 1.0)
        overhead = max(s1 - per_seq - short_ctx * per_ctx, 0.0)
        # Prefill: fresh prompts and continuations of a cached one (a conversation's next
        # turn), one worker alone; a continued prefill costs more per token (its tokens
        # attend to the cached context), which the per-token median above leaves out.
        shapes = [(25, 0), (100, 0), (a.prompt_tokens, 0), (25, a.prompt_tokens), (100, a.prompt_tokens)]
        samples = [prefill_sample(urls[0], n, c, rng) for _ in range(a.rounds) for n, c in shapes]
        fit = fit_prefill(samples)
        fit_p, fit_q = fit if fit else (p1, 0.0)
        profile = {"prefill_per_token_s": round(fit_p / 1000, 6), "prefill_attention_s": round(fit_q / 1000, 10),
                   "step_overhead_s": round(overhead / 1000, 6),
                   "decode_per_seq_s": round(per_seq / 1000, 6), "context_per_token_s": round(per_ctx / 1000, 9)}
        for k, (n, c) in enumerate(shapes):
            xs = samples[k::len(shapes)]
            print(f"prefill of {statistics.median(x[0] for x in xs):.0f} tokens after {statistics.median(x[1] for x in xs):.0f} "
                  f"cached: median {statistics.median(x[2] for x in xs):.1f} ms")
        print(f"prefill fit: {fit_p:.3f} ms/token + {fit_q * 1000:.2f} µs per attended pair"
              + ("" if fit else " (fit failed: the per-token median alone)"))
        print(f"one worker alone: prefill {p1:.2f} ms/token, decode {d1:.2f} ms/token after it; from an 8-word "
              f"prompt, decode {s1:.2f} ms/token with one slot busy, {d2:.2f} with both")
        print("profile (kvroute replay --profile cpu-smollm2-135m --profile-set):", json.dumps(profile))
        print("| busy workers | prompt tokens (median) | prefill ms/token | decode ms/token | prefill slow-down "
              f"| decode slow-down | processor sharing on {os.cpu_count()} cores |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        rows = []
        for k in levels:
            pn, pp, dp = (None, p1, d1) if k == 1 else measure(urls, k, 1, a.rounds, a, rng)
            rows.append({"busy": k, "prefill_ms_per_token": pp, "decode_ms_per_token": dp})
            share = max(1.0, k / (os.cpu_count() or 1))
            print(f"| {k} | {a.prompt_tokens if pn is None else pn:.0f} | {pp:.2f} | {dp:.2f} | {pp / p1:.2f}× "
                  f"| {dp / d1:.2f}× | {share:.2f}× |")
        slowdown = host_slowdown(rows)
        print("host slow-down at 1, 2, … busy workers (kvroute replay --host-slowdown):",
              ",".join(f"{x:.3f}" for x in slowdown))
        if a.json:
            out = {"cores": os.cpu_count(), "prompt_words": a.prompt_tokens, "output_tokens": a.output_tokens,
                   "rounds": a.rounds, "profile": profile, "prefill_samples": samples,
                   "decode_ms_per_token_short_prompt": s1,
                   "decode_ms_per_token_both_slots": d2, "levels": rows, "host_slowdown": slowdown}
            pathlib.Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    finally:
        subprocess.run([script, "stop"], check=False, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
