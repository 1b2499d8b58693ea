"""User names: what a volunteer may call itself, checked by the coordinator and, before any slow
start-up, by ``crowdtrain join``."""

USER_NAME_RULE = "1-64 ASCII letters, digits, '-', '_' or '.'"


def valid_user_name(name: str) -> bool:
    """ASCII only: a name that looks like another user's (Cyrillic 'а' for Latin 'a') must not pass."""
    return 1 <= len(name) <= 64 and name.isascii() and all(c.isalnum() or c in "-_." for c in name)
