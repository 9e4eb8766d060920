#!/usr/bin/env python3
"""Benchmark aid (not a test): how often this machine takes a core away from a busy thread.

Spins on the monotonic clock for SECONDS (default 2) and counts the gaps between two
consecutive readings longer than THRESHOLD_US (default 3): on a VM these are the host
running something else on our core, invisible to the guest's own accounting. A timing
whose duration is d sees one of them with probability about d × (gaps per second), so
once that reaches 1 % its p99 is its p50 plus a gap: read decision p99s beside this.

usage: scripts/vm-stalls.py [SECONDS] [THRESHOLD_US]
"""
import statistics
import sys
import time


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    threshold = int(float(sys.argv[2]) * 1000) if len(sys.argv) > 2 else 3000
    now = time.perf_counter_ns
    start = prev = now()
    end = start + int(seconds * 1e9)
    gaps, steps = [], 0
    while prev < end:
        t = now()
        steps += 1
        if t - prev > threshold:
            gaps.append(t - prev)
        prev = t
    span = (prev - start) / 1e9
    step_ns = (prev - start - sum(gaps)) / max(steps - len(gaps), 1)
    print(f"{len(gaps)} gaps over {threshold / 1000:.0f} µs in {span:.1f} s: {len(gaps) / span:.0f} per second, "
          f"{100 * sum(gaps) / 1e9 / span:.2f} % of the time; clock reads took {step_ns:.0f} ns")
    if gaps:
        q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else gaps * 99
        print(f"gap µs: median {statistics.median(gaps) / 1000:.1f}, p90 {q[89] / 1000:.1f}, max {max(gaps) / 1000:.1f}")
        rate = len(gaps) / span
        print(f"a timing of d µs contains a gap with probability ≈ d × {rate / 1e6:.5f}; "
              f"1 % of timings at d ≈ {0.01 / rate * 1e6:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
