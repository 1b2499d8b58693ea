"""The round model (crowdtrain.testbed.roundmodel): its arithmetic, its limits, and the testbed rows
it was fitted to and checked against (tests/fixtures/testbed_rounds.json)."""

import json
import math
from pathlib import Path

import pytest

from crowdtrain.testbed import analysis
from crowdtrain.testbed import roundmodel as rm

FIXTURE = Path(__file__).parent / "fixtures" / "testbed_rounds.json"


def test_butterfly_volume_and_floor_match_the_testbed_analysis():
    wire = 22_062_528
    for g in (2, 3, 4, 8, 16, 100):
        vol = rm.bytes_per_peer(g, wire)
        assert vol["server_up"] == pytest.approx(2 * (g - 1) / g * wire * rm.FRAMING)
        assert vol["server_down"] == vol["server_up"]
        for rate in (1e7, 1e8, 1e9):
            assert rm.link_floor_s(g, wire, rate) == pytest.approx(analysis.butterfly_floor_s(g, wire, rate))
    assert rm.bytes_per_peer(1, wire)["server_up"] == 0
    assert rm.round_time_s(1, wire, 1e8) == 0


def test_client_mode_moves_the_reduction_onto_the_servers():
    wire, g = 1_000_000, 16
    all_servers = rm.bytes_per_peer(g, wire)
    half = rm.bytes_per_peer(g, wire, servers=8)
    # A server reduces 1/8 of the vector for 15 senders instead of 1/16: more than the butterfly.
    assert half["server_up"] == pytest.approx((15 + 7) / 8 * wire * rm.FRAMING)
    assert half["server_up"] > all_servers["server_up"]
    assert half["client_up"] == pytest.approx(wire * rm.FRAMING)  # its whole copy, to the servers
    assert rm.round_time_s(g, wire, 1e7, servers=8) > rm.round_time_s(g, wire, 1e7)
    with pytest.raises(ValueError, match="servers"):
        rm.bytes_per_peer(g, wire, servers=0)


def test_round_time_limits_and_monotonicity():
    wire = rm.MODELS["paper"].wire_bytes
    link_only = 2 * 15 / 16 * wire * rm.FRAMING * 8 / 1e7
    cpu = rm.CPU_S_PER_WIRE_BYTE * wire
    # Link-bound: the link time plus the part of the CPU the pipeline does not hide.
    assert rm.round_time_s(16, wire, 1e7) == pytest.approx(link_only + cpu / rm.OVERLAP)
    # An infinitely fast link leaves the CPU (and the round trips).
    assert rm.round_time_s(16, wire, 1e15) == pytest.approx(cpu, rel=1e-3)
    assert rm.round_time_s(16, wire, 1e15, rtt_s=0.1) == pytest.approx(cpu + rm.LATENCY_RTTS * 0.1, rel=1e-3)
    times = [rm.round_time_s(g, wire, 1e8) for g in (2, 4, 8, 16, 64, 1000)]
    assert times == sorted(times) and times[-1] < rm.round_time_s(2, wire, 1e8) * 2  # bounded by 2 copies
    assert rm.round_time_s(8, wire, 1e7) > rm.round_time_s(8, wire, 1e8)
    # Peers sharing two cores: more peers, longer rounds; each peer on its own machine: no such growth.
    shared = [rm.round_time_s(n, 22_062_528, 1e9, cores=2, step_share=0.1) for n in (2, 4, 8)]
    assert shared == sorted(shared) and shared[-1] > 3 * shared[0]
    with pytest.raises(ValueError, match="rate_bps"):
        rm.round_time_s(4, wire, 0)


def test_mixing_rounds_follow_moshpit():
    assert rm.mixing_rounds(100, 100) == 1 and rm.mixing_rounds(100, 1000) == 1
    assert rm.mixing_rounds(16, 4) == 2  # a 4x4 grid
    assert rm.mixing_rounds(17, 4) == 3
    assert rm.mixing_rounds(1000, 32) == 2 and rm.mixing_rounds(1024, 32) == 2
    assert rm.mixing_rounds(1000, 16) == 3
    with pytest.raises(ValueError, match="never mix"):
        rm.mixing_rounds(10, 1)


def test_dht_hops_grow_as_log_n():
    assert rm.dht_hops(20) == 1
    assert rm.dht_hops(1000) == 1 + math.ceil(math.log2(1000 / 20))
    assert rm.dht_hops(100) < rm.dht_hops(1000) < rm.dht_hops(10_000)


def test_model_sizes_are_the_models_wire_bytes():
    """The table of sizes is what the models build and compress to (fails when a preset changes)."""
    from crowdtrain.testbed.swarm import MODEL_22M

    for name, preset, overrides in (("paper", "paper", {}), ("testbed", "demo", MODEL_22M), ("demo", "demo", {})):
        params, wire = analysis.gradient_wire_bytes(json.dumps(overrides, sort_keys=True), preset, 2**16)
        assert (rm.MODELS[name].params, rm.MODELS[name].wire_bytes) == (params, wire), name


def test_the_model_reproduces_the_testbed_rows():
    """Every stored testbed row within 20% in round time, and its bytes within 5% of the framing."""
    data = json.loads(FIXTURE.read_text())
    assert len(data["rows"]) >= 5
    for r in data["rows"]:
        n = r["peers"]
        predicted = rm.round_time_s(n, r["wire_bytes"], r["rate_bps"], cores=data["cores"],
                                    step_share=data["step_compute_s"] / r["step_s"])
        assert abs(r["round_s"] / predicted - 1) <= 0.20, (r["name"], r["round_s"], predicted)
        assert r["floor_s"] == pytest.approx(rm.link_floor_s(n, r["wire_bytes"], r["rate_bps"]), rel=0.02)
        if r["rate_bps"] <= 1e8:  # at 1 Gbit/s the round is too short for the 0.2 s byte counters
            assert r["bytes_ratio"] == pytest.approx(rm.FRAMING, rel=0.05), r["name"]


def test_swarm_costs_name_what_breaks_and_settings_relieve_it():
    base = rm.swarm_costs(rm.Swarm(peers=1000, rate_bps=1e7, group=32))
    assert base["group"] == 32 and base["mixing_rounds"] == 2
    assert base["first_to_break"] == max(base["loads"], key=base["loads"].get)
    assert base["loads"]["gradient round / epoch"] > 1  # the paper's 4096 at 1,000 peers: 4 s epochs
    bigger = rm.swarm_costs(rm.Swarm(peers=1000, rate_bps=1e7, group=32, target_batch_size=4096 * 32))
    assert bigger["loads"]["gradient round / epoch"] == pytest.approx(base["loads"]["gradient round / epoch"] / 32)
    longer = rm.swarm_costs(rm.Swarm(peers=1000, rate_bps=1e7, group=32, token_lifetime_s=3600))
    assert longer["http_requests_per_s"] < base["http_requests_per_s"]
    # What scales with N outside the all-reduce: the progress key's readers and the HTTP load.
    small = rm.swarm_costs(rm.Swarm(peers=100, rate_bps=1e7, group=32))
    assert base["progress_replica_bps"] == pytest.approx(100 * small["progress_replica_bps"])
    assert base["http_requests_per_s"] > small["http_requests_per_s"]
    assert small["round_s"] == pytest.approx(base["round_s"])  # same group, same round
    with pytest.raises(ValueError, match="group >= 2"):
        rm.Swarm(peers=10, rate_bps=1e7, group=1)
    with pytest.raises(ValueError, match="unknown model"):
        rm.Swarm(peers=10, rate_bps=1e7, model="nope")


def test_recommended_settings_bring_100_peers_under_every_limit():
    for rate in (1e7, 1e8):
        defaults = rm.swarm_costs(rm.Swarm(peers=100, rate_bps=rate))
        r = rm.recommend(100, rate)
        c, st = r["costs"], r["settings"]
        assert r["still_over"] == {}, (rate, r["still_over"])
        assert c["epoch_s"] >= 1.5 * max(c["round_s"], c["state_download_s"]) * 0.999
        assert st["averaging_timeout_s"] >= 2 * c["round_s"]
        assert st["target_batch_size"] & (st["target_batch_size"] - 1) == 0  # a power of two
        if rate == 1e7:  # the paper's defaults break at 10 Mbit/s: 4096 samples last 41 s, a round 209 s
            assert defaults["loads"]["gradient round / epoch"] > 1
            assert defaults["loads"]["round / averaging_timeout_s"] > 1


def test_at_1000_peers_the_hot_dht_keys_need_more_than_settings():
    on_volunteers = rm.recommend(1000, 1e7)
    assert {"progress key: a replica's uplink", "group key in matchmaking: a replica's uplink"} <= set(
        on_volunteers["still_over"])
    # The same records on 1 Gbit/s DHT servers fit.
    on_servers = rm.recommend(1000, 1e7, dht_server_rate_bps=1e9)
    assert on_servers["still_over"] == {}
    assert on_servers["costs"]["loads"]["progress key: a replica's uplink"] < 0.5
