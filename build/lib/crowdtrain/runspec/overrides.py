"""``--model KEY=VALUE`` and ``--swarm KEY=VALUE`` settings, shared by every command that takes them."""

import json


def parse_overrides(pairs: list[str] | None, *, flag: str) -> dict:
    """KEY=VALUE pairs; values are JSON when they parse as JSON (numbers, true/false, lists)."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"{flag} takes KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
