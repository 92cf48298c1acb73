#!/usr/bin/env python3
"""The fleet lab's driver (run by tools/fleet/lab, which builds the
binaries and tears down on any exit).

Builds a bridge and one network namespace per host (10.77.0.0/16), a
PostgreSQL primary and a synchronous streaming standby, route servers,
reporters, real agent hosts each with an application load
(`lbagent-fleet app`), and a simulator host (`lbagent-fleet sim`, the
route churn and the verdict); runs the scenarios asked for under route
churn and statistics load; then lets `lbagent-fleet verdict` check the
invariants and print the table. Exit status: 0 when every invariant held,
1 when one failed, 2 when the lab itself could not run.

Everything it creates (namespaces, the bridge, processes, the database
clusters, the temporary directory) is written to DIR/state.json as it is
created, so that `lab.py --teardown DIR` removes it after any failure.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

NET = "10.77"
# The most connections a route server or reporter of the lab holds: the
# 20,000 open files a process may hold here, less room for its store,
# logs and listeners.
MAX_CONNS_PER_SERVER = 19000


def conn_limit(a, servers):
    """The `max_connections` each of `servers` route servers (or
    reporters) gets: its share of every agent's one connection, with half
    again for an uneven spread after reconnections, never below the
    default 10,000 nor above what a process's files allow."""
    agents = a.sim_agents + a.agents
    share = -(-agents * 3 // (2 * servers)) + 100
    return max(10000, min(MAX_CONNS_PER_SERVER, share))
# Scenario 7's previous release: main as it stood before issue 32's work
# was merged (6256ce3, 2026-11-27 04:39 UTC: schema version 2, reporters
# acknowledging on receipt, no StatsReport.agent_start).
DEFAULT_PREVIOUS = "6256ce3497dd02d5b512de5840d3172f89349aa1"
PG_PORT = 5432
RS_PORT = 7777
RP_PORT = 7778


class LabError(Exception):
    """The lab could not be built or driven (not an invariant)."""


# === state: what to tear down ===


class State:
    def __init__(self, d, tag):
        self.dir = d
        self.path = os.path.join(d, "state.json")
        self.s = {"tag": tag, "netns": [], "links": [], "pids": []}
        self.save()

    def add(self, kind, value):
        self.s[kind].append(value)
        self.save()

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.s, f)
        os.replace(tmp, self.path)


def teardown(d):
    """Kills every process group, deletes every namespace and link the
    state file in `d` names; then removes `d`."""
    path = os.path.join(d, "state.json")
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError):
        s = {"netns": [], "links": [], "pids": []}
    for pid in reversed(s["pids"]):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    # Wait (bounded) for the groups to go before removing their files.
    deadline = time.time() + 10
    for pid in s["pids"]:
        while time.time() < deadline:
            try:
                os.killpg(pid, 0)
                time.sleep(0.05)
            except (ProcessLookupError, PermissionError):
                break
    for ns in s["netns"]:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    for link in s["links"]:
        subprocess.run(["ip", "link", "del", link], stderr=subprocess.DEVNULL)
    shutil.rmtree(d, ignore_errors=True)


# === the lab ===


def sh(*args, check=True, capture=False, timeout=120, **kw):
    r = subprocess.run(
        list(args),
        check=False,
        text=True,
        capture_output=capture,
        timeout=timeout,
        **kw,
    )
    if check and r.returncode != 0:
        err = (r.stderr or "").strip() if capture else ""
        raise LabError(f"{' '.join(args)} exited {r.returncode}: {err}")
    return r


def nft(ns, rules):
    """Loads nftables rules (nft -f syntax) in namespace ns."""
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True,
                       capture_output=True, timeout=30)
    if r.returncode != 0:
        raise LabError(f"nft in {ns} refused the rules: {r.stderr.strip()}")


def log(msg):
    print(f"[lab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Lab:
    def __init__(self, args, state):
        self.a = args
        self.st = state
        self.dir = state.dir
        self.tag = state.s["tag"]
        self.bridge = f"{self.tag}br"
        self.hosts = {}  # name -> (ns, ip)
        self.procs = {}  # name -> Popen
        self.n_veth = 0
        self.windows = []  # (from_ms, to_ms, host or None)
        self.events = []  # (ms, what)
        self.figures = {}
        # Scenario 7: the fleet starts on the previous release.
        self.previous = 7 in args.scenarios
        self.first_bin = args.previous_lbagent if self.previous else None
        os.makedirs(os.path.join(self.dir, "logs"), exist_ok=True)

    # --- network ---

    def net_up(self):
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.st.add("links", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def host(self, name, ip):
        ns = f"{self.tag}-{name}"
        sh("ip", "netns", "add", ns)
        self.st.add("netns", ns)
        self.n_veth += 1
        outer, inner = f"{self.tag}v{self.n_veth}", f"{self.tag}i{self.n_veth}"
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", outer, "master", self.bridge)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", inner, "name", "eth0")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        self.hosts[name] = (ns, ip)
        return ns

    def ns(self, name):
        return self.hosts[name][0]

    def ip(self, name):
        return self.hosts[name][1]

    # --- processes ---

    def start(self, key, host, argv, user=None):
        """Starts argv in host's namespace, in its own process group,
        output to logs/KEY.log."""
        pre = ["ip", "netns", "exec", self.ns(host)]
        if user:
            pre += ["runuser", "-u", user, "--"]
        out = open(os.path.join(self.dir, "logs", f"{key}.log"), "ab")
        p = subprocess.Popen(
            pre + argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        self.st.add("pids", p.pid)
        self.procs[key] = p
        return p

    def signal(self, key, sig):
        p = self.procs[key]
        os.killpg(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait(timeout=30)

    def in_ns(self, host, *argv, user=None, check=True, capture=True, timeout=60):
        pre = ["ip", "netns", "exec", self.ns(host)]
        if user:
            pre += ["runuser", "-u", user, "--"]
        return sh(*(pre + list(argv)), check=check, capture=capture, timeout=timeout)

    def wait_for(self, what, cond, within):
        deadline = time.time() + within
        while time.time() < deadline:
            if cond():
                return
            time.sleep(0.1)
        raise LabError(f"{what}: not within {within} s (logs in {self.dir}/logs)")

    def alive(self, key):
        return self.procs[key].poll() is None

    # --- PostgreSQL ---

    def pg_bin(self, name):
        versions = sorted(os.listdir("/usr/lib/postgresql"), key=lambda v: int(v))
        return f"/usr/lib/postgresql/{versions[-1]}/bin/{name}"

    def psql(self, host, sql, db="lbagent", check=True):
        r = self.in_ns(
            "sim",
            "psql", "-X", "-qAt", "-h", self.ip(host), "-U", "postgres", "-d", db,
            "-c", sql,
            check=check,
            timeout=20,
        )
        return r.stdout.strip()

    def pg_ready(self, host):
        r = self.in_ns(
            "sim", self.pg_bin("pg_isready"), "-q", "-h", self.ip(host), "-p", str(PG_PORT), "-U", "postgres",
            check=False,
        )
        return r.returncode == 0

    def postgres_up(self):
        pgdir = os.path.join(self.dir, "pg")
        os.makedirs(pgdir)
        shutil.chown(pgdir, "postgres", "postgres")
        d1, d2 = os.path.join(pgdir, "db1"), os.path.join(pgdir, "db2")
        for sock in ("sock1", "sock2"):
            os.makedirs(os.path.join(pgdir, sock))
            shutil.chown(os.path.join(pgdir, sock), "postgres", "postgres")
        sh("runuser", "-u", "postgres", "--", self.pg_bin("initdb"), "-D", d1,
           "-U", "postgres", "--auth=trust", capture=True)
        with open(os.path.join(d1, "postgresql.conf"), "a") as f:
            f.write(
                f"listen_addresses = '{self.ip('db1')}'\n"
                f"port = {PG_PORT}\n"
                f"unix_socket_directories = '{pgdir}/sock1'\n"
                "fsync = off\n"
                "full_page_writes = off\n"
                "wal_level = replica\n"
                "max_wal_senders = 5\n"
                "wal_keep_size = '256MB'\n"
                "hot_standby = on\n"
                "synchronous_commit = on\n"
                "max_connections = 200\n"
                "shared_buffers = '64MB'\n"
            )
        with open(os.path.join(d1, "pg_hba.conf"), "a") as f:
            f.write(f"host all all {NET}.0.0/16 trust\n")
            f.write(f"host replication all {NET}.0.0/16 trust\n")
        self.start("db1", "db1", [self.pg_bin("postgres"), "-D", d1], user="postgres")
        self.wait_for("PostgreSQL primary ready", lambda: self.pg_ready("db1"), 60)
        self.psql("db1", "CREATE DATABASE lbagent", db="postgres")
        self.in_ns("db2", self.pg_bin("pg_basebackup"), "-h", self.ip("db1"), "-U", "postgres",
                   "-D", d2, "-R", "-X", "stream", "--checkpoint=fast", user="postgres", timeout=120)
        with open(os.path.join(d2, "postgresql.conf"), "a") as f:
            # Once promoted it has no standby: it must not wait for one.
            f.write(f"listen_addresses = '{self.ip('db2')}'\nsynchronous_standby_names = ''\n"
                    f"unix_socket_directories = '{pgdir}/sock2'\n")
        self.start("db2", "db2", [self.pg_bin("postgres"), "-D", d2], user="postgres")
        self.wait_for("PostgreSQL standby ready", lambda: self.pg_ready("db2"), 60)
        # From now on a commit returns once the standby has it: a promotion
        # loses nothing acknowledged (the lab's invariant). Set once the
        # standby streams: before, every commit would wait for it.
        self.psql("db1", "ALTER SYSTEM SET synchronous_standby_names = '*'", db="postgres")
        self.psql("db1", "SELECT pg_reload_conf()", db="postgres")
        self.wait_for(
            "the standby streaming synchronously",
            lambda: self.psql("db1", "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                              db="postgres", check=False) == "1",
            60,
        )
        self.pgdata = {"db1": d1, "db2": d2}

    def store_url(self):
        return (f"postgres://postgres@{self.ip('db1')}:{PG_PORT},{self.ip('db2')}:{PG_PORT}/lbagent"
                "?target_session_attrs=read-write&connect_timeout=2")

    # --- lbagent servers and agents ---

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def rs_names(self):
        return [f"rs{i + 1}" for i in range(self.a.route_servers)]

    def rp_names(self):
        return [f"rp{i + 1}" for i in range(self.a.reporters)]

    def rs_addrs(self):
        return [f"{self.ip(n)}:{RS_PORT}" for n in self.rs_names()]

    def rp_addrs(self):
        return [f"{self.ip(n)}:{RP_PORT}" for n in self.rp_names()]

    def start_rs(self, name, binary=None):
        ip = self.ip(name)
        conf = self.write(f"{name}.toml", f"""
[dnsserver]
listen = "{ip}:{RS_PORT}"
metrics_addr = "127.0.0.1:9777"
max_connections = {conn_limit(self.a, self.a.route_servers)}
[store]
url = "{self.store_url()}"
[tls]
insecure = true
""")
        self.start(name, name, [binary or self.a.lbagent, "dnsserver", "--config", conf])

    def start_rp(self, name, binary=None):
        ip = self.ip(name)
        # A reporter that refuses a non-loopback listen address even with
        # tls.insecure (a fault of reporters built before issue 32's fix:
        # they validated their section against a default [tls]) listens on
        # loopback in its namespace, reached through a DNAT rule; the lab
        # says so.
        listen = f"127.0.0.1:{RP_PORT}" if self.rp_loopback else f"{ip}:{RP_PORT}"
        conf = self.write(f"{name}.toml", f"""
[reporter]
listen = "{listen}"
metrics_addr = "127.0.0.1:9778"
max_connections = {conn_limit(self.a, self.a.reporters)}
[store]
url = "{self.store_url()}"
[tls]
insecure = true
""")
        self.start(name, name, [binary or self.a.lbagent, "reporter", "--config", conf])

    def rp_loopback_dnat(self, name):
        ns = self.ns(name)
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1")
        nft(ns, f"""table ip fleetdnat {{
  chain pre {{
    type nat hook prerouting priority -100;
    tcp dport {RP_PORT} dnat to 127.0.0.1:{RP_PORT}
  }}
}}
""")

    def reporters_up(self):
        self.rp_loopback = False
        first = self.rp_names()[0]
        self.start_rp(first, self.first_bin)
        deadline = time.time() + 60
        while time.time() < deadline and not self.port_open_quiet(first, RP_PORT):
            if not self.alive(first):
                with open(os.path.join(self.dir, "logs", f"{first}.log"), errors="replace") as f:
                    text = f.read()
                if "reporter.listen" in text and "out of range" in text:
                    self.rp_loopback = True
                    self.figures["reporter_listen_fault"] = True
                    log("SYSTEM FAULT: the reporter refuses a non-loopback listen address with "
                        "tls.insecure = true (it validates [reporter] against a default [tls]); "
                        "working around it: reporters listen on 127.0.0.1 behind a DNAT rule")
                    break
                raise LabError(f"{first} exited (code {self.procs[first].returncode}); see its log below")
            time.sleep(0.1)
        for n in self.rp_names():
            if self.rp_loopback:
                self.rp_loopback_dnat(n)
            if n != first or self.rp_loopback:
                self.start_rp(n, self.first_bin)

    def port_open_quiet(self, name, port):
        ip = self.ip(name)
        r = self.in_ns("sim", "bash", "-c", f"exec 3<>/dev/tcp/{ip}/{port}", check=False, timeout=5)
        return r.returncode == 0

    def port_open(self, name, port):
        if not self.alive(name):
            raise LabError(f"{name} exited (code {self.procs[name].returncode}); see its log below")
        return self.port_open_quiet(name, port)

    def agent_modules(self, i):
        """Real agent i's module indexes: 10 of the hot set."""
        return [(i * 10 + j) % self.a.hot for j in range(10)]

    def start_agent(self, name, binary=None):
        home = os.path.join(self.dir, name)
        os.makedirs(home, exist_ok=True)
        os.chmod(home, 0o755)
        servers = ", ".join(f'"{a}"' for a in self.rs_addrs())
        reporters = ", ".join(f'"{a}"' for a in self.rp_addrs())
        conf = self.write(f"{name}.toml", f"""
[agent]
bind = "127.0.0.1"
shards = 1
route_servers = [{servers}]
reporters = [{reporters}]
heartbeat_path = "{home}/heartbeat"
snapshot_path = "{home}/routes.snapshot"
snapshot_interval = 5
metrics_addr = "127.0.0.1:9888"
[shm]
dir = "{home}"
[tls]
insecure = true
{self.refresh_section()}""")
        self.start(name, name, [binary or self.a.lbagent, "agent", "--config", conf])
        return home

    # --- the run ---

    def now_ms(self):
        return int(time.time() * 1000)

    def event(self, what):
        self.events.append((self.now_ms(), what))
        log(what)

    def build(self):
        a = self.a
        t0 = time.time()
        self.net_up()
        self.host("db1", f"{NET}.0.11")
        self.host("db2", f"{NET}.0.12")
        for i, n in enumerate(self.rs_names()):
            self.host(n, f"{NET}.0.{21 + i}")
        for i, n in enumerate(self.rp_names()):
            self.host(n, f"{NET}.0.{31 + i}")
        self.host("sim", f"{NET}.0.41")
        self.agents = [f"ag{i + 1}" for i in range(a.agents)]
        for i, n in enumerate(self.agents):
            self.host(n, f"{NET}.1.{i + 1}")
        log(f"network: bridge {self.bridge}, {len(self.hosts)} namespaces")
        self.postgres_up()
        log("PostgreSQL: primary and synchronous standby streaming")
        # The schema and the modules, before any server reads the store
        # (scenario 7: after, see upgrade_setup_after_servers).
        self.churn_out = os.path.join(self.dir, "churn.json")
        if not self.upgrade_setup_after_servers():
            self.churn_setup()
        for n in self.rs_names():
            self.start_rs(n, self.first_bin)
        self.reporters_up()
        for n in self.rs_names():
            self.wait_for(f"route server {n} listening", lambda n=n: self.port_open(n, RS_PORT), 60)
        for n in self.rp_names():
            self.wait_for(f"reporter {n} listening", lambda n=n: self.port_open(n, RP_PORT), 60)
        if self.upgrade_setup_after_servers():
            self.churn_setup()
        self.homes = {}
        for n in self.agents:
            self.homes[n] = self.start_agent(n, self.first_bin)
        log(f"servers: {len(self.rs_names())} route servers, {len(self.rp_names())} reporters; "
            f"{len(self.agents)} agents; built in {time.time() - t0:.1f} s")

    def churn_setup(self):
        """The lab's modules imported (and the schema made or migrated,
        with the current build's store code)."""
        a = self.a
        self.in_ns("sim", a.fleet, "churn", "--store", self.store_url(), "--modules", str(a.modules),
                   "--duration-s", "0", "--out", self.churn_out, timeout=120)

    def start_load(self, run_s):
        a = self.a
        self.sim_outs = []
        per = a.sim_per_process
        k = 0
        while k < a.sim_agents:
            n = min(per, a.sim_agents - k)
            out = os.path.join(self.dir, f"sim{k}.json")
            self.sim_outs.append(out)
            self.start(f"sim{k}", "sim", [
                a.fleet, "sim", "--route-servers", ",".join(self.rs_addrs()),
                "--reporters", ",".join(self.rp_addrs()), "--agents", str(n), "--first", str(k),
                "--modules", str(a.modules), "--duration-s", str(run_s + 120),
                "--drain-s", "20", "--stats-interval-ms", str(a.sim_stats_interval_ms), "--out", out,
                "--refresh-ms", str(a.refresh_s * 1000),
            ])
            k += n
        self.app_outs = []
        for i, n in enumerate(self.agents):
            out = os.path.join(self.dir, f"app-{n}.json")
            self.app_outs.append(out)
            home = self.homes[n]
            self.start(f"app-{n}", n, [
                a.fleet, "app", "--host", n, "--heartbeat", f"{home}/heartbeat",
                "--snapshot", f"{home}/routes.snapshot",
                "--modules", ",".join(str(m) for m in self.agent_modules(i)),
                "--rate", str(a.app_rate), "--duration-s", str(run_s + 120), "--out", out,
            ])

    def start_churn(self, run_s):
        a = self.a
        self.start("churn", "sim", [
            a.fleet, "churn", "--store", self.store_url(), "--modules", str(a.modules),
            "--hot", str(a.hot), "--interval-ms", str(a.churn_interval_ms),
            "--duration-s", str(run_s), "--out", self.churn_out,
            # The modules were imported by churn_setup: importing them again
            # would push every module to every follower before the churn.
            "--no-setup",
        ])

    def sleep_until(self, t):
        d = t - time.time()
        if d > 0:
            time.sleep(d)

    def cpu_s(self, key):
        """CPU seconds (user + system) process KEY has used so far."""
        try:
            with open(f"/proc/{self.procs[key].pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def rs_rss_kib(self):
        """Every route server's resident memory, KiB (/proc/PID/status)."""
        out = {}
        for n in self.rs_names():
            with open(f"/proc/{self.procs[n].pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[n] = int(line.split()[1])
        return out

    def check_up(self):
        """Every server and agent process still runs (none needed a hand)."""
        for key in self.rs_names() + self.rp_names() + self.agents:
            if not self.alive(key):
                raise LabError(f"{key} exited by itself (code {self.procs[key].returncode}); "
                               f"see {self.dir}/logs/{key}.log")

    # --- scenarios: each returns the seconds it took ---

    def scenario_1(self):
        """Steady churn, no fault."""
        self.event("scenario 1: steady churn")
        time.sleep(self.a.steady_s)

    def scenario_2(self):
        """A route server killed (-9) and restarted as a supervisor would;
        another frozen (SIGSTOP) for a while, then resumed."""
        victim, frozen = self.rs_names()[0], self.rs_names()[1]
        t = self.now_ms()
        self.event(f"scenario 2: kill -9 {victim}")
        self.signal(victim, signal.SIGKILL)
        time.sleep(1)
        self.start_rs(victim)
        self.wait_for(f"{victim} back", lambda: self.port_open(victim, RS_PORT), 30)
        self.event(f"scenario 2: {victim} restarted")
        self.windows.append((t, self.now_ms(), None))
        time.sleep(4)
        t = self.now_ms()
        self.event(f"scenario 2: SIGSTOP {frozen}")
        self.signal(frozen, signal.SIGSTOP)
        time.sleep(self.a.freeze_s)
        self.signal(frozen, signal.SIGCONT)
        self.event(f"scenario 2: SIGCONT {frozen}")
        self.windows.append((t, self.now_ms(), None))
        time.sleep(5)

    def scenario_3(self):
        """Every route server restarted at once."""
        t = self.now_ms()
        self.event("scenario 3: every route server killed and restarted at once")
        for n in self.rs_names():
            self.signal(n, signal.SIGKILL)
        for n in self.rs_names():
            self.start_rs(n)
        for n in self.rs_names():
            self.wait_for(f"{n} back", lambda n=n: self.port_open(n, RS_PORT), 30)
        self.windows.append((t, self.now_ms(), None))
        self.figures.setdefault("restart_all_ms", []).append(t)
        self.storm_pulls(t)
        self.sleep_until(t / 1000 + 11)
        self.figures["storm"][-1]["refresh_s"] = self.a.refresh_s

    def nft_cut(self, host, cut):
        ns = self.ns(host)
        if cut:
            servers = ", ".join(self.ip(n) for n in self.rs_names() + self.rp_names())
            nft(ns, f"""table inet fleetcut {{
  chain out {{
    type filter hook output priority 0;
    ip daddr {{ {servers} }} drop
  }}
  chain in {{
    type filter hook input priority 0;
    ip saddr {{ {servers} }} drop
  }}
}}
""")
        else:
            nft(ns, "delete table inet fleetcut\n")

    def scenario_4(self):
        """One agent host cut from every server by nftables, then healed."""
        host = self.agents[0]
        t = self.now_ms()
        self.event(f"scenario 4: {host} cut from every server")
        self.nft_cut(host, True)
        time.sleep(self.a.partition_s / 2)
        # Scenario 5 may run here, inside the partition (--short does).
        if 5 in self.pending:
            self.pending.remove(5)
            self.scenario_5()
        self.sleep_until(t / 1000 + self.a.partition_s)
        self.nft_cut(host, False)
        healed = self.now_ms()
        self.event(f"scenario 4: {host} healed")
        self.windows.append((t, healed, host))
        self.figures["heal_ms"] = healed
        time.sleep(5)

    def scenario_5(self):
        """PostgreSQL primary killed, the standby promoted."""
        self.event("scenario 5: kill -9 the PostgreSQL primary")
        self.signal("db1", signal.SIGKILL)
        time.sleep(1)
        self.in_ns("db2", self.pg_bin("pg_ctl"), "promote", "-w", "-D", self.pgdata["db2"],
                   user="postgres", timeout=60)
        promoted = self.now_ms()
        self.event("scenario 5: standby promoted")
        self.figures["promoted_ms"] = promoted
        since = promoted // 1000

        def stats_written():
            r = self.psql("db2", f"SELECT count(*) FROM server_call_status WHERE ts > {since}", check=False)
            return r.isdigit() and int(r) > 0

        self.wait_for("statistics written after the promotion", stats_written, 60)
        self.figures["stats_after_promotion_ms"] = self.now_ms() - promoted
        self.event(f"scenario 5: statistics written again {self.now_ms() - promoted} ms after the promotion")
        time.sleep(3)

    def scenario_6(self):
        """A reporter killed under statistics load, restarted as a
        supervisor would."""
        victim = self.rp_names()[0]
        self.event(f"scenario 6: kill -9 {victim}")
        self.signal(victim, signal.SIGKILL)
        time.sleep(2)
        self.start_rp(victim)
        self.wait_for(f"{victim} back", lambda: self.port_open(victim, RP_PORT), 30)
        self.event(f"scenario 6: {victim} restarted")
        time.sleep(5)

    # === scenario 3: pulls per agent in the restart storm (upgrade branch) ===

    def rs_metrics(self, name):
        """Route server NAME's /metrics samples, summed over labels:
        {"lbagent_dnsserver_pull_requests_total": v, ...} ({} when it
        does not answer)."""
        r = self.in_ns(name, "curl", "-sf", "--max-time", "5", "http://127.0.0.1:9777/metrics",
                       check=False, timeout=15)
        out = {}
        for line in (r.stdout or "").splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            name_only = key.split("{", 1)[0]
            try:
                out[name_only] = out.get(name_only, 0) + float(value)
            except ValueError:
                pass
        return out

    def storm_pulls(self, killed_at_ms):
        """What the restarted route servers were asked, counted from their
        own metrics (they start from 0 at the restart), read before any
        periodic re-pull can be due: an agent re-pulls a module
        `refresh_ms` (15 s) jittered down by at most a quarter after its
        last answer, and every answer a restarted server gave came after
        the kill, so nothing counted up to 3/4 of `--refresh-s` after it
        is a periodic re-pull. Read once every agent is connected and the
        count holds still for a second, or 1 s before that bound (at least
        10 s). On a saturated machine the servers may have accepted
        connections whose PullReq they have not read yet: a longer
        window (`--refresh-s 120`) lets them."""
        agents = self.a.sim_agents + len(self.agents)
        last = None
        while True:
            time.sleep(1)
            with ThreadPoolExecutor(len(self.rs_names())) as pool:
                per = list(pool.map(self.rs_metrics, self.rs_names()))
            took_ms = self.now_ms() - killed_at_ms

            def total(metric):
                return sum(m.get(f"lbagent_dnsserver_{metric}", 0) for m in per)

            now = (total("connections"), total("pull_requests_total"))
            window_ms = max(10_000, self.a.refresh_s * 750 - 1000)
            if (now[0] >= agents and now == last) or took_ms >= window_ms:
                break
            last = now
        connected = total("connections")
        storm = {
            "read_after_ms": took_ms,
            "agents": agents,
            "connections": int(connected),
            "connections_accepted": int(total("connections_accepted_total")),
            "pull_requests": int(total("pull_requests_total")),
            "modules_pulled": int(total("pulls_total")),
            "answers": int(total("answers_total")),
            "unchanged": int(total("unchanged_total")),
            "held": int(total("pulls_held_total")),
            "connections_refused": int(total("connections_refused_total")),
            "subscriptions_refused": int(total("subscriptions_refused_total")),
        }
        storm["pulls_per_agent"] = round(storm["pull_requests"] / max(1, connected), 3)
        storm["modules_pulled_per_agent"] = round(storm["modules_pulled"] / max(1, connected), 2)
        self.figures.setdefault("storm", []).append(storm)
        self.event(f"scenario 3: {storm['pull_requests']} PullReqs ({storm['modules_pulled']} modules: "
                   f"{storm['answers']} answered with nodes, {storm['unchanged']} unchanged) from "
                   f"{int(connected)} agents connected, {took_ms} ms after the kill")

    # === scenario 7: the rolling upgrade (upgrade branch) ===

    def refresh_section(self):
        """The agents' periodic re-pull, when --refresh-s is not the default."""
        return "" if self.a.refresh_s == 15 else f"[lb]\nupdate_timeout = {self.a.refresh_s}\n"

    def upgrade_setup_after_servers(self):
        """Scenario 7: the previous release's servers make the schema of
        their version in the empty database; the lab's modules are
        imported after, with the current build's store code, which
        migrates the schema under the running servers (as an operator's
        newer `lbagent route` would)."""
        return self.previous

    def upgrade_budget_s(self):
        n = len(self.rs_names()) + len(self.rp_names()) + self.a.agents
        return 40 + n * (self.a.upgrade_settle_s + 8)

    def upgrade_replace(self, key, start, ready, host_window):
        """Stops KEY (SIGTERM, as a package upgrade's restart does),
        starts it again with the current build, waits until it is ready."""
        p = self.procs[key]
        t = self.now_ms()
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.upgrade_note(f"{key}: the previous release did not stop within 30 s of SIGTERM (killed)")
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        if p.returncode not in (0, -signal.SIGTERM):
            self.upgrade_note(f"{key}: the previous release exited {p.returncode} on SIGTERM")
        start()
        self.wait_for(f"{key} (current build) ready", ready, 60)
        self.windows.append((t, self.now_ms(), host_window))
        self.event(f"scenario 7: {key} runs the current build ({self.now_ms() - t} ms)")
        time.sleep(self.a.upgrade_settle_s)

    def upgrade_note(self, what):
        self.figures.setdefault("upgrade_notes", []).append(what)
        log(f"scenario 7: {what}")

    def heartbeat_fresh(self, name, since_ms):
        try:
            return os.stat(os.path.join(self.homes[name], "heartbeat")).st_mtime * 1000 > since_ms
        except OSError:
            return False

    def upgrade_probe_previous_server(self):
        """A previous-release route server started on the store the current
        build migrated (as a supervisor restarting one mid-upgrade, or a
        rollback, would): does it serve?"""
        version = self.psql("db1", "SELECT max(version) FROM schema_version", check=False)
        conf = self.write("probe-rs.toml", f"""
[dnsserver]
listen = "{self.ip('rs1')}:{RS_PORT + 2}"
metrics_addr = "127.0.0.1:9779"
[store]
url = "{self.store_url()}"
[tls]
insecure = true
""")
        try:
            r = self.in_ns("rs1", self.a.previous_lbagent, "dnsserver", "--config", conf, check=False, timeout=20)
            said = " ".join((r.stderr + r.stdout).strip().splitlines()[-1:])[-220:]
            self.upgrade_note(f"a previous-release route server started on the store at schema version "
                              f"{version}: exited {r.returncode}: {said}")
        except subprocess.TimeoutExpired:
            self.upgrade_note(f"a previous-release route server started on the store at schema version "
                              f"{version}: it ran (stopped after 20 s)")

    def upgrade_options(self):
        """Module options and the p2c policy, set with the current build on
        two of the real agents' modules while every server and agent is the
        previous release (which knows neither)."""
        (m1, m2) = (self.agent_modules(0)[0], self.agent_modules(0)[1])
        for argv in ([self.a.lbagent, "route", "policy", str(10_000 + m1), "1", "p2c"],
                     [self.a.lbagent, "route", "options", str(10_000 + m2), "1", "--slow-start-ms", "5000"]):
            r = self.in_ns("sim", *argv, "--store", self.store_url(), check=False, timeout=30)
            if r.returncode != 0:
                self.upgrade_note(f"{' '.join(argv[1:4])}: exited {r.returncode}: {r.stderr.strip()[:200]}")
        time.sleep(2)
        bad = {n: self.rs_metrics(n).get("lbagent_dnsserver_store_bad_rows") for n in self.rs_names()}
        self.upgrade_note(f"p2c on module {10_000 + m1}, slow start on {10_000 + m2} (current CLI): "
                          f"previous-release route servers' store_bad_rows gauge {bad}")

    def scenario_7(self):
        """The rolling upgrade: every route server, reporter and agent
        replaced one by one with the current build, under churn and
        statistics load."""
        self.event(f"scenario 7: the fleet runs the previous release ({self.a.previous[:12]})")
        self.upgrade_probe_previous_server()
        self.upgrade_options()

        def rs(n):
            self.upgrade_replace(n, lambda: self.start_rs(n), lambda: self.port_open(n, RS_PORT), None)

        def rp(n):
            self.upgrade_replace(n, lambda: self.start_rp(n), lambda: self.port_open(n, RP_PORT), None)

        def agent(n):
            t = self.now_ms()
            self.upgrade_replace(n, lambda: self.start_agent(n),
                                 lambda: self.alive(n) and self.heartbeat_fresh(n, t), n)

        # Interleaved, so that both mixes run a while: previous-release
        # agents on current servers, and current agents (the simulated
        # ones throughout, half the real ones from early on) on
        # previous-release servers.
        half = (len(self.agents) + 1) // 2
        rs(self.rs_names()[0])
        for n in self.agents[:half]:
            agent(n)
        rp(self.rp_names()[0])
        for n in self.rs_names()[1:]:
            rs(n)
        for n in self.rp_names()[1:]:
            rp(n)
        for n in self.agents[half:]:
            agent(n)
        self.event("scenario 7: every process runs the current build")

    def run(self):
        a = self.a
        self.build()
        # Long enough for every scenario; the apps and churn stop at its end.
        budget = {1: a.steady_s, 2: 16 + a.freeze_s, 3: 14, 4: a.partition_s + 6, 5: 10, 6: 10,
                  7: self.upgrade_budget_s()}
        run_s = 8 + sum(budget.get(s, 0) for s in a.scenarios)
        rss0 = self.rs_rss_kib()
        self.start_load(run_s)
        t_start = time.time()
        # Every link up, every module registered and in the agents' static
        # route files (written every 5 s), before the first change: the
        # apps time arrivals only from then on.
        time.sleep(12)
        self.check_up()
        self.start_churn(run_s)
        time.sleep(2)
        rss1 = self.rs_rss_kib()
        per_server = a.sim_agents / len(self.rs_names())
        self.figures["rs_rss_kib_before"] = rss0
        self.figures["rs_rss_kib_after"] = rss1
        self.figures["rs_kib_per_agent"] = round(
            sum(rss1[n] - rss0[n] for n in rss0) / len(rss0) / per_server, 2)
        self.pending = list(a.scenarios)
        self.segments = []
        while self.pending:
            s = self.pending.pop(0)
            t = self.now_ms()
            getattr(self, f"scenario_{s}")()
            self.segments.append((f"scenario-{s}", t, self.now_ms()))
            self.check_up()
        log("scenarios done; letting the churn and the load finish")
        self.procs["churn"].wait(timeout=max(10, run_s - (time.time() - t_start) + 60))
        # The last change reaches everyone: within the bound, as every other.
        time.sleep(max(3, a.bound_ms / 1000))
        self.figures["cpu_s"] = {
            "simulators": round(sum(self.cpu_s(k) for k in self.procs if k.startswith("sim")), 1),
            "route_servers": round(sum(self.cpu_s(k) for k in self.rs_names()), 1),
            "reporters": round(sum(self.cpu_s(k) for k in self.rp_names()), 1),
            "agents": round(sum(self.cpu_s(k) for k in self.agents), 1),
            "wall": round(time.time() - t_start, 1),
        }
        for k, p in self.procs.items():
            if k.startswith("sim") or k.startswith("app-"):
                os.killpg(p.pid, signal.SIGTERM)
        for n in self.agents:
            self.procs[f"app-{n}"].wait(timeout=60)
        for k, p in list(self.procs.items()):
            if k.startswith("sim"):
                p.wait(timeout=60)
                if p.returncode != 0:
                    raise LabError(f"simulator {k} exited {p.returncode}; see {self.dir}/logs/{k}.log")
        for n in self.agents:
            if self.procs[f"app-{n}"].returncode != 0:
                raise LabError(f"application on {n} exited {self.procs[f'app-{n}'].returncode}; "
                               f"see {self.dir}/logs/app-{n}.log")
        self.check_up()
        return self.verdict()

    def heal_convergence(self):
        host = self.agents[0]
        cut = [w for w in self.windows if w[2] == host][-1]
        with open(self.churn_out) as f:
            churn = json.load(f)
        with open(os.path.join(self.dir, f"app-{host}.json")) as f:
            app = json.load(f)
        return heal_convergence_ms(churn, app, cut[0], cut[1])

    def verdict(self):
        a = self.a
        argv = [a.fleet, "verdict", "--churn", self.churn_out, "--store", self.store_url(),
                "--bound-ms", str(a.bound_ms), "--json", os.path.join(self.dir, "verdict.json")]
        for s in self.sim_outs:
            argv += ["--sim", s]
        for p in self.app_outs:
            argv += ["--app", p]
        for (name, f, t) in self.segments:
            argv += ["--segment", f"{name}={f}:{t}"]
        for (f, t, host) in self.windows:
            argv += ["--window", f"{f}:{t}" + (f":{host}" if host else "")]
        print()
        r = self.in_ns("sim", *argv, check=False, capture=False, timeout=180)
        figures = {}
        try:
            with open(os.path.join(self.dir, "verdict.json")) as f:
                figures = json.load(f)
        except (OSError, ValueError):
            pass
        churn = figures.get("churn", {})
        if "promoted_ms" in self.figures:
            p = self.figures["promoted_ms"]
            after = [t for t in churn.get("commit_times", []) if t > p]
            if after:
                print(f"{'route changes accepted again after the promotion':<58} {after[0] - p:>30}ms")
            print(f"{'statistics written again after the promotion':<58} "
                  f"{self.figures['stats_after_promotion_ms']:>30}ms")
        if "cpu_s" in self.figures:
            c = self.figures["cpu_s"]
            print(f"{'CPU seconds: simulators / route servers / reporters / agents':<58} "
                  f"{c['simulators']:>8} / {c['route_servers']} / {c['reporters']} / {c['agents']} "
                  f"in {c['wall']} s (load average {os.getloadavg()[0]:.1f})")
        if "rs_kib_per_agent" in self.figures:
            print(f"{'route servers: resident memory per subscribed agent (10 modules)':<58} "
                  f"{self.figures['rs_kib_per_agent']:>28}KiB")
        if "heal_ms" in self.figures:
            ms = self.heal_convergence()
            if ms is not None:
                self.figures["converged_after_heal_ms"] = ms
                print(f"{'partitioned host converged after the heal':<58} {ms:>30}ms")
        for t in self.figures.get("restart_all_ms", [])[-1:]:
            last = figures.get("route_links", {}).get("last_connect_ms", 0)
            if last >= t:
                self.figures["resubscribed_after_restart_ms"] = last - t
                print(f"{'every route server restarted -> last agent reconnected':<58} {last - t:>30}ms")
        self.print_upgrade_figures()
        summary = {"verdict": figures, "lab": self.figures, "events": self.events,
                   "windows": self.windows, "rc": r.returncode}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f)
        return r.returncode


    def print_upgrade_figures(self):
        """Scenario 3's pulls per agent and scenario 7's notes (what the
        invariants do not say)."""
        for st in self.figures.get("storm", [])[-1:]:
            print(f"{'every route server restarted -> PullReqs per agent (target <= 1)':<58} "
                  f"{st['pulls_per_agent']:>30}")
            print(f"{'... modules pulled per agent (answered with nodes / unchanged)':<58} "
                  f"{st['modules_pulled_per_agent']:>12} ({st['answers']} / {st['unchanged']})")
            print(f"{'... agents connected when counted / in the fleet':<58} "
                  f"{st['connections']:>12} / {st['agents']} at +{st['read_after_ms']} ms")
        for note in self.figures.get("upgrade_notes", []):
            print(f"scenario 7: {note}")


def heal_convergence_ms(churn, app, cut_from, healed):
    """ms from the heal to the partitioned host holding every change
    committed to its modules while it was cut (0: none was); None when it
    never got one of them."""
    seen = {tuple(a["module"]): a["seen"] for a in app["arrivals"]}
    worst = 0
    for c in churn["commits"]:
        m = tuple(c["module"])
        if m not in seen or not (cut_from <= c["t_ms"] <= healed):
            continue
        t = next((t for (v, t) in seen[m] if v >= c["version"]), None)
        if t is None:
            return None
        worst = max(worst, t - healed)
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the lab's temporary directory (made by tools/fleet/lab)")
    p.add_argument("--tag", default="fl", help="prefix of the lab's namespaces and links")
    p.add_argument("--teardown", action="store_true", help="remove everything DIR/state.json names")
    p.add_argument("--lbagent", help="the lbagent binary")
    p.add_argument("--fleet", help="the lbagent-fleet binary")
    p.add_argument("--short", action="store_true",
                   help="CI's run: 4 agent hosts, 1,000 simulated agents, scenarios 2, 4 and 5")
    p.add_argument("--scenarios", default="2,4,5", help="comma-separated, from 1-7 (default 2,4,5)")
    p.add_argument("--previous", default=DEFAULT_PREVIOUS,
                   help="scenario 7: the earlier commit the fleet starts on (tools/fleet/lab builds it "
                        f"and passes --previous-lbagent; default {DEFAULT_PREVIOUS})")
    p.add_argument("--previous-lbagent", help="scenario 7: the previous release's lbagent binary")
    p.add_argument("--refresh-s", type=int, default=15,
                   help="every agent's periodic re-pull of each module, s (real agents' lb.update_timeout, "
                        "the simulated agents' refresh; default 15, the agent's); the restart storm's pull "
                        "count waits for every agent up to 3/4 of it, so 120 gives it a window of 89 s")
    p.add_argument("--upgrade-settle-s", type=int, default=5,
                   help="scenario 7: seconds between one process replaced and the next")
    p.add_argument("--agents", type=int, default=16, help="real agent hosts (default 16)")
    p.add_argument("--sim-agents", type=int, default=10000, help="simulated agents (default 10,000)")
    p.add_argument("--sim-per-process", type=int, default=4000,
                   help="simulated agents per simulator process (2 files each; default 4,000)")
    p.add_argument("--sim-stats-interval-ms", type=int, default=0,
                   help="one statistics entry per simulated agent every this many ms "
                        "(default: the agent count, i.e. 1,000 entries a second in all)")
    p.add_argument("--route-servers", type=int, default=3)
    p.add_argument("--reporters", type=int, default=2)
    p.add_argument("--modules", type=int, default=1000)
    p.add_argument("--hot", type=int, default=160, help="modules the real agents follow (10 each)")
    p.add_argument("--churn-interval-ms", type=int, default=500)
    p.add_argument("--steady-s", type=int, default=60, help="scenario 1's length")
    p.add_argument("--freeze-s", type=int, default=6, help="scenario 2's SIGSTOP length")
    p.add_argument("--partition-s", type=int, default=30, help="scenario 4's cut length")
    p.add_argument("--app-rate", type=int, default=200, help="getHost + report per second per agent host")
    p.add_argument("--bound-ms", type=int, default=5000, help="the convergence bound the verdict checks")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    if a.teardown:
        teardown(a.dir)
        return 0
    if a.short:
        a.agents, a.sim_agents, a.scenarios = 4, 1000, "2,4,5"
    a.scenarios = [int(s) for s in a.scenarios.split(",") if s]
    if a.sim_stats_interval_ms <= 0:
        a.sim_stats_interval_ms = max(1000, a.sim_agents)
    bad = [s for s in a.scenarios if s not in range(1, 8)]
    if bad:
        print(f"lab: --scenarios: {bad} not in 1-7", file=sys.stderr)
        return 2
    if 7 in a.scenarios and not a.previous_lbagent:
        print("lab: scenario 7 needs --previous-lbagent (tools/fleet/lab builds it from --previous)",
              file=sys.stderr)
        return 2
    a.hot = min(a.hot, a.modules, max(10, a.agents * 10))
    if a.route_servers < 2 or a.reporters < 1:
        print("lab: needs at least 2 route servers and 1 reporter", file=sys.stderr)
        return 2
    # Every agent holds one connection to a route server and one to a
    # reporter, and a server process at most MAX_CONNS_PER_SERVER.
    agents = a.sim_agents + a.agents
    need = -(-agents // MAX_CONNS_PER_SERVER)
    if a.route_servers < need or a.reporters < need:
        print(f"lab: {agents} agents need at least {need} route servers and {need} reporters "
              f"({MAX_CONNS_PER_SERVER} connections a server process at most): "
              f"--route-servers {max(need, a.route_servers)} --reporters {max(need, a.reporters)}",
              file=sys.stderr)
        return 2
    state = State(a.dir, a.tag)
    lab = Lab(a, state)
    try:
        rc = lab.run()
    except (LabError, subprocess.TimeoutExpired) as e:
        print(f"lab: {e}", file=sys.stderr)
        rc = 2
    if rc != 0:
        show_logs(a.dir)
    return rc


def show_logs(d, lines=8):
    """The end of every log, for a run that failed (the directory goes
    with the teardown)."""
    logs = os.path.join(d, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            tail = f.readlines()[-lines:]
        if tail:
            print(f"--- {name} (last {len(tail)} lines)", file=sys.stderr)
            sys.stderr.write("".join(tail))


if __name__ == "__main__":
    sys.exit(main())
