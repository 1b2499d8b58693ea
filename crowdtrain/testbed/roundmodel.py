"""What a gradient round costs as the swarm grows: a model on paper, checked against the testbed.

Pure arithmetic (no torch, no hivemind), so an organizer can size a run before starting one:
``python benchmarks/bench_round_model.py`` prints the check against the testbed and the table for
the ``paper`` preset; docs/road-to-a-thousand.md derives and discusses every term.

**Bytes.** A butterfly all-reduce in a group of G peers, each holding one compressed copy of the
gradients of ``wire_bytes``: every peer sends the (G-1)/G of its copy that others reduce and the
averaged 1/G it reduced back to the G-1 others, so ``2 (G-1)/G x wire_bytes`` up and as many down.
On the wire that is ``FRAMING`` times more (protobuf framing, TCP/IP headers: measured by the
testbed's byte counters). Peers in client mode (behind NAT) reduce nothing: they send their whole
copy to the S peers that do and get the whole average back, and those S servers carry the rest.

**Time.** A round moves that volume through the slowest link of the group and spends CPU on
encoding, decoding and reducing it (``CPU_S_PER_WIRE_BYTE``, per peer). The two overlap in part
(a peer sends part i while encoding part i+1): ``max(link, cpu) + min(link, cpu) / OVERLAP``.
On top come ``LATENCY_RTTS`` round trips (the group's start message, the first part's way there
and back, the closing of the streams), unmeasured here: the testbed has no added latency.

**Shared cores (the testbed only).** On the testbed every peer shares the machine's cores, so the
round's CPU is that of all G peers over the cores left after the peers' background work (their
padded steps' real computation, their DHT, daemons and trackers: ``BACKGROUND_CORES_PER_PEER``
plus ``step_compute_s / step_s`` per peer). A real swarm has a machine per peer: ``cores=None``.

**Fitted and derived.** Fitted to the stored testbed rows (``FIT_ROWS``; N = 2, 4, 8 at
100 Mbit/s, N = 2 at 10 Mbit/s, the N = 4 control at 1 Gbit/s): ``FRAMING`` (their median
bytes ratio), ``CPU_S_PER_WIRE_BYTE``, ``OVERLAP`` and ``BACKGROUND_CORES_PER_PEER`` (least
squares of log round time, ``bench_round_model.py --fit``). Derived from the code: the
butterfly volume, the gradients' wire bytes (``crowdtrain.swarm.compression.wire_bytes``), the
periods of the DHT and HTTP traffic. Measured: the signed DHT records' sizes
(``--record-sizes``). Assumed (not measured on this testbed):
``LATENCY_RTTS``, per-hop DHT round trips, ``STATE_BYTES_PER_PARAM`` (from the churn row), the
coordinator's CPU per request (``bench_coordinator_load`` on this 2-core machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ---- fitted to the testbed (docs/road-to-a-thousand.md, "Fitting") ------------------------------
FRAMING = 1.065  # bytes on the link / butterfly payload: median of the 100 Mbit/s rows (1.053-1.088)
CPU_S_PER_WIRE_BYTE = 1.6e-8  # one peer's core-seconds per wire byte of its gradient copy, per round
OVERLAP = 2.5  # the shorter of link time and CPU time is hidden but for 1/OVERLAP of it
BACKGROUND_CORES_PER_PEER = 0.09  # a peer's idle load: DHT, p2p daemon, progress tracker, metrics
FIT_ROWS = ("r100-n2", "r100-n4", "r100-n8", "r10-n2", "r1000-n4")  # the stored 2026-11-24 suite rows

# ---- assumed ------------------------------------------------------------------------------------
LATENCY_RTTS = 4  # round trips per round outside the streaming (start, first part, last answer, close)
STATE_BYTES_PER_PARAM = 4.0  # a newcomer's download: the churn row, 74.6 s at 10 Mbit/s for 22.2M
DHT_BUCKET = 20  # hivemind's k: a lookup's last hop lands in a bucket of this many
COORDINATOR_CPU_MS_PER_REQUEST = 11.0  # bench_coordinator_load, 1,000 volunteers + 200 viewers
COORDINATOR_CORES = 1.0  # one uvicorn process: one core
# Record sizes, measured (msgpack of a signed record as the DHT stores it: the subkey is the
# signer's RSA public key, the value carries its RSA signature, plus the expiration): hivemind's
# progress record, crowdtrain's metrics record plus its round counts (crowdtrain.swarm.metrics).
PROGRESS_RECORD_BYTES = 890
METRICS_RECORD_BYTES = 1950 + 820
GROUP_KEY_RECORD_BYTES = 60  # an averager's declaration: its peer ID, a flag, an expiration (estimated)
DHT_REPLICAS = 5  # hivemind's num_replicas: nodes that store (and answer for) each key

# ---- periods from the code ------------------------------------------------------------------------
JOIN_POLL_S = 15.0  # crowdtrain.swarm.schedule_watch.ScheduleWatch.poll_s
METRICS_PERIOD_S = 5.0  # a peer's metrics record (crowdtrain.swarm.peer)
AUX_REFRESH_S = 2.0  # the auxiliary peer reads every metrics record (crowdtrain.auxpeer.AuxPeer.run)
DASHBOARD_REQUESTS_PER_S = 2 / 5.0  # /api/status and /api/history every 5 s per open dashboard


@dataclass(frozen=True)
class ModelSize:
    params: int
    wire_bytes: int  # one compressed copy of all gradients (8-bit above the threshold, fp16 below)


# From ``crowdtrain.testbed.analysis.gradient_wire_bytes`` (which builds the model on the meta
# device); tests/test_round_model.py checks these against it.
MODELS = {"paper": ModelSize(125_592_576, 126_060_544), "testbed": ModelSize(22_007_808, 22_062_528),
          "demo": ModelSize(1_486_080, 1_869_184)}


def butterfly_fraction(group: int) -> float:
    """Copies of the gradients each peer sends (and receives) in a butterfly all-reduce of ``group``."""
    if group < 1:
        raise ValueError(f"a group has at least one peer, got {group}")
    return 2 * (group - 1) / group


def bytes_per_peer(group: int, wire_bytes: int, *, servers: int | None = None) -> dict:
    """Bytes one peer uploads and downloads per gradient round, on the wire (framing included).

    ``servers``: how many of the group accept connections and reduce a part (None: all). A client
    sends its whole copy and gets the whole average back; a server receives its 1/S part from the
    G-1 others and the S-1 other servers' averaged parts, and sends as much."""
    s = group if servers is None else servers
    if not 1 <= s <= group:
        raise ValueError(f"servers must be between 1 and the group size {group}, got {servers}")
    server = ((group - 1) + (s - 1)) / s * wire_bytes * FRAMING
    client = wire_bytes * FRAMING if group > 1 else 0.0
    return {"server_up": server, "server_down": server, "client_up": client, "client_down": client}


def link_floor_s(group: int, wire_bytes: int, rate_bps: float) -> float:
    """The testbed's floor (``analysis.butterfly_floor_s``): payload volume over the link, no framing."""
    return butterfly_fraction(group) * wire_bytes * 8 / rate_bps


def cpu_s(group: int, wire_bytes: int, *, cores: float | None = None, peers_on_cores: int | None = None,
          step_share: float = 0.0) -> float:
    """Wall seconds of a round's CPU work (encode, decode, reduce). ``cores``: the peers share this
    many cores (the testbed; ``peers_on_cores`` of them, the whole swarm, each busy ``step_share``
    of a core with its own steps); None: each peer has its own."""
    work = CPU_S_PER_WIRE_BYTE * wire_bytes  # per peer
    if cores is None:
        return work
    on = peers_on_cores or group
    free = cores - on * (BACKGROUND_CORES_PER_PEER + step_share)
    free = max(free, 0.1 * cores)  # a starved machine still gives the round a little
    return group * work / min(free, group)


def round_time_s(group: int, wire_bytes: int, rate_bps: float, *, rtt_s: float = 0.0, cores: float | None = None,
                 peers_on_cores: int | None = None, step_share: float = 0.0, servers: int | None = None) -> float:
    """Seconds from the last member's start of a gradient round to its end (what the testbed
    measures), for a group whose slowest link has ``rate_bps`` (both ways)."""
    if rate_bps <= 0:
        raise ValueError(f"rate_bps must be > 0, got {rate_bps}")
    if group <= 1:
        return 0.0
    vol = bytes_per_peer(group, wire_bytes, servers=servers)
    link = max(vol["server_up"], vol["client_up"] if servers not in (None, group) else 0) * 8 / rate_bps
    cpu = cpu_s(group, wire_bytes, cores=cores, peers_on_cores=peers_on_cores, step_share=step_share)
    return max(link, cpu) + min(link, cpu) / OVERLAP + LATENCY_RTTS * rtt_s


def mixing_rounds(peers: int, group: int) -> int:
    """Rounds until every peer's gradients reached every other (Moshpit: groups of G along the
    axes of a G^d grid, d = log_G N): 1 when the group is the swarm."""
    if group >= peers:
        return 1
    if group < 2:
        raise ValueError(f"groups of {group} never mix a swarm of {peers}")
    return math.ceil(math.log(peers) / math.log(group) - 1e-9)


def dht_hops(peers: int) -> int:
    """Round trips of one Kademlia lookup (hivemind's DHT): about log2(N / k) + 1."""
    return 1 + max(0, math.ceil(math.log2(max(peers, 1) / DHT_BUCKET)))


@dataclass(frozen=True)
class Swarm:
    """A run to size: ``peers`` volunteers on ``rate_bps`` links, averaging in groups of ``group``."""

    peers: int
    rate_bps: float
    model: str = "paper"
    group: int | None = None  # None: the whole swarm in one group (crowdtrain refuses smaller ones)
    rtt_s: float = 0.05
    samples_per_s_per_peer: float = 1.0  # the paper preset on a volunteer's GPU (bench_gpu measures it)
    target_batch_size: int = 4096
    matchmaking_time_s: float = 5.0
    averaging_timeout_s: float = 60.0
    token_lifetime_s: float = 600.0
    viewers: int = 50
    client_share: float = 0.0  # share of peers in client mode (no DHT records, no reduction)
    # The links of the peers that are DHT servers (store records): None, the volunteers' own;
    # with slow volunteers in client mode, the coordinator's and the fast peers'.
    dht_server_rate_bps: float | None = None
    cpu_s_per_wire_byte: float = CPU_S_PER_WIRE_BYTE  # per-peer CPU of a round; a faster CPU, lower

    def __post_init__(self):
        if self.peers < 1 or self.rate_bps <= 0 or (self.group is not None and self.group < 2):
            raise ValueError(f"need peers >= 1, rate_bps > 0 and group >= 2 (or None), got {self}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {sorted(MODELS)}")
        if not 0 <= self.client_share < 1:
            raise ValueError(f"client_share must be in [0, 1), got {self.client_share}")


def swarm_costs(s: Swarm) -> dict:
    """Per round and per second: what a run of ``s`` costs its links, its DHT and its coordinator,
    and the share of its capacity each takes (``loads``: 1 or more breaks it; ``first_to_break``
    is the largest)."""
    size = MODELS[s.model]
    g = min(s.group or s.peers, s.peers)
    servers = max(1, round(g * (1 - s.client_share)))
    vol = bytes_per_peer(g, size.wire_bytes, servers=servers)
    link_s = max(vol["server_up"], vol["client_up"] if servers < g else 0.0) * 8 / s.rate_bps
    cpu = s.cpu_s_per_wire_byte * size.wire_bytes
    round_s = (max(link_s, cpu) + min(link_s, cpu) / OVERLAP + LATENCY_RTTS * s.rtt_s) if g > 1 else 0.0
    hops = dht_hops(s.peers)
    # Matchmaking: the averager waits matchmaking_time_s; on top, a declare (store) and the group
    # key's read, each a lookup of `hops` round trips, and one join request per follower.
    matchmaking_s = s.matchmaking_time_s + (2 * hops + 1) * s.rtt_s
    epoch_s = s.target_batch_size / (s.peers * s.samples_per_s_per_peer)
    replica_bps = s.dht_server_rate_bps or s.rate_bps
    # Hot DHT keys: one record per peer under one key, stored on DHT_REPLICAS nodes, and read with
    # latest=True, which asks every node of the key's neighbourhood: each replica sends its whole
    # dictionary to each reader. Bytes per read grow as N, readers as N: N^2 per period.
    # - hivemind's progress tracker: every peer, every refresh (at most max(2 s,
    #   matchmaking_time_s) apart, down to 0.5 s near an epoch's end);
    # - the averagers' group key during matchmaking: every peer, every min(1 s, matchmaking/10)
    #   (crowdtrain's throttle), while it looks for a group;
    # - the metrics key: the auxiliary peer alone, every AUX_REFRESH_S.
    refresh_s = max(2.0, s.matchmaking_time_s)
    progress_dict = s.peers * PROGRESS_RECORD_BYTES
    progress_peer_bps = DHT_REPLICAS * progress_dict * 8 / refresh_s
    progress_replica_bps = s.peers * progress_dict * 8 / refresh_s
    lookup_s = min(1.0, max(0.1, s.matchmaking_time_s / 10))
    group_dict = s.peers * GROUP_KEY_RECORD_BYTES
    group_replica_bps = s.peers * group_dict * 8 / lookup_s
    aux_read_bps = DHT_REPLICAS * s.peers * METRICS_RECORD_BYTES * 8 / AUX_REFRESH_S
    metrics_replica_bps = s.peers * METRICS_RECORD_BYTES * 8 / AUX_REFRESH_S
    http_rps = s.peers / JOIN_POLL_S + s.peers / (s.token_lifetime_s / 4) + s.viewers * DASHBOARD_REQUESTS_PER_S
    http_load = http_rps * COORDINATOR_CPU_MS_PER_REQUEST / 1000 / COORDINATOR_CORES
    state_bytes = STATE_BYTES_PER_PARAM * size.params
    state_s = state_bytes * FRAMING * 8 / s.rate_bps  # one donor's uplink, whole, to one newcomer
    loads = {
        # With delayed updates a round overlaps the next epoch's compute: it must end within it.
        "gradient round / epoch": round_s / epoch_s,
        "round / averaging_timeout_s": round_s / s.averaging_timeout_s,
        "progress key: a replica's uplink": progress_replica_bps / replica_bps,
        "progress reads: a peer's downlink": progress_peer_bps / s.rate_bps,
        "group key in matchmaking: a replica's uplink": group_replica_bps / replica_bps,
        "metrics key: a replica's uplink": metrics_replica_bps / replica_bps,
        "coordinator HTTP: one core": http_load,
        # hivemind lets a peer one epoch behind catch up, not more: a newcomer's download must
        # take less than an epoch, or it downloads again and again.
        "newcomer's state download / epoch": state_s / epoch_s,
    }
    return {"peers": s.peers, "rate_bps": s.rate_bps, "group": g, "servers": servers,
            "mixing_rounds": mixing_rounds(s.peers, g), "up_bytes_per_round": max(vol["server_up"], vol["client_up"]),
            "round_s": round_s, "link_s": link_s, "cpu_s": cpu, "matchmaking_s": matchmaking_s,
            "epoch_s": epoch_s, "dht_hops": hops, "progress_read_bytes": DHT_REPLICAS * progress_dict,
            "progress_peer_bps": progress_peer_bps, "progress_replica_bps": progress_replica_bps,
            "group_replica_bps": group_replica_bps, "aux_read_bps": aux_read_bps,
            "metrics_replica_bps": metrics_replica_bps, "http_requests_per_s": http_rps,
            "state_bytes": state_bytes, "state_download_s": state_s, "loads": loads,
            "first_to_break": max(loads, key=loads.get)}


def recommend(peers: int, rate_bps: float, *, group: int | None = None, dht_server_rate_bps: float | None = None,
              samples_per_s_per_peer: float = 1.0, model: str = "paper", headroom: float = 1.5) -> dict:
    """Settings that keep every load the model knows below 1 where settings can, and the costs
    with them. ``headroom``: how much longer than a round (or a state download) an epoch is.

    - ``target_batch_size``: an epoch ``headroom`` times the gradient round and the newcomer's
      state download (a power of two);
    - ``averaging_timeout_s``: twice the round (crowdtrain.runspec.swarm's rule);
    - ``matchmaking_time_s``: 10 s over the Internet at least, up to 30 s while the progress
      key's replicas are loaded over half (it also sets the progress tracker's refresh period);
    - ``token_lifetime_s``: an hour once the volunteers' token renewals weigh on the coordinator.
    Loads still over 1 with these settings need code, not settings (docs/road-to-a-thousand.md)."""
    base = Swarm(peers=peers, rate_bps=rate_bps, model=model, group=group, dht_server_rate_bps=dht_server_rate_bps,
                 samples_per_s_per_peer=samples_per_s_per_peer)
    first = swarm_costs(base)
    need_s = headroom * max(first["round_s"], first["state_download_s"])
    batch = 2 ** math.ceil(math.log2(max(need_s * peers * samples_per_s_per_peer, 1)))
    replica = dht_server_rate_bps or rate_bps
    matchmaking = 10.0
    while matchmaking < 30 and peers ** 2 * PROGRESS_RECORD_BYTES * 8 / max(2.0, matchmaking) > 0.5 * replica:
        matchmaking += 5.0
    http_share = peers / (600.0 / 4) * COORDINATOR_CPU_MS_PER_REQUEST / 1000
    settings = {"target_batch_size": max(batch, 4096),
                "averaging_timeout_s": max(60.0, math.ceil(2 * first["round_s"])),
                "matchmaking_time_s": matchmaking, "token_lifetime_s": 3600.0 if http_share > 0.05 else 600.0}
    tuned = swarm_costs(Swarm(peers=peers, rate_bps=rate_bps, model=model, group=group,
                              dht_server_rate_bps=dht_server_rate_bps, samples_per_s_per_peer=samples_per_s_per_peer,
                              **settings))
    return {"settings": settings, "costs": tuned, "still_over": {k: v for k, v in tuned["loads"].items() if v >= 1}}
