"""gateway/prefix_routing.py: where a prompt's first page goes (the rule alone, over plain worker
names and loads), and `cde bench prefix-routing` on a small case: two real workers, real Routers,
prefix routing against round robin in one run."""

import argparse

from cde.gateway.prefix_routing import PrefixAffinity

from cde.commands.bench_prefix_routing import bench


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def route(affinity: PrefixAffinity, k: bytes, loads: dict[str, int], slack: int = 4) -> str:
    return affinity.choose(k, sorted(loads), lambda w: w, lambda w: loads[w], slack)


def test_prefixes_spread_evenly_and_stay_where_they_went():
    affinity = PrefixAffinity()
    loads = {"a": 0, "b": 0}
    homes = {}
    for n in range(8):
        homes[n] = route(affinity, key(n), loads)
        loads[homes[n]] += 1  # outstanding until the end
    assert sorted(homes.values()).count("a") == 4  # 4 prefixes each, whatever their hashes
    for n in range(8):  # seen before: back where it went, while not busy
        assert route(affinity, key(n), loads) == homes[n]


def test_a_busy_home_sends_to_the_least_loaded_which_then_holds_the_prefix_too():
    affinity = PrefixAffinity()
    loads = {"a": 0, "b": 0}
    home = route(affinity, key(1), loads)
    other = "b" if home == "a" else "a"
    loads[home] = 5  # more than slack (4) above the other
    assert route(affinity, key(1), loads) == other
    loads[home] = 0
    loads[other] = 1
    assert route(affinity, key(1), loads) == home  # the least loaded of its holders
    loads[home] = 2
    assert route(affinity, key(1), loads) == other


def test_a_new_prefix_is_placed_by_rendezvous_hashing_among_equals():
    placed = {route(PrefixAffinity(), key(n), {"a": 0, "b": 0}) for n in range(16)}
    assert placed == {"a", "b"}  # not always the first worker
    # the same key and endpoints: the same worker in another gateway
    assert all(
        route(PrefixAffinity(), key(n), {"a": 0, "b": 0}) == route(PrefixAffinity(), key(n), {"a": 0, "b": 0})
        for n in range(16)
    )


def test_the_table_is_bounded():
    affinity = PrefixAffinity(max_remembered=3)
    for n in range(10):
        route(affinity, key(n), {"a": 0, "b": 0, "c": 0})
    assert len(affinity._holders) == 3 and sum(affinity._homes.values()) == 3


def test_bench_prefix_routing_beats_round_robin_on_a_small_case(tiny_dir):
    args = argparse.Namespace(
        workers=2,
        max_running=4,
        prefixes=2,
        prefix_tokens=256,
        tail_tokens=8,
        requests=8,
        concurrency=4,
        max_tokens=4,
        policies="round-robin,prefix",
    )
    rr, prefix = bench(args, str(tiny_dir))
    assert rr["policy"] == "round-robin" and prefix["policy"] == "prefix"
    assert rr["requests_per_worker"] == [4, 4]
    # 2 prefixes x 4 requests: the first of each prefix misses, on each worker it reaches
    assert prefix["hit_rate"] == 3 / 4 and rr["hit_rate"] == 2 / 4
    assert prefix["max_min_ratio"] <= 1.5
