"""A volunteer finds the run's first DHT peer again after the coordinator restarts.

hivemind drops a DHT peer that stops answering from its routing table and never bootstraps
again (``DHTNode.create`` pings the initial peers once). A volunteer whose routing table held only
the coordinator's auxiliary peer is then alone for good after a coordinator restart: it trains on
its own while the restarted coordinator shows 0 peers. The restarted coordinator dials the
volunteers it knows, but nobody can dial a client-mode volunteer (behind NAT), and a lone
volunteer's address may be stale. So every volunteer checks, every ``every_s``, that the run's
bootstrap peers are in its routing table, and pings each one that is not: a ping that is answered
puts the peer back (hivemind's own bootstrap step), and the swarm's records, rounds and state
downloads find each other again. The check is local and costs nothing while the coordinator is
known; while it is down, one failed ping per bootstrap peer per ``every_s``.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import threading

from hivemind.p2p import PeerID

from crowdtrain.swarm.hivemind_seam.p2p import dial

logger = logging.getLogger(__name__)


def bootstrap_peers(initial_peers: list[str]) -> dict[str, list[str]]:
    """Peer id (base58) -> its multiaddrs, from a list of multiaddrs ending in ``/p2p/ID``."""
    peers: dict[str, list[str]] = {}
    for maddr in initial_peers:
        _, sep, peer_id = str(maddr).rpartition("/p2p/")
        if sep and peer_id:
            peers.setdefault(peer_id, []).append(str(maddr))
    return peers


# The ranges libp2p's DHT counts as a local network (go-multiaddr's private ranges, loopback
# included). Its dual DHT keeps a peer in its LAN routing table only if it is connected to it
# through one of these, and in its WAN table only through a global address.
_LAN_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8",
    "fc00::/7", "fe80::/10", "::1/128"))


def _ip_of(maddr: str) -> str | None:
    parts = str(maddr).split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def libp2p_routes_through(ip: str) -> bool:
    """Whether libp2p's DHT keeps a peer reached at ``ip`` in a routing table: a local-network or
    loopback address (its LAN table) or a global one (its WAN table). The special-purpose ranges
    in between (the documentation nets 192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, the
    benchmarking net 198.18.0.0/15, ...) are in neither: a peer connected to the swarm only
    through such an address can talk to that peer, but cannot look up any other peer's address,
    so every groupmate it dials fails with "routing: not found"."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return address.is_global or any(address in net for net in _LAN_NETWORKS)


def _is_loopback(ip: str | None) -> bool:
    try:
        return ip is not None and ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def _resolve(host: str | None) -> set[str]:
    if not host:
        return set()
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def choose_bootstrap_peers(initial_peers: list[str], coordinator_host: str | None) -> list[str]:
    """The coordinator's DHT addresses to join through, out of all it listens on.

    A coordinator listening on every interface (the default ``--dht-host 0.0.0.0``) lists one
    address per interface, and the p2p daemon dials them all at once: whichever answers first
    carries the connection. Through an address libp2p's DHT does not route
    (:func:`libp2p_routes_through`), the volunteer cannot find any other peer's address, and
    its averaging rounds never form (on a machine whose network address is 192.0.2.2, two
    volunteers typed at the shell failed every round in about half of the runs). So: the
    addresses libp2p routes through, and of those the ones at the host this volunteer reached
    the coordinator by (``coordinator_host``, the join URL's); loopback ones only when that host
    is loopback itself (elsewhere they are the volunteer's own machine). Where libp2p routes
    through none of them, those at that host (or all), with a warning that names the fix."""
    hosts = _resolve(coordinator_host)
    local = bool(hosts) and all(map(_is_loopback, hosts))
    candidates = [m for m in initial_peers if local or not _is_loopback(_ip_of(m))] or list(initial_peers)
    routable = [m for m in candidates if _ip_of(m) is None or libp2p_routes_through(_ip_of(m))]
    chosen = ([m for m in routable if _ip_of(m) in hosts] or routable
              or [m for m in candidates if _ip_of(m) in hosts] or candidates)
    if not routable:
        logger.warning("the coordinator's DHT addresses (%s) are all in ranges libp2p does not route through: "
                       "volunteers will reach the coordinator but not each other. Start the coordinator with "
                       "--dht-host and --public-host set to an address of a local network or a public one",
                       ", ".join(sorted({_ip_of(m) or m for m in candidates})))
    return chosen


async def _ping_missing(dht, node, peers: dict[str, list[str]]) -> list[str]:
    """In the DHT process: ping every bootstrap peer absent from the routing table; the ids that answered."""
    from hivemind.utils.multiaddr import Multiaddr

    back = []
    for text, maddrs in peers.items():
        peer_id = PeerID.from_base58(text)
        if peer_id in node.protocol.routing_table:
            continue
        if await node.protocol.call_ping(peer_id) is None:
            # The p2p daemon forgets a peer's address some minutes after the connection closed: dial
            # the address we were given, then ask again. hivemind has no public call for this; its
            # own bootstrap passes the addresses to the daemon at start (`P2P.create`).
            try:
                # The daemon takes transport addresses: without the trailing /p2p/ID.
                transports = [Multiaddr(m.rpartition("/p2p/")[0]) for m in maddrs]
                await dial(node.protocol.p2p, peer_id, transports)
            except Exception as e:  # still down
                logger.debug("cannot dial %s: %r", text, e)
                continue
            if await node.protocol.call_ping(peer_id) is None:
                continue
        back.append(text)  # the answered ping put it in the routing table
    return back


class BootstrapWatch(threading.Thread):
    """Re-adds the run's bootstrap peers to this peer's DHT routing table when they come back."""

    def __init__(self, dht, initial_peers: list[str], every_s: float = 15.0):
        super().__init__(name="bootstrap-watch", daemon=True)
        self.dht, self.every_s = dht, every_s
        self.peers = bootstrap_peers(initial_peers)
        self.stop = threading.Event()
        self.reconnects = 0

    def check(self) -> list[str]:
        """Ping the missing bootstrap peers now; the ids that answered (and are known again)."""
        # Runs in the DHT's process: the call is pickled, hence a partial of a module-level function.
        back = self.dht.run_coroutine(functools.partial(_ping_missing, peers=self.peers))
        for peer_id in back:
            self.reconnects += 1
            logger.info("found the run's DHT peer %s again (the coordinator restarted or the network came back)",
                        peer_id[-8:])
        return back

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.check()
            except Exception as e:  # the DHT is shutting down, or a transient error: try again later
                logger.debug("bootstrap check failed: %r", e)
