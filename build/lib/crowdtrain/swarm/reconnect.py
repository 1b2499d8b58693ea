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
import logging
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
