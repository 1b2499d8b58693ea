"""The CUDA tier (``pytest -m cuda``): the GPU paths the CPU suite cannot reach.

Every test here is marked ``cuda``; where torch sees no CUDA device, tests/conftest.py reports
each one as SKIPPED with the reason. benchmarks/gpu_check.sh runs them on a lent GPU.
"""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from crowdtrain.checkpoint import load_checkpoint, save_checkpoint
from crowdtrain.model import DalleTransformer, generate_images, get_preset
from crowdtrain.train.local import autocast_context
from crowdtrain.train.task import DalleTask
from tests.test_model import random_batch, small_config

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")

# (preset, batch): the paper preset at its full shape (64 layers, 1280 positions) fits an 80 GB
# card at batch 2 with AdamW on the GPU; a few steps show the path runs, not that it learns.
PRESETS = [pytest.param("demo", 16, id="demo"), pytest.param("paper", 2, id="paper")]
MEMORY = [pytest.param(dict(reversible=True, checkpointing=False), id="reversible"),
          pytest.param(dict(reversible=False, checkpointing=True), id="checkpointed")]


def train_steps(config, *, precision: str, batch_size: int, steps: int) -> tuple[list[float], float]:
    """``steps`` AdamW steps on the GPU as ``crowdtrain train --local`` takes them (autocast, a
    GradScaler for fp16); returns the losses and how far the weights moved (max abs change)."""
    torch.manual_seed(0)
    task = DalleTask(config, data="pattern")
    model = task.build_model().to(CUDA)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    batches = task.batches(batch_size=batch_size, seed_key="cuda-test")
    losses = []
    for _ in range(steps):
        batch = {k: v.to(CUDA, non_blocking=True) for k, v in next(batches).items()}
        with autocast_context(CUDA, precision):
            loss = task.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    return losses, moved


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("preset,batch_size", PRESETS)
def test_presets_train_on_cuda(preset, batch_size, precision, memory):
    config = get_preset(preset, **memory)
    # fp16's scaler skips the first steps while it finds its scale (2**16 overflows at first).
    steps = 3 if precision == "bf16" else 6
    losses, moved = train_steps(config, precision=precision, batch_size=batch_size, steps=steps)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert moved > 0, "no optimizer step was taken (every fp16 step overflowed?)"
    if preset == "demo":  # the demo preset learns the pattern data visibly in a few steps
        more, _ = train_steps(config, precision=precision, batch_size=batch_size, steps=40)
        assert sum(more[-5:]) / 5 < sum(more[:5]) / 5, more


@pytest.mark.parametrize("pattern", ["axial_row", "axial_col", "conv_like"])
def test_sparse_attention_equals_dense_on_cuda(pattern):
    torch.manual_seed(0)
    cfg = small_config(depth=2, patterns=(pattern, pattern), share_ids=(0, 1), image_height=5, image_width=4,
                       token_shift=True, layer_scale=True)
    model = DalleTransformer(cfg).double().to(CUDA)
    text, image = (t.to(CUDA) for t in random_batch(cfg))
    results = {}
    for impl in ("dense", "efficient"):
        model.zero_grad()
        model.attention_impl = impl
        out = model(text, image, return_logits=True)
        out.loss.backward()
        results[impl] = out.image_logits, {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(results["efficient"][0], results["dense"][0], rtol=1e-9, atol=1e-9)
    for name, grad in results["dense"][1].items():
        torch.testing.assert_close(results["efficient"][1][name], grad, rtol=1e-8, atol=1e-10, msg=name)


def test_sparse_attention_equals_dense_at_the_papers_sequence_length_in_bf16():
    """The paper's grid and caption (1280 positions), two layers, under bf16 autocast: the two
    implementations round differently, so they agree to bf16's precision, not bit for bit."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("paper"), depth=2, patterns=("axial_row", "axial_col"), share_ids=(0, 1),
                              width=256, heads=4)
    model = DalleTransformer(cfg).to(CUDA).eval()
    text, image = (t.to(CUDA) for t in random_batch(cfg, batch=2))
    outs = {}
    for impl in ("dense", "efficient"):
        model.attention_impl = impl
        with torch.no_grad(), autocast_context(CUDA, "bf16"):
            outs[impl] = model(text, image, return_logits=True).image_logits.float()
    torch.testing.assert_close(outs["efficient"], outs["dense"], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("reversible", [False, True])
def test_kv_cache_sampling_equals_uncached_on_cuda(reversible):
    torch.manual_seed(0)
    cfg = small_config(reversible=reversible, token_shift=True, layer_scale=True)
    model = DalleTransformer(cfg).double().to(CUDA)
    text = random_batch(cfg)[0].to(CUDA)
    codes, cached = generate_images(model, text, seed=3, top_k=None, return_logits=True)
    codes_u, uncached = generate_images(model, text, seed=3, top_k=None, return_logits=True, use_cache=False)
    assert codes.device.type == CUDA.type
    torch.testing.assert_close(uncached, cached, rtol=1e-9, atol=1e-9)
    assert torch.equal(codes, codes_u)


def test_a_checkpoint_written_on_cuda_loads_on_cpu_and_back(tmp_path):
    torch.manual_seed(0)
    cfg = get_preset("demo")
    model = DalleTransformer(cfg).to(CUDA)
    text, image = random_batch(cfg, batch=2)
    save_checkpoint(tmp_path / "ckpt", model, step=1, loss=1.0)
    on_cpu, _ = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert all(p.device.type == "cpu" for p in on_cpu.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(on_cpu.state_dict()[name], tensor.cpu()), name
    back, _ = load_checkpoint(tmp_path / "ckpt", device=CUDA)
    assert all(t.device.type == CUDA.type for t in back.state_dict().values())
    with torch.no_grad():
        expected = model.eval()(text.to(CUDA), image.to(CUDA)).loss
        torch.testing.assert_close(back.eval()(text.to(CUDA), image.to(CUDA)).loss, expected)
        # The CPU copy computes the same loss up to the devices' different kernels.
        torch.testing.assert_close(on_cpu.eval()(text, image).loss, expected.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode,precision", [("sync", "fp16"), ("diloco", "bf16")])
def test_two_cuda_volunteers_on_one_gpu_train_together(swarm_factory, mode, precision):
    """Two `crowdtrain join --device cuda` peers on one GPU. Sync mode: the optimizer offloaded
    to the CPU with the delayed update (the defaults, set here explicitly), in fp16, so the peer's
    loss scaling runs; DiLoCo: the global parameters and the outer optimizer live on the CPU by
    design."""
    settings = ({"offload_optimizer": True, "delay_optimizer_step": True} if mode == "sync"
                else {"mode": "diloco", "lr": 0.003})
    swarm = swarm_factory(swarm={"target_batch_size": 768, **settings})
    swarm.start_coordinator()
    epochs = 5
    for name in "ab":
        swarm.join(name, batch_size=32, max_epochs=epochs, extra=["--device", "cuda", "--precision", precision])
    for name in "ab":
        assert swarm.wait_exit(name, 300) == 0, swarm.log(name)[-3000:]
    summaries = {n: swarm.summary(n) for n in "ab"}
    assert all(s["final_epoch"] >= epochs for s in summaries.values()), summaries
    assert all(s["samples"] > 0 for s in summaries.values())
    if mode == "diloco":
        # Right after every sync both peers hold bit-identical global parameters, and they leave
        # right after the last one: the same bits in both final files.
        from tests.test_diloco import digest_of, digests_by_epoch  # imports hivemind: only this test needs it

        shared = {e: d for e, d in digests_by_epoch(summaries, skip_overtaken=True).items() if len(d) == 2}
        assert shared, "the two peers never synced together"
        assert all(len(set(d.values())) == 1 for d in shared.values()), shared
        assert digest_of(swarm.tmp / "a.safetensors") == digest_of(swarm.tmp / "b.safetensors")
        return
    # Rounds where both peers averaged the whole batch leave them equal up to fp16 on the wire; a
    # round that missed one leaves them up to one update (about lr) apart (as in tests/test_swarm.py).
    params = {n: load_file(str(swarm.tmp / f"{n}.safetensors")) for n in "ab"}
    missed = sum(r["partial"] or r["left_out"] or r["group_size"] < r["swarm_peers"]
                 for s in summaries.values() for r in s["rounds"])
    bound = 0.02 if missed == 0 else 2.5 * swarm.swarm["lr"] * missed
    apart = max((params["b"][k] - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                for k, ref in params["a"].items())
    assert apart < bound, (missed, apart)
