#!/usr/bin/env python3
"""Generates synthetic request traces in the Mooncake JSONL format that `kvroute replay` reads.

    scripts/gen-traces.py agentic --out /tmp/agentic.jsonl [--seed 1] [--sessions-per-s 1.2] ...
    scripts/gen-traces.py rag     --out /tmp/rag.jsonl     [--zipf 1.0] [--docs 2000] [--top-k 4] ...
    scripts/gen-traces.py mtbench --out /tmp/mtbench.jsonl [--conversations 16000] [--docs 16] ...
    scripts/gen-traces.py all     --out-dir /tmp/traces    (the three, with their defaults)

Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...], "session_id": "...", "turn_id": n}`: the fields of Mooncake's FAST'25 traces (Qin et al., github.com/kvcache-ai/Mooncake,
`FAST25-release/traces`): one id per 512-token block of the prompt (the last one partial),
prefix-chained: an id names a block's content *and* everything before it, so two prompts
share their first i ids exactly when they share their first i blocks (a block that follows a
different prefix gets another id, as a KV cache sees it), plus the session id and turn
number that `kvroute replay`'s session-JSONL reader takes (it detects the format from
`session_id` on the first line; session-keyed policies such as consistent_hash, sticky and
unified read it). With --no-session-ids the lines are plain Mooncake and replay falls back
to Mooncake's stand-in, the first two block ids, which here would merge every session that
shares a system prompt into one. Ids are assigned by interning
(parent id, block content) in order of first use, so they start at 0 and a file is small.
Timestamps are whole seconds, like Mooncake's, so `kvroute replay --arrival-seed K` spreads
each second's requests at seeded random instants: another arrival realisation of the same
trace. A trace is a function of its parameters and `--seed` (same arguments, same bytes).
No text is written; a prompt is a sequence of segments (system prompt, document, turn, ...)
whose token counts are drawn as below. Summary statistics (requests, span, mean prompt,
infinite-cache prefix hit: one shared cache that never evicts) go to stderr.

Parameters, their defaults, and what they follow. "Assumption" means no public statistic
was used: the number is a plausible round value, change it with the flag.

Common
  --seed 1             random source (Python's `random.Random`, Mersenne Twister).
  --block-tokens 512   tokens per hash id: Mooncake's block size. With another value the
                       lines carry `"block_size"`, which `kvroute replay` also reads.
  --no-session-ids     write plain Mooncake lines (no `session_id`, `turn_id`).
  Sessions: agentic `agent-N` (the main line and its siblings), rag `rag-N` (each request
  alone), mtbench `conv-N`; `turn_id` counts a session's requests in arrival order.
  Lengths "lognormal(median m, sigma s)" are exp(N(ln m, s)), rounded, clipped to [lo, hi].

agentic: tool-using agent sessions (coding/research agents calling tools in a loop)
  --prefixes 4                distinct tool+system prefixes (agent kinds / tool sets);
                              assumption.
  --prefix-tokens 4000,12000  each prefix's length uniform in [a, b] tokens. Public
                              descriptions put an agent's system prompt + tool schemas at
                              4-10k tokens, and the prompt-caching study of DeepResearchBench
                              agents (Lumer et al. 2026, arXiv:2601.06007) used 10,000-token
                              system prompts; the range is our reading of those.
  --prefix-zipf 1.0           popularity of the prefixes, Zipf exponent over their rank;
                              assumption.
  --sessions-per-s 1.2        session starts, Poisson, over --duration-s 600 s. Chosen so
                              that x1 is near round_robin's knee on 8 simulated H100
                              engines (see "Rates" below).
  --task-tokens 500           the session's task (an issue text, a question) after the
                              prefix: lognormal(median 500, sigma 0.8) in [50, 4000];
                              assumption.
  --turns-mean 12             LLM calls on the main line of a session: 2 + geometric with
                              mean (turns-mean - 2), capped at --turns-max 50. Agent loops
                              such as SWE-agent's (Yang et al. 2024, arXiv:2405.15793) take
                              from a few to tens of LLM calls per task (arXiv:2605.26289
                              benchmarks a 6-turn and a 35-turn workflow); 12 is our
                              assumption for a typical session.
  --output-tokens 120         each call's answer (a tool call, a short thought):
                              lognormal(median 120, sigma 0.7) in [10, 1024]; assumption.
  --observation-tokens 400    each tool result appended before the next call:
                              lognormal(median 400, sigma 1.0) in [20, 8000]; assumption.
                              A call's prompt is the previous call's prompt + its answer +
                              the tool result, so the context grows every turn.
  --tool-s 3                  tool run time between calls: lognormal(median 3 s, sigma 1.0);
                              the next call arrives 0.5 s + 0.01 s per answer token (the
                              answer's own generation, H100-class 8B decode) + the tool time
                              after the previous one; assumption.
  --max-context 32768         a session ends when its prompt would exceed this (a 32k
                              context window); assumption.
  --fanout-p 0.15             probability that a call (after the first) fans out into a
                              burst of sibling requests: parallel LLM-backed tool calls or
                              sub-agents (as in parallel function calling, or LLMCompiler,
                              Kim et al. 2024) that all share the session's whole context
                              and differ only in a short suffix. Assumption.
  --fanout 2,6                siblings per burst, uniform in [a, b]; assumption. The siblings
                              of a burst arrive together (one whole-second timestamp, so
                              within one second after the replay's spreading), a tool time
                              after their parent call; each has its own suffix,
                              lognormal(median 300, sigma 0.8) in [20, 4000] tokens, and an
                              answer as --output-tokens. The main line's next call follows
                              0.5 s + 0.01 s per token of the longest sibling answer later
                              and carries every sibling's answer as its tool result.

rag: retrieval-augmented generation over a shared document pool
  --docs 2000                 documents (chunks) in the pool; assumption.
  --doc-tokens 1000           each document lognormal(median 1000, sigma 0.4) in [128, 4096]
                              tokens (retrieval chunks of a few hundred to ~1000 tokens are
                              the common defaults of RAG frameworks); assumption.
  --zipf 1.0                  document popularity: P(rank r) proportional to r^-zipf.
                              RAGCache (Jin et al. 2024, arXiv:2404.12457, section 3) found
                              retrieval skewed, a small fraction of documents taking most
                              retrievals; with 2000 documents and exponent 1.0 the top 3 %
                              of documents take 57 % of draws (the exponent is our
                              choice; the skew is RAGCache's observation).
  --top-k 4                   documents per request, distinct, drawn by popularity, then
                              placed in random order (retrieval order is not popularity
                              order); assumption (top-k of 3-5 is common).
  --system-tokens 1000        the shared system prompt before the documents; assumption.
  --question-tokens 40        the user's question after the documents: lognormal(median 40,
                              sigma 0.6) in [5, 400]; assumption.
  --output-tokens 200         lognormal(median 200, sigma 0.6) in [16, 1024]; assumption.
  --rate 30                   requests per second, Poisson, over --duration-s 500 s (see
                              "Rates").

mtbench: MT-bench two-turn conversations
  --questions data/traces/mtbench_question.jsonl  the 80 MT-bench questions (Zheng et al.
                              2023; vendored, see data/traces/README.md). Each user turn's
                              length is its real text's length at 4 characters a token (the
                              repository's CHARS_PER_TOKEN) + 8 tokens of chat template.
  --conversations 16000       conversations; each draws one of the 80 questions (uniform,
                              with replacement) and sends its two turns. The user text of
                              each conversation is distinct (other users, other words): a
                              question repeated across conversations shares no blocks.
  --rate 32                   conversation starts per second, Poisson (16,000 conversations
                              span ~500 s; see "Rates").
  --system-tokens 512         a system prompt shared by every conversation; assumption.
  --docs 16                   reference documents; each conversation puts one (uniform) after
                              the system prompt, as the repository's real-engine workload
                              does (`kvroute bench compare --workload mtbench --documents`;
                              docs/real-engines.md: 8 documents of ~250 tokens).
                              0: none (plain MT-bench).
  --doc-tokens 2048           tokens per document: larger than the real-engine runs' 250 so
                              that it spans whole 512-token blocks and costs a prefill that
                              matters on the H100 profile; assumption.
  --output-tokens 400         each answer: lognormal(median 400, sigma 0.5) in [32, 1024];
                              assumption (MT-bench answers run to a few hundred tokens).
  --think-s 10                turn 2 arrives 0.5 s + 0.01 s per answer token (generation) +
                              exponential(mean 10 s) user think time after turn 1;
                              assumption. Turn 2's prompt = turn 1's + answer + question 2.

Rates. The arrival rates are not statistics of any public trace: each was set so that
the trace's own rate (x1) is near round_robin's knee on 8 engines of the h100-llama3-8b
profile (agentic x0.88, rag x1.0, mtbench x1.3 with `scripts/scoreboard.py`'s rule), so a
load sweep around the knee needs no extreme `--rate-scale`: scaling the rate also scales
the gaps between a session's turns, which would otherwise shrink far below a tool's or a
user's think time. Defaults: agentic 13,350 requests over 847 s, mean prompt 16,590
tokens, infinite-cache prefix hit 94.5 %; rag 14,992 over 500 s, 5,056 tokens, 37.1 %;
mtbench 32,000 over 563 s, 2,883 tokens, 88.8 % (the system prompt and the 16 documents
are most of each prompt). Generation takes ~2 s for the three.

Standard library only.
"""

import argparse
import bisect
import json
import math
import pathlib
import random
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


class Blocks:
    """Prefix-chained block ids: intern (parent id, block content) in order of first use."""

    def __init__(self, block_tokens: int):
        self.bt = block_tokens
        self.ids: dict = {}

    def _intern(self, parent: int, content: tuple) -> int:
        key = (parent, content)
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.ids)
        return i

    def hash_ids(self, segments) -> list:
        """segments: (content key, tokens) pairs making up the prompt, in order."""
        out, parent, pieces, fill = [], -1, [], 0
        for key, n in segments:
            off = 0
            while off < n:
                take = min(n - off, self.bt - fill)
                pieces.append((key, off, off + take))
                off += take
                fill += take
                if fill == self.bt:
                    parent = self._intern(parent, tuple(pieces))
                    out.append(parent)
                    pieces, fill = [], 0
        if fill:
            out.append(self._intern(parent, tuple(pieces)))
        return out


def lognormal(rng, median, sigma, lo, hi):
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def zipf_weights(n, s):
    return [1.0 / (r ** s) for r in range(1, n + 1)]


def poisson_times(rng, rate, duration):
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def pair(s, cast=float):
    a, b = (cast(x) for x in s.split(","))
    return a, b


# Each generator returns a list of (time_s, input_tokens, output_tokens, segments, session id).

def gen_agentic(a, rng):
    lo, hi = pair(a.prefix_tokens, int)
    prefixes = [rng.randint(lo, hi) for _ in range(a.prefixes)]
    weights = zipf_weights(a.prefixes, a.prefix_zipf)
    f_lo, f_hi = pair(a.fanout, int)
    reqs = []
    for s, start in enumerate(poisson_times(rng, a.sessions_per_s, a.duration_s)):
        p = rng.choices(range(a.prefixes), weights)[0]
        ctx = [(("prefix", p), prefixes[p]), (("task", s), lognormal(rng, a.task_tokens, 0.8, 50, 4000))]
        q = 1.0 / max(1.0, a.turns_mean - 1)  # 2 + geometric(mean turns_mean - 2) calls
        turns = 2
        while turns < a.turns_max and rng.random() > q:
            turns += 1
        t = start
        for k in range(turns):
            n_in = sum(n for _, n in ctx)
            if n_in > a.max_context:
                break
            out = lognormal(rng, a.output_tokens, 0.7, 10, 1024)
            reqs.append((t, n_in, out, list(ctx), f"agent-{s}"))
            ctx.append((("out", s, k), out))
            t += 0.5 + 0.01 * out + rng.lognormvariate(math.log(a.tool_s), 1.0)
            if k > 0 and rng.random() < a.fanout_p:
                answers = longest = 0
                for j in range(rng.randint(f_lo, f_hi)):
                    suffix = lognormal(rng, 300, 0.8, 20, 4000)
                    o = lognormal(rng, a.output_tokens, 0.7, 10, 1024)
                    if n_in + out + suffix <= a.max_context:
                        reqs.append((t, n_in + out + suffix, o, ctx + [(("sib", s, k, j), suffix)], f"agent-{s}"))
                    answers += o
                    longest = max(longest, o)
                ctx.append((("sibres", s, k), answers))
                t += 0.5 + 0.01 * longest  # the siblings' answers, then the main line resumes
            else:
                ctx.append((("obs", s, k), lognormal(rng, a.observation_tokens, 1.0, 20, 8000)))
    return reqs


def gen_rag(a, rng):
    lens = [lognormal(rng, a.doc_tokens, 0.4, 128, 4096) for _ in range(a.docs)]
    weights = zipf_weights(a.docs, a.zipf)
    # Popularity rank is not document id order: shuffle which document holds which rank.
    rank_to_doc = list(range(a.docs))
    rng.shuffle(rank_to_doc)
    cum = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    reqs = []
    for i, t in enumerate(poisson_times(rng, a.rate, a.duration_s)):
        chosen = []
        while len(chosen) < a.top_k:
            r = bisect.bisect_left(cum, rng.random() * acc)
            d = rank_to_doc[min(r, a.docs - 1)]
            if d not in chosen:
                chosen.append(d)
        rng.shuffle(chosen)
        segs = [(("system",), a.system_tokens)] + [(("doc", d), lens[d]) for d in chosen]
        segs.append((("question", i), lognormal(rng, a.question_tokens, 0.6, 5, 400)))
        reqs.append((t, sum(n for _, n in segs), lognormal(rng, a.output_tokens, 0.6, 16, 1024), segs, f"rag-{i}"))
    return reqs


def gen_mtbench(a, rng):
    questions = []
    for line in pathlib.Path(a.questions).read_text().splitlines():
        if line.strip():
            turns = json.loads(line)["turns"]
            questions.append([max(1, round(len(x) / 4)) + 8 for x in turns])
    doc_lens = [a.doc_tokens] * a.docs
    reqs = []
    t = 0.0
    for c in range(a.conversations):
        t += rng.expovariate(a.rate)
        q = rng.randrange(len(questions))
        ctx = [(("system",), a.system_tokens)] if a.system_tokens else []
        if a.docs:
            d = rng.randrange(a.docs)
            ctx.append((("doc", d), doc_lens[d]))
        at = t
        for k, n in enumerate(questions[q]):
            ctx.append((("user", c, k), n))
            out = lognormal(rng, a.output_tokens, 0.5, 32, 1024)
            reqs.append((at, sum(n for _, n in ctx), out, list(ctx), f"conv-{c}"))
            ctx.append((("answer", c, k), out))
            at += 0.5 + 0.01 * out + rng.expovariate(1.0 / a.think_s)
    return reqs


def write(reqs, path, block_tokens, name, sessions=True):
    blocks = Blocks(block_tokens)
    reqs = sorted(reqs, key=lambda r: r[0])  # stable: equal times keep generation order
    seen, hit, total = set(), 0, 0
    turns: dict = {}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t, n_in, out, segs, sid in reqs:
            ids = blocks.hash_ids(segs)
            # Infinite-cache prefix hit: leading full blocks seen before (partial tail never).
            full = n_in // block_tokens
            run = 0
            while run < full and ids[run] in seen:
                run += 1
            hit += run * block_tokens
            total += n_in
            seen.update(ids[:full])
            line = {"timestamp": int(t) * 1000, "input_length": n_in, "output_length": out, "hash_ids": ids}
            if block_tokens != 512:
                line["block_size"] = block_tokens
            if sessions:
                line["session_id"] = sid
                line["turn_id"] = turns[sid] = turns.get(sid, -1) + 1
            f.write(json.dumps(line, separators=(", ", ": ")) + "\n")
    span = reqs[-1][0] if reqs else 0
    mean_in = total / max(1, len(reqs))
    print(f"{name}: {path}: {len(reqs)} requests over {span:.0f} s ({len(reqs) / max(span, 1):.2f} req/s), "
          f"mean prompt {mean_in:.0f} tokens, mean output {sum(r[2] for r in reqs) / max(1, len(reqs)):.0f}, "
          f"infinite-cache prefix hit {100 * hit / max(1, total):.1f} %", file=sys.stderr)


GENERATORS = {"agentic": gen_agentic, "rag": gen_rag, "mtbench": gen_mtbench}


def add_args(p, kind):
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--no-session-ids", action="store_true")
    if kind == "agentic":
        p.add_argument("--prefixes", type=int, default=4)
        p.add_argument("--prefix-tokens", default="4000,12000")
        p.add_argument("--prefix-zipf", type=float, default=1.0)
        p.add_argument("--sessions-per-s", type=float, default=1.2)
        p.add_argument("--duration-s", type=float, default=600)
        p.add_argument("--task-tokens", type=float, default=500)
        p.add_argument("--turns-mean", type=float, default=12)
        p.add_argument("--turns-max", type=int, default=50)
        p.add_argument("--output-tokens", type=float, default=120)
        p.add_argument("--observation-tokens", type=float, default=400)
        p.add_argument("--tool-s", type=float, default=3)
        p.add_argument("--max-context", type=int, default=32768)
        p.add_argument("--fanout-p", type=float, default=0.15)
        p.add_argument("--fanout", default="2,6")
    elif kind == "rag":
        p.add_argument("--docs", type=int, default=2000)
        p.add_argument("--doc-tokens", type=float, default=1000)
        p.add_argument("--zipf", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=4)
        p.add_argument("--system-tokens", type=int, default=1000)
        p.add_argument("--question-tokens", type=float, default=40)
        p.add_argument("--output-tokens", type=float, default=200)
        p.add_argument("--rate", type=float, default=30)
        p.add_argument("--duration-s", type=float, default=500)
    elif kind == "mtbench":
        p.add_argument("--questions", default=str(REPO / "data/traces/mtbench_question.jsonl"))
        p.add_argument("--conversations", type=int, default=16000)
        p.add_argument("--rate", type=float, default=32)
        p.add_argument("--system-tokens", type=int, default=512)
        p.add_argument("--docs", type=int, default=16)
        p.add_argument("--doc-tokens", type=int, default=2048)
        p.add_argument("--output-tokens", type=float, default=400)
        p.add_argument("--think-s", type=float, default=10)


def generate(kind, args, out):
    if kind == "rag" and args.top_k > args.docs:
        raise SystemExit("--top-k must not exceed --docs")
    rng = random.Random(f"{kind}:{args.seed}")
    write(GENERATORS[kind](args, rng), out, args.block_tokens, kind, not args.no_session_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="kind", required=True)
    for kind in GENERATORS:
        p = sub.add_parser(kind)
        p.add_argument("--out", required=True)
        add_args(p, kind)
    p = sub.add_parser("all", help="the three generators with their defaults (and --seed)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.kind == "all":
        for kind in GENERATORS:
            sp = argparse.ArgumentParser()
            add_args(sp, kind)
            ka = sp.parse_args(["--seed", str(args.seed)])
            generate(kind, ka, pathlib.Path(args.out_dir) / f"{kind}.jsonl")
    else:
        generate(args.kind, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
