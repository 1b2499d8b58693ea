"""``target_group_size``: averaging in groups smaller than the swarm (docs/road-to-a-thousand.md)."""

import dataclasses

import pytest
import torch

from crowdtrain.runspec.swarm import PEER_LOCAL_SETTINGS, SwarmConfig, demo_swarm_config


def test_target_group_size_is_validated():
    assert SwarmConfig().target_group_size is None  # the whole swarm, as before
    assert SwarmConfig(target_group_size=32).target_group_size == 32
    assert SwarmConfig.from_dict(SwarmConfig(target_group_size=16).to_dict()).target_group_size == 16
    for bad in (1, 0, -4, 2.5, True, "32"):
        with pytest.raises(ValueError, match="target_group_size"):
            SwarmConfig(target_group_size=bad)
    # Robust aggregation's groups of three at least.
    with pytest.raises(ValueError, match=">= 3"):
        SwarmConfig(aggregation="centered_clip", target_group_size=2)
    assert "target_group_size" in PEER_LOCAL_SETTINGS  # an organizer may change it on a restart


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_every_averager_gets_the_target_group_size(mode):
    import hivemind

    from crowdtrain.swarm.optimizer import build_optimizer

    dht = hivemind.DHT(start=True)
    config = dataclasses.replace(demo_swarm_config(f"groups-{mode}"), mode=mode, target_group_size=16)
    opt = build_optimizer(dht, torch.nn.Linear(4, 4), config, batch_size=4)
    try:
        averagers = [opt.averager] if mode == "diloco" else [opt.grad_averager, opt.state_averager]
        for averager in averagers:
            assert averager.matchmaking_kwargs["target_group_size"] == 16
    finally:
        opt.shutdown()
        dht.shutdown()
