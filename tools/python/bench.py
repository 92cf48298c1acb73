"""Python overhead: getHost+report per second through the binding, uncached
and cached, against the Rust client (`lbagent qpstest --threads 1`) on the
same standalone system in the same run. Medians of --runs runs.

    pip install . && python3 tools/python/bench.py [--seconds 2] [--runs 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Not this directory: its lbagent/ is the package's source, without the
# native half that `pip install .` built.
sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")
import lbagent  # noqa: E402
from standalone import MODULE, System  # noqa: E402


def python_rate(system, cache, seconds):
    c = lbagent.Client(heartbeat=system.heartbeat, cache=cache)
    modid, cmdid = MODULE
    get_host, report = c.get_host, c.report
    n = 0
    end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while True:
        for _ in range(1000):
            host = get_host(modid, cmdid)
            report(modid, cmdid, host, 0, 1)
        n += 1000
        if time.perf_counter() >= end:
            break
    rate = n / (time.perf_counter() - t0)
    c.flush()
    return rate


def rust_rate(system, cache, seconds):
    args = [system.bin, "qpstest", "--threads", "1", "--duration", str(seconds), "--json",
            "--heartbeat", system.heartbeat, "--modid", str(MODULE[0]), "--cmdid", str(MODULE[1])]
    if cache:
        args.append("--cache")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)["qps"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    system = System()
    try:
        print("getHost+report per second, one thread, median of %d runs of %d s (%s)"
              % (a.runs, a.seconds, system.bin))
        print("%-9s %14s %14s %8s %16s" % ("path", "Rust client", "Python", "ratio", "cost per call"))
        for cache in (False, True):
            rs, ps = [], []
            for _ in range(a.runs):
                rs.append(rust_rate(system, cache, a.seconds))
                ps.append(python_rate(system, cache, a.seconds))
            r, p = statistics.median(rs), statistics.median(ps)
            extra_us = (1 / p - 1 / r) * 1e6
            print("%-9s %14.0f %14.0f %7.2fx %13.2f us" % ("cached" if cache else "uncached", r, p, p / r, extra_us))
    finally:
        system.stop()


if __name__ == "__main__":
    main()
