"""Many volunteers at once (``benchmarks/bench_scale.py`` measures 32): what breaks first as the
swarm grows, kept fixed, and averaging groups smaller than the swarm (refused)."""

from __future__ import annotations

import pytest

from crowdtrain.runspec.swarm import SwarmConfig


@pytest.mark.parametrize("mode", ["sync", "diloco"])
@pytest.mark.parametrize("size", [4, 8])
def test_groups_smaller_than_the_swarm_are_refused_naming_the_reason_and_the_fix(mode, size):
    """hivemind's target_group_size (Moshpit-style groups) would split every round into groups that
    crowdtrain's round records, left-out watch and DiLoCo consistency check read as one round: a
    clear refusal, not an 'upgrade crowdtrain' for a setting it knows."""
    with pytest.raises(ValueError, match=rf"target_group_size={size} .* not supported: .* one group of every live "
                                         r"peer.* target_group_size=0"):
        SwarmConfig.from_dict({"mode": mode, "target_group_size": size})


def test_the_whole_swarm_in_one_group_is_the_default_and_travels_with_the_config():
    config = SwarmConfig()
    assert config.target_group_size == 0
    assert SwarmConfig.from_dict(config.to_dict()) == config
    for bad in (-1, 1):
        with pytest.raises(ValueError, match="must be 0 .* or >= 2"):
            SwarmConfig(target_group_size=bad)
