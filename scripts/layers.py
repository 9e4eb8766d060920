#!/usr/bin/env python3
"""Checks that the gateway's modules import only downward (docs/architecture.md, "Floors"),
and that no crate's modules import each other in a circle.

usage: scripts/layers.py [--graph]   (run from the repository root)

Each file of crates/kvroute-gateway/src sits on a floor (FLOORS below). A file may name
(`crate::a::b`, `use crate::{a, b::c}`, `super::x`) only modules on a lower floor, or modules
on its own floor that FLOORS lists as its allowed neighbours. Prints every back-edge and exits
1 if there is one, or if modules import each other in a circle (even on one floor); with
--graph prints every edge.
"""
import pathlib
import re
import sys

SRC = pathlib.Path("crates/kvroute-gateway/src")
CRATES = pathlib.Path("crates")

# module path prefix -> floor. The longest matching prefix wins.
FLOORS = {
    # F0 vocabulary: pure data and checks, imports nothing of the gateway.
    "model": 0, "twin": 0, "cluster::chunks": 0,
    # F1 configuration: the config types and their validation.
    "config": 1,
    # F2 base components: import F0-F1, kvroute-core, kvroute-protocol.
    "metrics": 2, "fleet": 2, "routers": 2, "api_keys": 2, "tls": 2, "tokenizer": 2, "hops": 2,
    "upstream": 2, "body_budget": 2, "admin_token": 2,
    # F3 components built on the base ones (never the app).
    "pd": 3, "lora": 3, "kv_tokens": 3, "kv_move": 3, "record": 3, "tenant": 3, "cluster::sync": 3,
    "cluster::last_known": 3, "cluster::journal": 3,
    # F4 composition only: AppState.
    "app": 4,
    # F5 behaviour every task shares: membership, one policy apply.
    "membership": 5, "policy_control": 5,
    # F6 the request pipeline and the background tasks.
    "pipeline": 6, "health": 6, "kv_subscriber": 6, "reload": 6, "cluster": 6,
    # F7 the HTTP surface and serve().
    "admin": 7, "server": 7, "epp": 7, "lib": 8,
}

# Same-floor imports between different units that are allowed: (from, to).
NEIGHBOURS = {
    # The prefix journal stores the cluster sync's routed events, written like the last
    # known registry.
    ("cluster::journal", "cluster::sync"), ("cluster::journal", "cluster::last_known"),
    # The admin token is a secret read and compared as API keys are (a bounded file read,
    # a constant-time comparison).
    ("admin_token", "api_keys"),
}

def module_of(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    return "::".join(parts) or "lib"

def known_modules(src: pathlib.Path = SRC):
    return {module_of(p, src) for p in src.rglob("*.rs")}

def resolve(path: str, modules) -> str | None:
    parts = path.split("::")
    for n in range(len(parts), 0, -1):
        cand = "::".join(parts[:n])
        if cand in modules:
            return cand
    return None

def floor_key(module: str) -> str:
    best = None
    for k in FLOORS:
        if module == k or module.startswith(k + "::"):
            if best is None or len(k) > len(best):
                best = k
    return best

USE_GROUP = re.compile(r"use\s+crate::\{(.*?)\};", re.S)
CRATE_PATH = re.compile(r"crate::((?:[a-z_][a-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)")
SUPER_PATH = re.compile(r"super::((?:[a-z_][a-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)")

def group_paths(body: str):
    """Top-level paths of a brace group, `a::{b, c::d}, e` -> a::b, a::c::d, e."""
    out, depth, cur, prefix_stack = [], 0, "", []
    # flatten simply: split on commas at depth 0 and expand one nested level recursively
    def split(s):
        parts, d, buf = [], 0, ""
        for ch in s:
            if ch == "{": d += 1
            if ch == "}": d -= 1
            if ch == "," and d == 0:
                parts.append(buf); buf = ""
            else:
                buf += ch
        parts.append(buf)
        return [p.strip() for p in parts if p.strip()]
    def expand(s, pre):
        for p in split(s):
            if "{" in p:
                head, rest = p.split("{", 1)
                expand(rest.rsplit("}", 1)[0], pre + head.strip())
            else:
                out.append(pre + p.split(" as ")[0].strip())
    expand(body, "")
    return out

def edges(src: pathlib.Path = SRC):
    modules = known_modules(src)
    result = set()
    for p in sorted(src.rglob("*.rs")):
        me = module_of(p, src)
        text = p.read_text()
        # test modules may reach anything
        text = re.split(r"#\[cfg\(test\)\]\s*(?:pub(?:\(crate\))?\s+)?mod tests", text)[0]
        text = re.sub(r"//.*", "", text)
        paths = CRATE_PATH.findall(text)
        for body in USE_GROUP.findall(text):
            paths += group_paths(body)
        parent = me.rsplit("::", 1)[0] if "::" in me else ""
        if not p.name == "mod.rs":
            base = parent
        else:
            base = me.rsplit("::", 1)[0] if "::" in me else ""
        for sp in SUPER_PATH.findall(text):
            paths.append((base + "::" + sp) if base else sp)
        # A child module named by its bare path (`dispatch::send` in pipeline/mod.rs).
        for child in re.findall(r"(?<![:\w])([a-z_][a-z0-9_]*)::", text):
            full = (me + "::" + child) if me != "lib" else child
            if full in modules:
                paths.append(full)
        for path in paths:
            target = resolve(path, modules)
            if target and target != me:
                result.add((me, target))
    return result

def cycles(es):
    """Strongly connected groups of more than one module (Tarjan)."""
    graph = {}
    for a, b in es:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop(); on.discard(w); group.append(w)
                if w == v: break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out

def main():
    bad = []
    es = sorted(edges())
    for group in cycles(es):
        bad.append("import circle: " + ", ".join(group))
    for a, b in es:
        ka, kb = floor_key(a), floor_key(b)
        if ka is None or kb is None:
            bad.append(f"no floor: {a} -> {b}: module without a floor (add it to FLOORS in scripts/layers.py)")
            continue
        fa, fb = FLOORS[ka], FLOORS[kb]
        same_unit = ka == kb
        if fb < fa or same_unit or (ka, kb) in NEIGHBOURS:
            continue
        bad.append(f"back-edge: {a} (F{fa}) -> {b} (F{fb})")
    # Every other crate: no circle between its modules either.
    for src in sorted(CRATES.glob("*/src")):
        if src == SRC:
            continue
        for group in cycles(sorted(edges(src))):
            bad.append(f"import circle in {src.parent.name}: " + ", ".join(group))
    if "--graph" in sys.argv:
        for a, b in es:
            print(f"{a} -> {b}")
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print(f"{len(bad)} import(s) against the floors or in a circle (docs/architecture.md, \"Floors\")", file=sys.stderr)
        return 1
    return 0

sys.exit(main())
