"""What `crowdtrain join` picks when not told (crowdtrain.swarm.machine): the device, a batch size
sized for the run's model from the memory free, and a fair share of the cores among the
volunteers on one machine. In-process and deterministic: CUDA, memory sizes, other volunteers
and the clock are given, never read from this machine."""

import json
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from crowdtrain.memcalc import estimate
from crowdtrain.memcalc.architectures import crowdtrain_param_count
from crowdtrain.memcalc.calibrate import count_model, model_architecture
from crowdtrain.model.config import get_preset
from crowdtrain.runspec.swarm import SwarmConfig, demo_swarm_config
from crowdtrain.swarm import machine
from crowdtrain.swarm.machine import (GIB, SAFETY_FRACTION, TorchThreads, Volunteer, VolunteerRegistry, batch_cap,
                                      estimated_bytes, fair_share, memcalc_options, resolve_device,
                                      suggest_batch_size)
from crowdtrain.swarm.peer import VolunteerConfig

PRESETS = ("tiny", "demo", "paper")
MEMORY_GIB = (1, 2, 3, 4, 6, 8, 12, 16, 24, 40, 80)


# ---- device -----------------------------------------------------------------------------------
def fake_cuda(monkeypatch, *, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=f"Fake GPU {i}", total_memory=int(79.2 * GIB)))


def test_auto_trains_on_the_gpu_torch_sees_and_says_which(monkeypatch):
    fake_cuda(monkeypatch, count=2)
    device, line = resolve_device("auto")
    assert device == "cuda:0"
    assert line.startswith("training on cuda:0 (Fake GPU 0, 79.2 GiB)") and "--device cuda:N" in line, line
    assert resolve_device("cuda") == ("cuda:0", "training on cuda:0 (Fake GPU 0, 79.2 GiB)")
    assert resolve_device("cuda:1")[0] == "cuda:1"
    assert resolve_device("cpu") == ("cpu", "training on the CPU (--device cpu)")  # a GPU there, the CPU asked for
    with pytest.raises(ValueError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_auto_falls_back_to_the_cpu_and_says_why(monkeypatch):
    fake_cuda(monkeypatch, count=0)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert resolve_device("auto") == ("cpu", "training on the CPU: torch sees no CUDA device: this torch is a "
                                             "CPU-only build (install a CUDA build of torch to use a GPU)")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    device, line = resolve_device("auto")
    assert device == "cpu" and "torch sees no CUDA device: no GPU here, or its driver is not loaded" in line
    # An explicit GPU that is not there is refused with the fix, as before `auto` existed.
    for asked in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=f"--device {asked} was given but torch sees no CUDA device; "
                                             "use --device cpu"):
            resolve_device(asked)


def test_device_batch_and_precision_flags_are_checked_when_given():
    config = VolunteerConfig("http://c")
    assert (config.device, config.batch_size, config.torch_threads) == ("auto", "auto", None)
    for bad in (dict(device="gpu"), dict(device="cuda:x"), dict(batch_size=0), dict(batch_size="big"),
                dict(batch_size=2.5), dict(torch_threads=0), dict(precision="fp8"), dict(shuffle_buffer=0),
                dict(shuffle_buffer=1.5)):
        with pytest.raises(ValueError, match="--device|--batch-size|--threads|--precision|--shuffle-buffer"):
            VolunteerConfig("http://c", **bad)
    from crowdtrain.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["join", "http://c", *a])
    assert (parse().batch_size, parse().device, parse().threads) == ("auto", "auto", None)
    assert parse("--batch-size", "8").batch_size == 8 and parse("--batch-size", "auto").batch_size == "auto"
    with pytest.raises(SystemExit):
        parse("--batch-size", "0")


# ---- batch size -------------------------------------------------------------------------------
def suggest(preset: str, memory_gib: float | None, *, device_type: str = "cuda", swarm=None, **kwargs):
    return suggest_batch_size(get_preset(preset, **kwargs), swarm or SwarmConfig(), device_type=device_type,
                              memory_bytes=None if memory_gib is None else int(memory_gib * GIB),
                              memory_name="free on cuda:0" if device_type == "cuda" else "of available RAM",
                              memcalc_url="http://c/memcalc/")


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_batch_is_the_largest_power_of_two_that_fits_and_grows_with_memory(preset, device_type):
    swarm, model = SwarmConfig(), get_preset(preset)
    arch = model_architecture(model)
    cap, _ = batch_cap(swarm, device_type)
    previous = 0
    for gib in MEMORY_GIB:
        try:
            choice = suggest(preset, gib, device_type=device_type)
        except ValueError:
            assert previous == 0, f"{gib} GiB refused where less memory trained"
            continue
        b, budget = choice.batch_size, SAFETY_FRACTION * gib * GIB
        assert b >= previous and 1 <= b <= cap and b & (b - 1) == 0, (gib, b)
        need = lambda batch: estimated_bytes(arch, swarm, model, batch_size=batch, device_type=device_type)
        assert need(b) <= budget
        assert b == cap or need(2 * b) > budget, (gib, b)
        previous = b
    assert previous == cap, "the largest memory reaches the cap"


def test_the_paper_preset_is_sized_by_memory_between_the_extremes():
    """The checks above must see the memory, not only the cap: the paper preset's batch moves
    with the GPU's memory, and its estimate is the calculator's for the run's settings."""
    batches = [suggest("paper", gib).batch_size for gib in (2, 4, 8, 80)]
    assert batches[0] < batches[1] < batches[2] < batches[3] == 64, batches
    model, swarm = get_preset("paper"), SwarmConfig()
    on_gpu = estimate(model_architecture(model), memcalc_options(swarm, model, device_type="cuda", batch_size=8))
    params = on_gpu.unique_params
    # The GPU holds the calculator's GPU part plus hivemind's fp32 gradient accumulators.
    assert estimated_bytes(model_architecture(model), swarm, model, batch_size=8, device_type="cuda") \
        == on_gpu.gpu_total + 4 * params
    # On a CPU the host's part lives in the same RAM, and the batch is smaller for it.
    assert estimated_bytes(model_architecture(model), swarm, model, batch_size=8, device_type="cpu") \
        > on_gpu.gpu_total + on_gpu.cpu_total
    assert suggest("paper", 4, device_type="cpu").batch_size < suggest("paper", 4).batch_size


def test_the_volunteer_sizes_with_the_options_the_runs_memcalc_page_opens_with(tmp_path):
    from crowdtrain.coordinator.service import _memcalc_run

    cases = [("paper", SwarmConfig()), ("demo", SwarmConfig(offload_optimizer=False)),
             ("demo", SwarmConfig(mode="diloco")), ("tiny", SwarmConfig(mode="diloco", inner_optimizer="lamb8bit"))]
    for preset, swarm in cases:
        model = get_preset(preset, checkpointing=preset == "demo")
        (tmp_path / "coordinator.json").write_text(json.dumps(
            {"preset": preset, "task": {"model": model.to_dict()}, "swarm": swarm.to_dict()}))
        page = _memcalc_run(tmp_path)["defaults"]
        options = memcalc_options(swarm, model, device_type="cuda")
        assert {k: getattr(options, k) for k in ("optimizer", "offload", "reversible", "checkpointing")} \
            == {k: page[k] for k in ("optimizer", "offload", "reversible", "checkpointing")}, (preset, swarm.mode)


def test_caps_cpu_gpu_target_batch_and_diloco():
    assert suggest("tiny", 80, device_type="cpu").batch_size == 16
    assert suggest("tiny", 80).batch_size == 64
    assert suggest("tiny", 80, swarm=SwarmConfig(target_batch_size=48)).batch_size == 32
    assert suggest("tiny", 80, swarm=SwarmConfig(mode="diloco")).batch_size == 16
    unknown = suggest("tiny", None, device_type="cpu")
    assert unknown.batch_size == 16 and "not checked against memory" in unknown.message
    at_cap = suggest("demo", 80)
    assert at_cap.message.startswith("batch size 64 (the most auto picks on a GPU)") and "--batch-size N" in \
        at_cap.message
    by_memory = suggest("paper", 8)
    assert f"{2 * by_memory.batch_size} would need" in by_memory.message and "--batch-size N" in by_memory.message


def test_a_model_that_does_not_fit_at_batch_1_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"needs about .* GiB to train at batch size 1 .* join a run with a smaller "
                                         r"model, or use a GPU with more memory \(sizes: http://c/memcalc/\)"):
        suggest("paper", 1)
    with pytest.raises(ValueError, match="smaller model, or use a machine with more free memory"):
        suggest("paper", 1, device_type="cpu")


def test_a_tuned_preset_is_counted_from_its_own_config():
    """A run's model is often a preset tuned by the coordinator (its tokenizer's vocabulary):
    counted on the meta device, never mistaken for the preset."""
    assert model_architecture(get_preset("paper", reversible=False)).name == "crowdtrain-paper"
    tuned = get_preset("tiny", width=96, image_vocab_size=512)
    arch = model_architecture(tuned)
    assert arch.name == "crowdtrain-run" and arch.params().numel == crowdtrain_param_count(tuned)
    # The meta device's counts are an upper bound of the real ones (presets.json's, counted on a CPU).
    real, meta = model_architecture(get_preset("tiny")).preset, count_model(get_preset("tiny"), device="meta")
    for nbytes in ("4", "2"):
        assert meta["head_bytes"][nbytes] >= real["head_bytes"][nbytes]
        for pattern, counted in real["layer_bytes"].items():
            assert meta["layer_bytes"][pattern][nbytes] >= counted[nbytes], (pattern, nbytes)
    assert suggest_batch_size(tuned, demo_swarm_config("t"), device_type="cpu", memory_bytes=8 * GIB).batch_size == 16


# ---- threads ----------------------------------------------------------------------------------
@pytest.fixture
def others():
    """A live process that is not this one, and the pid of one that has ended."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        yield types.SimpleNamespace(alive=alive.pid, ended=ended.pid)
    finally:
        alive.kill()
        alive.wait()


def test_the_registry_counts_live_volunteers_and_removes_the_rest(tmp_path, others):
    assert machine.process_start_time(os.getpid()) is not None, "this test needs /proc"
    registry = VolunteerRegistry(tmp_path)
    me = registry.add(os.getpid())
    other = registry.add(others.alive, threads=2)
    registry.add(others.ended)  # killed without leaving: its file stays
    registry.add(os.getppid(), start=1)  # a pid now taken by another process than the one that registered
    (tmp_path / "junk.json").write_text("{")
    (tmp_path / "77.json").write_text(json.dumps({"pid": 78, "start": None, "threads": None}))
    assert sorted(registry.live(), key=lambda v: v.pid) == sorted([me, other], key=lambda v: v.pid)
    left = {p.name for p in tmp_path.iterdir()}
    assert f"{others.ended}.json" not in left and f"{os.getppid()}.json" not in left
    assert {f"{os.getpid()}.json", f"{others.alive}.json"} <= left
    registry.remove(os.getpid())
    assert [v.pid for v in registry.live()] == [others.alive]


def test_fair_share_splits_the_cores_left_by_fixed_volunteers():
    auto = lambda pid: Volunteer(pid, None, None)
    assert fair_share(4, [], me=1) == (4, "4 cores, no other volunteer on this machine")
    assert fair_share(4, [auto(1), auto(2)], me=1) == (2, "4 cores shared by 2 volunteers on this machine")
    assert fair_share(4, [auto(1), Volunteer(2, None, 1)], me=1)[0] == 3
    assert fair_share(2, [auto(1), auto(2), auto(3)], me=1)[0] == 1
    assert fair_share(2, [Volunteer(2, None, 4)], me=1)[0] == 1  # never below one


def test_threads_start_with_a_fair_share_and_rebalance_when_a_volunteer_arrives(tmp_path, others, caplog):
    now = [0.0]
    calls: list[int] = []
    threads = TorchThreads(None, tmp_path, cores=4, set_threads=calls.append, clock=lambda: now[0])
    VolunteerRegistry(tmp_path).add(others.ended)
    with caplog.at_level(logging.INFO, logger="crowdtrain.swarm.machine"):
        assert threads.start() == 4 and calls == [4]  # the ended volunteer does not count
        assert "4 torch threads: 4 cores, no other volunteer on this machine; --threads N to choose" in caplog.text
        newcomer = TorchThreads(None, tmp_path, cores=4, pid=others.alive, set_threads=lambda n: None)
        assert newcomer.start() == 2
        assert threads.rebalance() is None, "not before the period"
        now[0] = 31.0
        assert threads.rebalance() == 2 and calls == [4, 2]
        assert "torch threads 4 -> 2: 4 cores shared by 2 volunteers on this machine" in caplog.text
        newcomer.leave()
        now[0] = 62.0
        assert threads.rebalance() == 4 and calls == [4, 2, 4]
    threads.leave()
    assert list(tmp_path.glob("*.json")) == []


def test_fixed_threads_are_kept_and_left_to_their_volunteer(tmp_path, others):
    calls: list[int] = []
    fixed = TorchThreads(1, tmp_path, cores=4, pid=others.alive, set_threads=calls.append)
    assert fixed.start() == 1 and calls == [1]
    fixed.next_check = -1.0
    assert fixed.rebalance() is None and calls == [1]
    assert TorchThreads(None, tmp_path, cores=4, set_threads=lambda n: None).start() == 3
