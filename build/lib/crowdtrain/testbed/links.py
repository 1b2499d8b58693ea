"""Link rates: what a home connection looks like to the testbed.

A link is an upload and a download rate. Written ``100mbit`` (both ways), or ``UP/DOWN`` such
as ``10mbit/50mbit`` (a home line that uploads at 10 and downloads at 50 Mbit/s). Units: bit,
kbit, mbit, gbit (per second, decimal, as ``tc`` reads them); a bare number is Mbit/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float:
    """Bits per second from ``100mbit``, ``1gbit``, ``500kbit`` or ``100`` (Mbit/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in ("", *_UNITS):
        raise ValueError(f"a rate is a number with a unit (bit, kbit, mbit, gbit), e.g. 100mbit; got {text!r}")
    value = float(m.group(1)) * (_UNITS[m.group(2)] if m.group(2) else 1e6)
    if value < 1e5:
        raise ValueError(f"rate {text!r} is below 100kbit: the swarm cannot work on such a link")
    return value


@dataclass(frozen=True)
class LinkSpec:
    up_bps: float  # bits/s the node can send
    down_bps: float  # bits/s the node can receive

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """``100mbit`` (symmetric) or ``UP/DOWN``, e.g. ``10mbit/50mbit``."""
        parts = text.split("/")
        if len(parts) == 1:
            return cls(parse_rate(parts[0]), parse_rate(parts[0]))
        if len(parts) == 2:
            return cls(parse_rate(parts[0]), parse_rate(parts[1]))
        raise ValueError(f"a link is RATE or UP/DOWN, e.g. 100mbit or 10mbit/50mbit; got {text!r}")

    def __str__(self) -> str:
        if self.up_bps == self.down_bps:
            return format_rate(self.up_bps)
        return f"{format_rate(self.up_bps)}/{format_rate(self.down_bps)}"


def format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def tbf_args(rate_bps: float, *, queue_ms: float = 50.0) -> list[str]:
    """Arguments of ``tc qdisc ... tbf`` for one direction of a link.

    The bucket holds at least 16 KiB or 2 ms at the rate (tbf uses high-resolution timers, so a
    small bucket still gives the exact rate; a large one would let bursts through at line rate).
    ``queue_ms`` is how long a packet may wait before it is dropped: the buffer of a home router.
    """
    rate_bytes = rate_bps / 8
    burst = max(16 * 1024, int(rate_bytes * 0.002))
    return ["rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", f"{queue_ms:g}ms"]
