"""Helpers the benchmark scripts share (standard library only): a free 127.0.0.1 port for
a process they start, and a bounded wait for its endpoint to answer 200.

Imported by scripts/cluster-bench.py, scripts/pd-bench.py and scripts/cascade-example.py
(Python puts the running script's directory on the import path).
"""

import socket
import sys
import time
import urllib.request


def free_port():
    """A TCP port free on 127.0.0.1 now (the caller's process binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url, what, secs=30):
    """Polls `url` every 50 ms until it answers 200; exits naming `what` after `secs`."""
    end = time.time() + secs
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit(f"{what} ({url}) did not answer 200 within {secs} s")
