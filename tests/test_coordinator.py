"""Pure pieces of the swarm and the coordinator's HTTP service (no processes)."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression, Uniform8BitQuantization

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.service import create_app
from crowdtrain.model import DalleTransformer, get_preset
from crowdtrain.optim import param_groups
from crowdtrain.swarm.compression import PaperCompression, Uniform8Bit, wire_bytes
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.checkpoint import flatten_optimizer_state, unflatten_optimizer_state
from crowdtrain.swarm.lamb import make_lamb


def test_compression_is_8bit_for_large_fp16_for_small_and_exact_for_integers():
    from hivemind.compression import TensorRole

    policy = PaperCompression(threshold=2**16)
    choose = lambda t: type(policy.choose_compression(CompressionInfo.from_tensor(t)))
    assert choose(torch.zeros(2**16)) is Uniform8Bit
    assert choose(torch.zeros(2**16 - 1)) is Float16Compression
    assert choose(torch.zeros(2**20, dtype=torch.uint8)) is NoCompression  # 8-bit optimizer codes
    big = torch.randn(2**16)
    restored = policy.extract(policy.compress(big, CompressionInfo.from_tensor(big)))
    # Uniform 8-bit bins span +-3 sigma (outliers clip): typical error is a fraction of a bin.
    assert (restored - big).abs().mean() < 0.02 * big.std()
    # Parameters (state rounds, downloads) always go as fp16: an 8-bit round trip moves weights by
    # one or more optimizer steps' worth.
    param_info = CompressionInfo.from_tensor(big, role=TensorRole.PARAMETER)
    assert type(policy.choose_compression(param_info)) is Float16Compression
    restored = policy.extract(policy.compress(big, param_info))
    assert (restored - big).abs().max() < 1e-3 * big.abs().max()
    codes = torch.randint(0, 255, (2**17,), dtype=torch.uint8)
    assert torch.equal(policy.extract(policy.compress(codes, CompressionInfo.from_tensor(codes))), codes)
    # Bytes on the wire: 1 byte per element (plus a codebook) vs 4 for fp32.
    assert wire_bytes([2**20]) / (4 * 2**20) < 0.26 and wire_bytes([1000]) == 2000


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_8bit_messages_decode_to_hiveminds_values_through_hiveminds_own_entry_point(dtype):
    """crowdtrain's faster 8-bit decoder is the one hivemind's deserializer uses, a message from a
    peer running plain hivemind decodes to the very same values, and such a peer reads ours."""
    from hivemind.compression import deserialize_torch_tensor

    torch.manual_seed(0)
    stock = Uniform8BitQuantization()
    tensor = (torch.randn(3, 70001) * 0.02).to(dtype)
    message = stock.compress(tensor, CompressionInfo.from_tensor(tensor))
    expected = stock.extract(message)
    for decoded in (deserialize_torch_tensor(message), Uniform8Bit().extract(message)):
        assert decoded.dtype == dtype and decoded.shape == tensor.shape and torch.equal(decoded, expected)
    # Our encoder, read by a peer running plain hivemind: as accurate as hivemind's own encoder, and
    # without the deprecated torch.quantize_per_tensor (an error here: warnings are errors below).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = Uniform8Bit().compress(tensor, CompressionInfo.from_tensor(tensor))
    ours_error = (stock.extract(ours).float() - tensor.float()).pow(2).mean()
    assert ours_error <= 1.01 * (expected.float() - tensor.float()).pow(2).mean() and ours_error < 1e-3 * tensor.float().var()
    constant = torch.full((2**16,), 3.0, dtype=dtype)
    assert torch.equal(stock.extract(Uniform8Bit().compress(constant, CompressionInfo.from_tensor(constant))), constant)
    for bad in (float("nan"), float("inf")):  # decodes as non-finite, so reducers drop it
        broken = tensor.clone()
        broken[1, 5] = bad
        assert not torch.isfinite(stock.extract(Uniform8Bit().compress(broken, CompressionInfo.from_tensor(broken)))).any()
    # A codebook shorter than the codes (a malformed or malicious message) is an error, not garbage.
    message.buffer = np.int64(4).tobytes() + np.zeros(4, np.float32).tobytes() + bytes([0, 1, 200] * 10)
    message.ClearField("size")
    message.size.extend([30])
    with pytest.raises(IndexError):
        deserialize_torch_tensor(message)


def test_a_downloaded_lamb8bit_state_steps_exactly_as_the_original():
    """A newcomer's state download: parameters compressed, optimizer statistics exact. Sent as
    fp16, the 8-bit LAMB's second-moment scales (~1e-8) became zero and the next step moved a few
    weights by m / eps (0.1 -> 1.7 in a swarm test)."""
    from hivemind.compression import TensorRole
    from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_, load_optimizer_state

    torch.manual_seed(0)
    config = SwarmConfig()
    policy = PaperCompression(threshold=2**16)
    source, copy = (torch.nn.Parameter(torch.randn(512, 64) * 0.05) for _ in range(2))
    with torch.no_grad():
        copy.copy_(source)
    original, downloaded = make_lamb([source], config), make_lamb([copy], config)
    initialize_optimizer_state_(downloaded)  # as hivemind does, so the state has a structure to load into
    for _ in range(3):
        source.grad = torch.randn_like(source) * 1e-4
        original.step()
    meta, tensors = dump_optimizer_state(original)
    assert min(t.abs().max().item() for t in tensors if t.is_floating_point()) < 1e-7, "scales below fp16's range"
    sent = []
    for t in tensors:
        info = CompressionInfo.from_tensor(t, role=TensorRole.OPTIMIZER)
        sent.append(policy.extract(policy.compress(t, info)))
    load_optimizer_state(downloaded, meta, sent)
    with torch.no_grad():
        copy.copy_(source)
    grad = torch.randn_like(source) * 1e-4
    source.grad, copy.grad = grad, grad.clone()
    original.step()
    downloaded.step()
    assert torch.equal(copy, source)


def test_lamb8bit_state_survives_flattening_for_checkpoints():
    torch.manual_seed(0)
    model = DalleTransformer(get_preset("tiny"))
    config = SwarmConfig()
    optimizer = make_lamb(param_groups(model, config.weight_decay), config)
    model(torch.randint(1, 200, (2, 16)), torch.randint(0, 64, (2, 64))).loss.backward()
    optimizer.step()
    tensors, meta = flatten_optimizer_state(optimizer.state_dict())
    assert any(t.dtype == torch.uint8 for t in tensors.values()), "8-bit states are stored as uint8 codes"
    json.dumps(meta)  # the structure is plain JSON
    restored = unflatten_optimizer_state(tensors, meta)
    fresh = make_lamb(param_groups(model, config.weight_decay), config)
    fresh.load_state_dict(restored)
    for (k, a), (_, b) in zip(sorted(optimizer.state_dict()["state"].items()), sorted(fresh.state_dict()["state"].items())):
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), (k, name)


def test_swarm_config_validates_and_rejects_unknown_settings():
    with pytest.raises(ValueError, match="averaging_timeout_s must exceed"):
        SwarmConfig(matchmaking_time_s=10, averaging_timeout_s=5)
    with pytest.raises(ValueError, match="--run-id"):
        SwarmConfig(run_id="my run!")
    with pytest.raises(ValueError, match="upgrade crowdtrain"):
        SwarmConfig.from_dict({**SwarmConfig().to_dict(), "new_knob": 1})
    assert SwarmConfig.from_dict(SwarmConfig().to_dict()) == SwarmConfig()


@pytest.mark.parametrize("seconds", [0.0, 0.1, 31.0, float("nan")])
def test_a_collect_interval_a_leaving_peers_record_could_outlive_is_refused(seconds):
    from crowdtrain.coordinator.run import CoordinatorConfig

    with pytest.raises(ValueError, match="--collect-every-s must be between 0.2 and 30 s"):
        CoordinatorConfig(run_id="t", data="shapes", run_dir="run", collect_every_s=seconds)
    assert CoordinatorConfig(run_id="t", data="shapes", run_dir="run", collect_every_s=30).collect_every_s == 30


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000005").mkdir(parents=True)
    (run / "checkpoints" / "step-0000005" / "config.json").write_text(json.dumps({"step": 5, "loss": 3.2, "time": 1.0}))
    (run / "checkpoints" / "step-0000005" / "model.safetensors").write_bytes(b"weights")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shards.json").write_text("{}")
    (shards / "train-00000.parquet").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "secret.txt").write_text("not for you")
    return run, shards


def app_for(run, **kwargs):
    run.mkdir(parents=True, exist_ok=True)
    return create_app(run, store=Store(default_url(run)), **kwargs)


def test_service_answers_503_until_the_first_peer_is_up_then_serves_the_run(run_dir):
    run, shards = run_dir
    client = TestClient(app_for(run, shards_dir=shards))
    r = client.get("/api/join")
    assert r.status_code == 503 and "retry" in r.json()["detail"]
    (run / "run.json").write_text(json.dumps({"run_id": "r1", "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]}))
    assert client.get("/api/join").json()["run_id"] == "r1"
    assert client.get("/api/status").json()["epoch"] == 0
    assert client.get("/api/metrics").json() == []
    assert client.get("/api/metrics?limit=0").status_code == 422
    assert client.get("/checkpoints/step-0000005/model.safetensors").content == b"weights"
    assert client.get("/checkpoints/step-0000005/notes.txt").status_code == 404
    assert client.get("/memcalc").status_code == 200, "the memory calculator is part of the run's site"


def test_shards_are_served_with_range_requests_and_no_path_traversal(run_dir):
    run, shards = run_dir
    client = TestClient(app_for(run, shards_dir=shards))
    head = client.head("/shards/train-00000.parquet")
    assert head.status_code == 200 and head.headers["content-length"] == "1024"
    r = client.get("/shards/train-00000.parquet", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == bytes(range(10, 20))
    assert r.headers["content-range"] == "bytes 10-19/1024"
    assert client.get("/shards/../secret.txt").status_code == 404
    assert client.get("/shards/%2e%2e/secret.txt").status_code == 404
    assert client.get("/checkpoints/..%2F..%2Fsecret.txt/config.json").status_code == 404


def test_the_coordinator_side_never_imports_torch():
    code = ("import sys, crowdtrain.coordinator.service, crowdtrain.coordinator.run, crowdtrain.coordinator.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_volunteers_stream_real_shards_from_a_running_coordinator_service(tmp_path):
    """The real loader against the real service over HTTP: what `crowdtrain join` does."""
    import threading
    import time

    import uvicorn

    from crowdtrain.data import batch_stream, default_text_tokenizer, ensure_demo_shards
    from crowdtrain.launch import free_port

    shards = ensure_demo_shards(tmp_path / "shapes", num_train=200)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app_for(tmp_path / "run", shards_dir=shards), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        cfg = get_preset("demo")
        batches = batch_stream(f"http://127.0.0.1:{port}/shards", text_tokenizer=default_text_tokenizer(),
                               model_config=cfg, batch_size=8, seed_key="peer-x")
        batch = next(batches)
        assert batch["text"].shape == (8, cfg.text_len) and batch["image"].shape == (8, cfg.image_len)
        assert int(batch["image"].max()) < cfg.image_vocab_size
    finally:
        server.should_exit = True
        thread.join(timeout=10)
