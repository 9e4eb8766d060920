#!/usr/bin/env python3
"""Lists the non-test Rust functions longer than N lines (signature to closing brace).

usage: scripts/long-fns.py N DIR...   exits 1 when it lists any.

Functions under tests/ and benches/, in a `#[cfg(test)] mod tests` or marked `#[test]` are
left out. docs/architecture.md says why the gateway and the binary keep functions short.
"""
import re, sys, pathlib
limit = int(sys.argv[1])
fn_re = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(async\s+)?(const\s+)?(unsafe\s+)?fn\s+([A-Za-z_0-9]+)')
out = []
for d in sys.argv[2:]:
    for p in sorted(pathlib.Path(d).rglob('*.rs')):
        if '/tests/' in str(p) or '/benches/' in str(p):
            continue
        lines = p.read_text().split('\n')
        in_test_mod_depth = None
        depth = 0
        i = 0
        test_attr = False
        while i < len(lines):
            l = lines[i]
            s = l.strip()
            if s.startswith('#[cfg(test)]') or s.startswith('#[test]') or s.startswith('#[tokio::test'):
                test_attr = True
            m = fn_re.match(l)
            if m and not s.startswith('//'):
                # find body start
                j = i; d0 = 0; started = False; end = None
                while j < len(lines):
                    code = re.sub(r'//.*', '', lines[j])
                    code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
                    code = re.sub(r"'(\\.|[^'\\])'", "''", code)
                    for ch in code:
                        if ch == '{': d0 += 1; started = True
                        elif ch == '}': d0 -= 1
                    if not started and code.rstrip().endswith(';'):
                        break
                    if started and d0 == 0:
                        end = j; break
                    j += 1
                if end is not None:
                    n = end - i + 1
                    if n > limit and not test_attr:
                        out.append((n, f"{p}:{i+1}", m.group(6)))
                    test_attr = False
                    # skip test modules entirely
                i += 1
                continue
            if s.startswith('mod tests') and test_attr:
                # skip to end of module
                d0 = 0; j = i; started=False
                while j < len(lines):
                    for ch in re.sub(r'//.*','',lines[j]):
                        if ch == '{': d0 += 1; started=True
                        elif ch == '}': d0 -= 1
                    if started and d0 == 0: break
                    j += 1
                i = j + 1; test_attr = False; continue
            if s and not s.startswith('#') and not s.startswith('//'):
                test_attr = False if not s.startswith('mod') else test_attr
            i += 1
for n, loc, name in sorted(out, reverse=True):
    print(f"{n:5d} {loc} {name}")
sys.exit(1 if out else 0)
