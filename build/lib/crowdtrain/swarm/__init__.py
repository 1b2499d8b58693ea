"""Everything that talks to hivemind: the swarm optimizer, volunteers, the auxiliary peer."""
