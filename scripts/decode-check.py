#!/usr/bin/env python3
"""Checks an engine profile's decode steps against public vLLM figures for Llama-3-8B on
one H100: each published workload is replayed on one simulated engine (`kvroute replay`)
and the replay's time per output token (or end-to-end latency) is printed beside the
published one.

usage: scripts/decode-check.py [--kvroute target/release/kvroute] [--profile h100-llama3-8b]
                               [--json OUT.json]

The published figures (bf16/fp16 weights, one H100 80 GB, batch of identical requests):

- InferenceBench "concurrency sweep" recipe (yobitelcomm.github.io/bench/recipes/
  concurrency-sweep), vLLM 0.21.0 on an H100-80GB-HBM3, Llama-3.1-8B-Instruct fp16, its
  chatbot-short workload: TPOT p50 6.48 ms at concurrency 1 and 6.59 ms at 4 (at 16 and
  64 the steps carry the next requests' prefills, so they do not isolate decode; the
  prompt lengths are not published: the replay uses 128 prompt and 256 output tokens);
- vLLM's nightly performance benchmark (buildkite.com/vllm/performance-benchmark,
  `latency_llama8B_tp1`, `vllm bench latency`: batch 8, 32 prompt tokens, 128 output
  tokens, offline): 997.5 ms mean end-to-end on an H100 (833.4 ms on an H200); the page
  does not state the vLLM release of that build;
- LambdaLabsML/vllm-benchmark (results/prompt_10/1xH100-80GB-SXM/
  Meta-Llama-3-8B-Instruct_tp1_len2048.json, vLLM of 2024-09, 10 ShareGPT prompts at once):
  median TPOT 7.56 ms; its prompt and output lengths are in the file and are replayed as
  they are.

Needs only the Python standard library and a kvroute binary.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# (name, requests as (prompt tokens, output tokens), metric, published value in seconds, source)
CASES = [
    ("InferenceBench c=1", [(128, 256)], "tpot_p50_s", 0.00648, "vLLM 0.21.0, TPOT p50"),
    ("InferenceBench c=4", [(128, 256)] * 4, "tpot_p50_s", 0.00659, "vLLM 0.21.0, TPOT p50"),
    ("vLLM nightly latency_llama8B_tp1", [(32, 128)] * 8, "e2e_mean_s", 0.9975, "batch 8, mean end-to-end"),
    (
        "Lambda vllm-benchmark prompt_10",
        list(zip([13, 25, 27, 10, 329, 29, 399, 328, 4, 205], [120, 429, 233, 194, 101, 741, 9, 3, 6, 31])),
        "tpot_p50_s",
        0.00756,
        "10 prompts at once, median TPOT",
    ),
]


def replay(kvroute: str, profile: str, requests, tmp: str) -> dict:
    trace = os.path.join(tmp, "t.jsonl")
    with open(trace, "w") as f:
        for i, (n_in, n_out) in enumerate(requests):
            # Distinct blocks: no request reuses another's prefix.
            f.write(json.dumps({"timestamp": 0, "input_length": n_in, "output_length": n_out, "hash_ids": [10_000 + i]}) + "\n")
    out = os.path.join(tmp, "r.json")
    cmd = [kvroute, "replay", "--trace", trace, "--policy", "round_robin", "--engines", "1", "--no-spread",
           "--profile", profile, "--json", out, "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["reports"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvroute", default="target/release/kvroute")
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, reqs, metric, published, what in CASES:
            r = replay(a.kvroute, a.profile, reqs, tmp)
            model = r[metric]
            rows.append({"case": name, "metric": metric, "published_s": published, "model_s": model,
                         "ratio": model / published, "what": what})
    print(f"profile {a.profile}")
    print(f"{'case':34} {'metric':11} {'published':>10} {'model':>10} {'model/pub':>9}")
    for r in rows:
        print(f"{r['case']:34} {r['metric']:11} {r['published_s'] * 1e3:8.2f}ms {r['model_s'] * 1e3:8.2f}ms {r['ratio']:9.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": a.profile, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
