"""A real lbagent system for the tests and the benchmark: `lbagent standalone`
on free loopback ports in a temporary directory, with module (77, 1) of two
nodes (one labelled version=canary), and (78, 1) and (79, 1) of one each, added by `lbagent route add`. Every wait is bounded."""

import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODULE = (77, 1)
NODES = ("10.7.0.1:80", "10.7.0.2:80")
#: The node of MODULE labelled version=canary (for selectors).
CANARY = "10.7.0.2:80"
#: A second module with one node, for tests that count its reports.
SINGLE = (78, 1)
SINGLE_NODE = "10.8.0.1:80"
#: A third module with one node, for the DAGOR tests' downstream levels
#: (a level rejects getHosts of the whole module while it lives).
DAGOR = (79, 1)
DAGOR_NODE = "10.9.0.1:80"


def binary():
    """The lbagent binary: $LBAGENT_BIN, else target/release or target/debug."""
    env = os.environ.get("LBAGENT_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "lbagent"
        if p.exists():
            return str(p)
    raise RuntimeError("no lbagent binary: run `cargo build` or set LBAGENT_BIN")


class System:
    """`lbagent standalone` in a temporary directory; stop() ends it."""

    def __init__(self):
        self.bin = binary()
        self.tmp = tempfile.TemporaryDirectory(prefix="lbagent-py-")
        d = Path(self.tmp.name)
        self.heartbeat = str(d / "heartbeat")
        self.snapshot = str(d / "data" / "routes.snapshot")
        self.store = "sqlite:" + str(d / "data" / "lbagent.db")
        sets = [
            "dnsserver.listen=127.0.0.1:0",
            "dnsserver.metrics_addr=127.0.0.1:0",
            "reporter.listen=127.0.0.1:0",
            "reporter.metrics_addr=127.0.0.1:0",
            "agent.metrics_addr=127.0.0.1:0",
            "agent.base_port=0",
            "agent.shards=1",
            "agent.heartbeat_path=" + self.heartbeat,
            # Counters never restart during a test session.
            "lb.clear_timeout=3600",
            # The static route file appears within a second of a route.
            "agent.snapshot_interval=1",
        ]
        args = [self.bin, "standalone", "--data", str(d / "data")]
        for s in sets:
            args += ["--set", s]
        self.log = open(d / "standalone.log", "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: os.path.getsize(self.heartbeat) > 0 and (d / "data" / "lbagent.db").exists(), 15, "a heartbeat")
            for module, node in [(MODULE, n) for n in NODES] + [(SINGLE, SINGLE_NODE), (DAGOR, DAGOR_NODE)]:
                labels = ["--label", "version=canary"] if (module, node) == (MODULE, CANARY) else []
                subprocess.run(
                    [self.bin, "route", "add", str(module[0]), str(module[1]), node, "--store", self.store] + labels,
                    check=True,
                    capture_output=True,
                )
            self._wait(self._served, 15, "modules 77/1, 78/1 and 79/1 served by the agent")
        except BaseException:
            self.stop()
            raise

    def _served(self):
        for m in (MODULE, SINGLE, DAGOR):
            r = subprocess.run(
                [self.bin, "gethost", str(m[0]), str(m[1]), "--heartbeat", self.heartbeat, "--timeout-ms", "200"],
                capture_output=True,
            )
            if r.returncode != 0:
                return False
        return True

    def _wait(self, cond, seconds, what):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("lbagent standalone exited: " + self._logtext())
            try:
                if cond():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("no %s within %d s: %s" % (what, seconds, self._logtext()))

    def _logtext(self):
        self.log.flush()
        return Path(self.tmp.name, "standalone.log").read_text(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.tmp.cleanup()
