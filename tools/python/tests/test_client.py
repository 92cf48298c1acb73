"""The Python package against a real lbagent standalone system."""

import os
import time

import pytest

import lbagent
from standalone import CANARY, DAGOR, DAGOR_NODE, MODULE, NODES, SINGLE, SINGLE_NODE


def counts(client, module, node):
    """(rsucc, rerr) of `node` in the agent's view of `module`."""
    ip, port = node.split(":")
    for n in client.get_route(*module):
        if (n["ip"], n["port"]) == (ip, int(port)):
            return n["rsucc"], n["rerr"]
    raise AssertionError("%s not in the route of %s" % (node, module))


def wait_counts(client, module, node, want, seconds=5.0):
    """Polls until the node's counters are `want` (reports are fire and forget)."""
    end = time.monotonic() + seconds
    got = counts(client, module, node)
    while got != want and time.monotonic() < end:
        time.sleep(0.02)
        got = counts(client, module, node)
    assert got == want, "counters of %s: %s, want %s" % (node, got, want)


def test_get_host_report_register_get_route(system):
    c = lbagent.Client(heartbeat=system.heartbeat)
    assert c.register(*MODULE) >= 1
    seen = set()
    for _ in range(4):
        ip, port = c.get_host(*MODULE, timeout=1.0)
        assert "%s:%d" % (ip, port) in NODES
        seen.add((ip, port))
        c.report(*MODULE, (ip, port), 0, 3)
    assert len(seen) == 2, "round robin over both nodes: %s" % seen
    route = c.get_route(*MODULE)
    assert sorted("%s:%d" % (n["ip"], n["port"]) for n in route) == sorted(NODES)
    for n in route:
        assert set(n) >= {"ip", "port", "weight", "overloaded", "vsucc", "verr", "rsucc", "rerr", "version"}
        assert n["overloaded"] is False
    c.flush()


def test_call_reports_success_and_failure_with_tcost(system):
    c = lbagent.Client(heartbeat=system.heartbeat)
    before = counts(c, SINGLE, SINGLE_NODE)
    with c.call(*SINGLE) as host:
        assert "%s:%d" % host == SINGLE_NODE
    wait_counts(c, SINGLE, SINGLE_NODE, (before[0] + 1, before[1]))

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with c.call(*SINGLE) as host:
            time.sleep(0.01)
            raise Boom()
    # A failure is reported, and the exception went through untouched.
    wait_counts(c, SINGLE, SINGLE_NODE, (before[0] + 1, before[1] + 1))


def test_errors_are_typed_under_one_base_class(system):
    c = lbagent.Client(heartbeat=system.heartbeat)
    with pytest.raises(lbagent.NoSuchModule) as e:
        c.get_host(999999, 1, timeout=1.0)
    assert isinstance(e.value, lbagent.LbError)
    assert (e.value.code, e.value.kind) == (3, "no_such_module")
    with pytest.raises(lbagent.BadArgument) as e:
        c.get_host(*MODULE, timeout=0)
    assert e.value.code == 10
    with pytest.raises(lbagent.BadArgument):
        c.get_host(*MODULE, business_priority=200)
    with pytest.raises(lbagent.BadArgument):
        c.report(*MODULE, ("not-an-ip", 80))
    with pytest.raises(lbagent.BadArgument):
        c.report(*MODULE, ("10.7.0.1", 0))
    with pytest.raises(OverflowError):
        c.get_host(-1, 1)


def test_without_an_agent(tmp_path):
    c = lbagent.Client(heartbeat=str(tmp_path / "none"), snapshot=str(tmp_path / "none.snapshot"))
    with pytest.raises(lbagent.AgentDown) as e:
        c.register(*MODULE, timeout=0.1)
    assert e.value.code == 6
    with pytest.raises(lbagent.StaticRoutes) as e:
        c.get_host(*MODULE, timeout=0.1)
    assert e.value.code == 7
    # Reports are dropped while the agent is down, as in the original.
    c.report(*MODULE, ("10.7.0.1", 80), 0, 1)


def test_the_static_route_file_answers_when_the_agent_is_down(system, tmp_path):
    c = lbagent.Client(heartbeat=str(tmp_path / "none"), snapshot=system.snapshot)
    # The agent rewrites the file every second (agent.snapshot_interval=1):
    # the first one may predate the module.
    end = time.monotonic() + 10
    while True:
        try:
            ip, port, source = c.get_host_source(*MODULE, timeout=0.1)
            break
        except lbagent.StaticRoutes:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    assert "%s:%d" % (ip, port) in NODES
    assert source == "static_routes"


def test_the_cache_answers_in_process(system):
    c = lbagent.Client(heartbeat=system.heartbeat, cache=True)
    sources = set()
    for _ in range(20):
        ip, port, source = c.get_host_source(*MODULE)
        assert "%s:%d" % (ip, port) in NODES
        sources.add(source)
        c.report(*MODULE, (ip, port), 0, 1)
    assert "cache" in sources, sources
    c.flush()


def test_a_client_is_usable_from_several_threads(system):
    import threading

    c = lbagent.Client(heartbeat=system.heartbeat)
    errors = []

    def work():
        try:
            for _ in range(50):
                host = c.get_host(*MODULE)
                c.report(*MODULE, host)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_levels_encode_and_decode_for_a_services_protocol():
    assert lbagent.encode_level((10, 128)) == bytes([10, 128])
    assert lbagent.encode_level(None) == bytes([0, 0])
    assert lbagent.decode_level(bytes([10, 128, 99])) == (10, 128)
    assert lbagent.decode_level(b"\x00\x00") is None
    for bad in (b"\x05", bytes([0, 7]), bytes([129, 1])):
        with pytest.raises(lbagent.BadArgument):
            lbagent.decode_level(bad)
    with pytest.raises(lbagent.BadArgument):
        lbagent.encode_level((0, 5))
    with pytest.raises(lbagent.BadArgument):
        lbagent.encode_level((1, 129))


def test_user_ids_hash_with_the_clients_seed_and_period(system):
    a = lbagent.Client(heartbeat=system.heartbeat, user_hash_seed=11, user_key_period_s=86400)
    b = lbagent.Client(heartbeat=system.heartbeat, user_hash_seed=12, user_key_period_s=86400)
    ids = ["user-%d" % i for i in range(64)]
    pa = [a.user_priority(i) for i in ids]
    assert all(1 <= p <= 128 for p in pa)
    assert pa == [a.user_priority(i.encode()) for i in ids], "str is hashed as its UTF-8"
    assert sum(x != y for x, y in zip(pa, [b.user_priority(i) for i in ids])) > 50
    with pytest.raises(lbagent.BadArgument) as e:
        lbagent.Client(heartbeat=system.heartbeat, user_key_period_s=0)
    assert "user_key_period_s" in str(e.value)
    with pytest.raises(lbagent.BadArgument):
        a.get_host(*DAGOR, user_priority=3, user_id="alice")


def test_a_reported_downstream_level_rejects_lower_priorities(system):
    client = lbagent.Client(heartbeat=system.heartbeat)
    ip, port = DAGOR_NODE.split(":")
    node = (ip, int(port))
    assert client.get_host(*DAGOR, user_id="alice") == node
    with pytest.raises(lbagent.BadArgument):
        client.report(*DAGOR, node, 0, 3, downstream_level=(0, 7))
    # The downstream said (10, 128), as a service's response would carry it.
    level = lbagent.decode_level(lbagent.encode_level((10, 128)))
    client.report(*DAGOR, node, 0, 3, downstream_level=level)
    try:
        # The level lives admission.level_timeout_ms (3 s).
        with pytest.raises(lbagent.Rejected) as e:
            client.get_host(*DAGOR, business_priority=20, user_id="alice")
        assert (e.value.code, e.value.kind) == (5, "rejected")
        assert client.get_host(*DAGOR, business_priority=5, user_id="alice") == node
        assert client.get_host_source(*DAGOR, business_priority=10, user_id=b"alice") == node + ("agent",)
    finally:
        # (128, 128) is the open level: the agent forgets the node's level.
        client.report(*DAGOR, node, 0, 3, downstream_level=(128, 128))
    assert client.get_host(*DAGOR, business_priority=20, user_id="alice") == node


def test_a_key_gets_the_same_node_every_time(system):
    c = lbagent.Client(heartbeat=system.heartbeat)
    c.register(*MODULE)
    seen = set()
    for k in range(16):
        first = c.get_host_keyed(*MODULE, "session-%d" % k)
        assert "%s:%d" % first in NODES
        for _ in range(3):
            assert c.get_host_keyed(*MODULE, b"session-%d" % k) == first
        seen.add(first)
    assert len(seen) == 2, "16 keys over both nodes: %s" % seen


def test_a_selector_gets_only_the_nodes_it_matches(system):
    c = lbagent.Client(heartbeat=system.heartbeat)
    c.register(*MODULE)
    ip, port = CANARY.split(":")
    for _ in range(6):
        assert c.get_host_selecting(*MODULE, "version=canary") == (ip, int(port))
    # An empty selector is a plain getHost (earlier tests' reports may hold
    # a node overloaded: any node of the module).
    for _ in range(4):
        assert "%s:%d" % c.get_host_selecting(*MODULE, "") in NODES
    for bad in ("version", "a=1,a=2", "k=v v", "k=" + "v" * 64):
        with pytest.raises(lbagent.BadArgument):
            c.get_host_selecting(*MODULE, bad)
