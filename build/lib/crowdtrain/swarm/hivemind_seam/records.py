"""The layouts of hivemind's DHT records that crowdtrain reads: state offers and progress
records. Importing this module does not import hivemind."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def state_offers_key(prefix: str) -> str:
    """The DHT key under which hivemind's averagers of ``prefix`` offer their state: a dict of
    peer ID -> state sharing priority (``DecentralizedAverager._declare_for_download_periodically``)."""
    return f"{prefix}.all_averagers"


def progress_records(tracker) -> list[dict] | None:
    """Every peer's progress record (hivemind's ProgressTracker) read from the DHT now, malformed
    ones left out; None if the DHT does not answer. A peer that left cleanly has erased its own."""
    try:
        found = tracker.dht.get(tracker.training_progress_key, latest=True)
    except Exception as e:  # the DHT is busy
        logger.debug("could not read the swarm's progress: %r", e)
        return None
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return [v.value for v in entries.values()
            if isinstance(getattr(v, "value", None), dict) and isinstance(v.value.get("epoch"), int)]
