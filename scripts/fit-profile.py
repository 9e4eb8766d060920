#!/usr/bin/env python3
"""Fits an engine profile's prefill constants to a measured prefill grid and writes the
profile as TOML for `--profile-file` (kvroute replay, advise, engine-sim, profile show).

usage: scripts/fit-profile.py GRID.jsonl [--min-new 256] [--name NAME] [--base NAME]
                              [--step-overhead-s S] [--out PROFILE.toml]

GRID.jsonl holds lines `{"event": "grid", "cached": C, "new": N, "s": SECONDS}`: one prefill
pass of N new tokens on C tokens already in the KV cache (data/gpu/README.md says how the
H100 grid was measured; other lines are ignored). The model is the engine's
(crates/kvroute-sim/src/engine.rs, `Profile::prefill_secs`):

    t(C, N) = step_overhead + context_per_token·C                      (the base profile's)
            + prefill_step_overhead + a·N + b·N·C + s·N(N+1)/2 + k·(C + N)   (fitted)

b prices the pairs of a new token and a cached one (`prefill_attention_s`), s the pairs of
two new tokens of the pass (`prefill_self_attention_s`).

`step_overhead` is the decode step's fixed cost and `context_per_token` the decode step's KV
read per context token; both stay as given (--step-overhead-s, else the base profile's): a
prefill pass's larger fixed cost goes to `prefill_step_overhead_s`, which the engine model
charges only to a step that decodes nothing (a lone prefill pass, as the grid measures): a
chunk that joins decoding sequences rides their pass.
The five other constants minimise the largest relative error over the points with
N >= --min-new (iteratively reweighted least squares: a least-squares fit weighted 1/t,
then the worst points weighted up until the maximum stops falling). Prints each point with
its prediction and error, and the worst error. Needs only the Python standard library.

The rest of the profile (KV capacity, batch limits, decode costs) comes from --base
(default h100-llama3-8b's constants, listed below): the grid measures prefill only.
"""
import argparse
import json
import sys

# kvroute's built-in profiles' non-prefill constants (crates/kvroute-sim/src/engine.rs).
BASES = {
    "h100-llama3-8b": {
        "block_tokens": 16, "kv_tokens": 420000, "max_batch": 256, "max_batched_tokens": 8192,
        "step_overhead_s": 0.006, "decode_per_seq_s": 30e-6, "context_per_token_s": 0.04e-6,
        "slots": 0,
    },
    "a100-llama3-8b": {
        "block_tokens": 16, "kv_tokens": 420000, "max_batch": 256, "max_batched_tokens": 8192,
        "step_overhead_s": 0.009, "decode_per_seq_s": 30e-6, "context_per_token_s": 0.065e-6,
        "slots": 0,
    },
}


def read_grid(path):
    pts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                v = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{i}: not JSON: {e}")
            if v.get("event") != "grid":
                continue
            try:
                c, n, t = int(v["cached"]), int(v["new"]), float(v["s"])
            except (KeyError, TypeError, ValueError) as e:
                sys.exit(f"{path}:{i}: a grid line needs numeric cached, new and s: {e}")
            if c < 0 or n <= 0 or not t > 0:
                sys.exit(f"{path}:{i}: cached >= 0, new > 0 and s > 0 expected")
            pts.append((c, n, t))
    if not pts:
        sys.exit(f"{path}: no {{\"event\": \"grid\"}} lines")
    return pts


def features(c, n):
    return [1.0, float(n), float(n * c), n * (n + 1) / 2.0, float(c + n)]


def solve(a, b):
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    k = len(b)
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        if m[i][i] == 0:
            sys.exit("the grid does not determine the constants (too few distinct points)")
        for r in range(k):
            if r != i:
                f = m[r][i] / m[i][i]
                for j in range(i, k + 1):
                    m[r][j] -= f * m[i][j]
    return [m[i][k] / m[i][i] for i in range(k)]


def weighted_fit(pts, w, base):
    x = [features(c, n) for c, n, _ in pts]
    y = [t - fixed(base, c) for c, _, t in pts]
    k = len(x[0])
    a = [[sum(w[r] ** 2 * x[r][i] * x[r][j] for r in range(len(y))) for j in range(k)] for i in range(k)]
    b = [sum(w[r] ** 2 * x[r][i] * y[r] for r in range(len(y))) for i in range(k)]
    return solve(a, b)


def fixed(base, c):
    """The base profile's part of a prefill step's time: its overhead and KV read."""
    return base["step_overhead_s"] + base["context_per_token_s"] * c


def predict(coef, base, c, n):
    return fixed(base, c) + sum(f * x for f, x in zip(coef, features(c, n)))


def minimax_fit(pts, base, rounds=400):
    w = [1.0 / t for _, _, t in pts]
    best = None
    for _ in range(rounds):
        coef = [max(x, 0.0) for x in weighted_fit(pts, w, base)]
        errs = [predict(coef, base, c, n) / t - 1 for c, n, t in pts]
        worst = max(abs(e) for e in errs)
        if best is None or worst < best[0]:
            best = (worst, coef)
        w = [x * (1 + abs(e) / worst) ** 2 for x, e in zip(w, errs)]
        s = sum(w)
        w = [x / s for x in w]
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grid")
    ap.add_argument("--min-new", type=int, default=256)
    ap.add_argument("--name", default="fitted")
    ap.add_argument("--base", default="h100-llama3-8b", choices=sorted(BASES))
    ap.add_argument("--step-overhead-s", type=float)
    ap.add_argument("--out")
    a = ap.parse_args()
    base = dict(BASES[a.base])
    if a.step_overhead_s is not None:
        base["step_overhead_s"] = a.step_overhead_s
    pts = [p for p in read_grid(a.grid) if p[1] >= a.min_new]
    if len(pts) < 5:
        sys.exit(f"{a.grid}: {len(pts)} grid points with new >= {a.min_new}; 5 at least")
    worst, (p0, per_token, attention, self_attention, context) = minimax_fit(pts, base)
    print(f"{'cached':>7} {'new':>6} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    for c, n, t in sorted(pts):
        m = predict((p0, per_token, attention, self_attention, context), base, c, n)
        print(f"{c:>7} {n:>6} {t * 1e3:>12.1f} {m * 1e3:>9.1f} {100 * (m / t - 1):>+6.1f}%")
    print(f"worst relative error {100 * worst:.1f}% over {len(pts)} points with new >= {a.min_new}")
    profile = dict(base)
    profile.update({
        "name": a.name,
        "prefill_step_overhead_s": round(p0, 6),
        "prefill_per_token_s": float(f"{per_token:.4g}"),
        "prefill_attention_s": float(f"{attention:.4g}"),
        "prefill_self_attention_s": float(f"{self_attention:.4g}"),
        "prefill_context_per_token_s": float(f"{context:.4g}"),
    })
    lines = [
        f"# Fitted by scripts/fit-profile.py from {a.grid} (points with new >= {a.min_new}):",
        f"# worst relative error {100 * worst:.1f}%. Constants other than the prefill ones: {a.base}.",
    ]
    for k in ["name", "block_tokens", "kv_tokens", "max_batch", "max_batched_tokens", "step_overhead_s",
              "prefill_step_overhead_s", "prefill_per_token_s", "prefill_attention_s",
              "prefill_self_attention_s", "prefill_context_per_token_s", "decode_per_seq_s", "context_per_token_s", "slots"]:
        v = profile[k]
        lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}")
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        print(f"wrote {a.out}")
    else:
        print(text, end="")


main()
