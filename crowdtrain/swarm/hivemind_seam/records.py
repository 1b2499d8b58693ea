"""The layouts of hivemind's DHT records that crowdtrain reads: state offers and progress
records. Importing this module does not import hivemind."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


# How long a read of the DHT may take before the caller goes on without it. A read asks the DHT
# process through a pipe, and hivemind's blocking get waits for its answer without a bound: when
# that process is gone (killed, the OOM killer) a training loop waited forever, even on SIGTERM.
# Reads take well under a second on a healthy DHT; a busy machine's take a few.
DHT_READ_TIMEOUT_S = 20.0


def read_latest(dht, key: str, timeout_s: float | None = None):
    """``dht.get(key, latest=True)`` that raises TimeoutError after ``timeout_s`` (default
    ``DHT_READ_TIMEOUT_S``)."""
    return dht.get(key, latest=True, return_future=True).result(
        timeout=DHT_READ_TIMEOUT_S if timeout_s is None else timeout_s)


def state_offers_key(prefix: str) -> str:
    """The DHT key under which hivemind's averagers of ``prefix`` offer their state: a dict of
    peer ID -> state sharing priority (``DecentralizedAverager._declare_for_download_periodically``)."""
    return f"{prefix}.all_averagers"


def progress_records(tracker) -> list[dict] | None:
    """Every peer's progress record (hivemind's ProgressTracker) read from the DHT now, malformed
    ones left out; None if the DHT does not answer. A peer that left cleanly has erased its own."""
    try:
        found = read_latest(tracker.dht, tracker.training_progress_key)
    except Exception as e:  # the DHT is busy
        logger.debug("could not read the swarm's progress: %r", e)
        return None
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return [v.value for v in entries.values()
            if isinstance(getattr(v, "value", None), dict) and isinstance(v.value.get("epoch"), int)]
