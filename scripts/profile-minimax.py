#!/usr/bin/env python3
"""The least worst-case relative error any profile of the engine model's prefill form can have
on the measured H100 grid, by linear programming (what scripts/fit-profile.py's iterative fit
approaches), and the same for two other forms.

usage: python3 scripts/profile-minimax.py   (from the repository root; needs numpy and scipy,
e.g. `python3 -m venv /tmp/lp && /tmp/lp/bin/pip install numpy scipy`, then /tmp/lp/bin/python)

Minimises e subject to |model(C, N) / t − 1| <= e at every grid point with N >= 256 new
tokens, over the model's free constants. Forms:
- one attention cost for every pair (the profile's form until 2026-11-27): step_overhead +
  context_per_token·C (fixed: h100-llama3-8b's 6 ms and 40 ns) + o + a·N
  + b·(N·C + N(N+1)/2) + k·(C + N);
- issue #44's suggestion: o + a·N + b·N·(C + N/2);
- the profile's (crates/kvroute-sim/src/engine.rs): separate coefficients for the pairs over
  the cached prefix (N·C, `prefill_attention_s`) and over the new tokens (N(N+1)/2,
  `prefill_self_attention_s`), printed with its constants;
- one more term in C alone, for comparison.
"""
import json, numpy as np
from scipy.optimize import linprog
pts=[json.loads(l) for l in open('data/gpu/h100-llama3-8b-prefill-grid.jsonl') if '"grid"' in l]
pts=[p for p in pts if p['new']>=256]
fixed=lambda c: 0.006 + 0.04e-6*c


def minimax(fe, fixed, nonneg):
    """The least e with |(fixed(C) + fe(C, N)·x) / t − 1| <= e at every point, over x
    (non-negative when `nonneg`): (e, x), by linear programming."""
    A=[];b=[]
    for p in pts:
        c,n,t=p['cached'],p['new'],p['s']; f=np.array(fe(c,n))/t
        A.append(list(f)+[-1]); b.append(1-fixed(c)/t)
        A.append(list(-f)+[-1]); b.append(fixed(c)/t-1)
    k=len(fe(1,1))
    r=linprog([0]*k+[1],A_ub=A,b_ub=b,bounds=[(0,None) if nonneg else (None,None)]*k+[(0,None)],method='highs')
    return r.x[k], r.x[:k]


one_cost = lambda c,n: [1.0, n, n*c + n*(n+1)/2, c+n]   # prefill_step_overhead, a, b, k
for nonneg in (True, False):
    e, x = minimax(one_cost, fixed, nonneg)
    print('one cost a pair,', 'nonneg' if nonneg else 'free', 'minimax relative error %.2f%%'%(100*e), x)
e, x = minimax(lambda c,n: [1.0, n, n*(c+n/2)], lambda c: 0.0, True)
print("issue's form t = o + a n + b n (c + n/2): minimax %.2f%%"%(100*e), x)
for name, fe in [("the profile's: split n*c and n(n+1)/2", lambda c,n:[1.0,n,n*c,n*(n+1)/2,c+n]), ("one cost a pair plus c alone", lambda c,n:[1.0,n,n*c+n*(n+1)/2,c,n])]:
    e, x = minimax(fe, fixed, False)
    print(name, 'minimax %.2f%%'%(100*e), x)
