"""Image tokenizers (small VQ, taming VQGAN layouts) and the text tokenizer; the shipped ones."""

import json

import numpy as np
import pytest
import torch

from crowdtrain.data import shapes
from crowdtrain.data.config import VQTrainConfig
from crowdtrain.data.image_tokenizer import SmallVQ, load_image_tokenizer
from crowdtrain.data.tokenizers import (SHAPES_IMAGE_TOKENIZER, SHAPES_TEXT_TOKENIZER, SHAPES_VQ_TOKENIZER,
                                       default_text_tokenizer, load_text_tokenizer,
                                       resolve_image_tokenizer, train_text_tokenizer)
from crowdtrain.data.vq_train import reconstruction_report, train_vq
from crowdtrain.data.vqgan import TamingVQGAN

pytestmark = pytest.mark.timeout(180)


def _images(num, seed=0, heldout=False):
    samples = list(shapes.generate_samples(num, seed=seed, heldout=heldout))
    return np.stack([s[0] for s in samples]), [s[1] for s in samples]


# ---- the small VQ ---------------------------------------------------------------------------

def test_small_vq_training_is_deterministic_and_learns(tmp_path):
    images, _ = _images(64)
    cfg = VQTrainConfig(steps=6, batch_size=8, seed=0)
    a = train_vq(images, cfg, progress=False)
    b = train_vq(images, cfg, progress=False)
    c = train_vq(images, VQTrainConfig(steps=6, batch_size=8, seed=1), progress=False)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.codebook, c.codebook)
    # Save/load keeps behaviour exactly (full precision file).
    a.save(tmp_path / "a.safetensors")
    loaded = load_image_tokenizer(tmp_path / "a.safetensors")
    assert isinstance(loaded, SmallVQ)
    assert torch.equal(loaded.encode(images[:8]), a.encode(images[:8]))
    assert torch.equal(loaded.decode(a.encode(images[:8])), a.decode(a.encode(images[:8])))
    # A few more steps reduce the reconstruction error (it learns, it is not a stub).
    longer = train_vq(images, VQTrainConfig(steps=25, batch_size=8, seed=0), progress=False)
    assert reconstruction_report(longer, images)["mse"] < reconstruction_report(a, images)["mse"]


def test_an_interrupted_tokenizer_training_continues_where_it_stopped_and_ends_the_same(tmp_path):
    from crowdtrain.data.vq_train import TrainingInterrupted

    images, _ = _images(48)
    cfg = VQTrainConfig(steps=60, batch_size=8, seed=0, dead_code_steps=5)  # dead-code restarts draw randoms too
    whole = train_vq(images, cfg, progress=False)
    resume = tmp_path / "vq.safetensors.resume.safetensors"
    with pytest.raises(TrainingInterrupted, match=f"stopped at step 25 of 60; the state is in {resume}"):
        train_vq(images, cfg, progress=False, resume_path=resume, stop_after_steps=25)
    assert resume.is_file()
    with pytest.raises(ValueError, match=r"other settings \['lr'\].*delete .*resume.safetensors to start afresh"):
        train_vq(images, VQTrainConfig(steps=60, batch_size=8, seed=0, dead_code_steps=5, lr=1e-3),
                 progress=False, resume_path=resume)
    with pytest.raises(TrainingInterrupted, match="stopped at step 40 of 60"):  # and a second interruption
        train_vq(images, cfg, progress=False, resume_path=resume, stop_after_steps=15)
    good = resume.read_bytes()
    resume.write_bytes(good[: len(good) // 2])  # cut short (a full disk)
    with pytest.raises(ValueError, match="cannot be read .*delete it to start afresh"):
        train_vq(images, cfg, progress=False, resume_path=resume)
    resume.write_bytes(good)
    resumed = train_vq(images, cfg, progress=False, resume_path=resume)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert not resume.exists()  # removed once finished


def test_ctrl_c_stops_a_tokenizer_training_after_its_step_and_keeps_its_state(tmp_path):
    import os
    import signal
    import threading

    from crowdtrain.data.vq_train import TrainingInterrupted

    images, _ = _images(48)
    resume = tmp_path / "vq.safetensors.resume.safetensors"
    before = signal.getsignal(signal.SIGINT)
    threading.Timer(1.0, lambda: [os.kill(os.getpid(), signal.SIGINT) for _ in range(2)]).start()
    with pytest.raises(TrainingInterrupted, match=r"stopped at step \d+ of 100000"):
        train_vq(images, VQTrainConfig(steps=100_000, batch_size=8, seed=0), progress=False, resume_path=resume)
    assert resume.is_file() and signal.getsignal(signal.SIGINT) is before


def test_tokenizer_train_cli_reproduces_file(tmp_path):
    from crowdtrain.cli import main

    shapes.write_shapes_folder(tmp_path / "data", num=40, seed=0, progress=False)
    args = ["tokenizer", "train", "--data", str(tmp_path / "data"), "--steps", "4", "--batch-size", "8"]
    assert main(args + ["--out", str(tmp_path / "a.safetensors")]) == 0
    assert main(args + ["--out", str(tmp_path / "b.safetensors")]) == 0
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    tok = load_image_tokenizer(tmp_path / "a.safetensors")
    assert tok.report["images"] == 2 and "mse" in tok.report  # every 20th image is held out


def test_shipped_vq_tokenizer_reads_back_shapes():
    """Encoding then decoding keeps what the caption says: the tokenizer is the ceiling of every
    model trained on its codes. 200 fresh images per kind (a seed the tokenizer never saw). The
    shipped file reads back 0.95 of seen and 0.915-0.95 of held-out images (one shape 0.98-1.0,
    two 0.88-0.94); the bounds sit ~2 standard errors (0.018 on 200 images) below that, so a
    tokenizer that loses shapes again (0.74 / 0.62 before the 4-pixel lattice) fails."""
    tok = resolve_image_tokenizer("shapes-vq")
    assert tok.grid_size == (8, 8) and tok.vocab_size == 512 and tok.image_size == 64
    assert SHAPES_VQ_TOKENIZER.stat().st_size < 2_000_000 and SHAPES_IMAGE_TOKENIZER.stat().st_size < 100_000
    stored = tok.report
    assert stored["shapes_agreement"] >= 0.93 and stored["codes_used"] > 200 and "command" in stored, stored
    for heldout in (False, True):
        images, captions = _images(200, seed=99, heldout=heldout)
        codes = tok.encode(images)
        recon = tok.decode(codes).numpy()
        verdicts = {1: [], 2: []}
        for image, caption in zip(recon, captions):
            scene = shapes.parse_caption(caption)
            verdicts[len(scene.objects)].append(shapes.judge(scene, shapes.analyse_image(image))["all"])
        overall = np.mean(verdicts[1] + verdicts[2])
        assert overall >= 0.90, (heldout, overall)
        assert np.mean(verdicts[1]) >= 0.95 and np.mean(verdicts[2]) >= 0.85, (heldout, verdicts)
        assert reconstruction_report(tok, images[:50])["mse"] < 0.006


# ---- taming VQGAN ---------------------------------------------------------------------------

# Entries of the public f=8, 8192-code checkpoints (vqgan_gumbel_f8_8192; ch 128, ch_mult 1,1,2,4,
# 2 res blocks, attention at 32x32, z 256), by name and shape, as taming's modules name them.
TAMING_F8_ENTRIES = {
    "encoder.conv_in.weight": (128, 3, 3, 3),
    "encoder.down.0.block.1.conv2.weight": (128, 128, 3, 3),
    "encoder.down.0.downsample.conv.weight": (128, 128, 3, 3),
    "encoder.down.2.block.0.nin_shortcut.weight": (256, 128, 1, 1),
    "encoder.down.3.block.0.nin_shortcut.weight": (512, 256, 1, 1),
    "encoder.down.3.attn.1.proj_out.weight": (512, 512, 1, 1),
    "encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
    "encoder.norm_out.weight": (512,),
    "encoder.conv_out.weight": (256, 512, 3, 3),
    "quant_conv.weight": (256, 256, 1, 1),
    "post_quant_conv.weight": (256, 256, 1, 1),
    "decoder.conv_in.weight": (512, 256, 3, 3),
    "decoder.mid.block_2.norm2.bias": (512,),
    "decoder.up.3.attn.2.k.weight": (512, 512, 1, 1),
    "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
    "decoder.up.2.block.0.nin_shortcut.weight": (256, 512, 1, 1),
    "decoder.up.1.block.0.nin_shortcut.weight": (128, 256, 1, 1),
    "decoder.up.0.block.2.conv1.weight": (128, 128, 3, 3),
    "decoder.conv_out.weight": (3, 128, 3, 3),
}
ABSENT = ("encoder.down.3.downsample.conv.weight", "decoder.up.0.upsample.conv.weight",
          "encoder.down.2.attn.0.q.weight", "decoder.up.0.block.0.nin_shortcut.weight")


@pytest.mark.parametrize("quantizer", ["gumbel", "vq"])
def test_taming_f8_checkpoint_layout_loads_and_round_trips(tmp_path, quantizer):
    torch.manual_seed(0)
    model = TamingVQGAN(quantizer=quantizer)
    state = model.state_dict()
    for name, shape in TAMING_F8_ENTRIES.items():
        assert tuple(state[name].shape) == shape, name
    for name in ABSENT:
        assert name not in state
    codebook = "quantize.embed.weight" if quantizer == "gumbel" else "quantize.embedding.weight"
    assert tuple(state[codebook].shape) == (8192, 256)
    if quantizer == "gumbel":
        assert tuple(state["quantize.proj.weight"].shape) == (8192, 256, 1, 1)
    # Save as taming does (Lightning checkpoint: state_dict with training-only loss.* entries).
    ckpt = {"state_dict": {**state, "loss.discriminator.main.0.weight": torch.zeros(64, 3, 4, 4),
                           "loss.perceptual_loss.net.slice1.0.weight": torch.zeros(64, 3, 3, 3)},
            "global_step": 1000}
    torch.save(ckpt, tmp_path / "last.ckpt")
    loaded = load_image_tokenizer(tmp_path / "last.ckpt")
    assert loaded.config_dict() == {**model.config_dict()}
    images, _ = _images(2)
    codes = loaded.encode(images)
    assert codes.shape == (2, 8, 8) and codes.min() >= 0 and codes.max() < 8192
    assert torch.equal(codes, model.encode(images))
    decoded = loaded.decode(codes)
    assert decoded.shape == (2, 64, 64, 3) and decoded.dtype == torch.uint8
    assert torch.equal(decoded, model.decode(codes))


def test_taming_convert_to_safetensors_and_refusal(tmp_path):
    from crowdtrain.cli import main

    torch.manual_seed(0)
    small = TamingVQGAN(quantizer="vq", ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_levels=(1,), z_channels=32,
                        embed_dim=16, n_embed=64, image_size=32)
    torch.save(small.state_dict(), tmp_path / "bare.pt")  # a bare state dict loads too
    assert main(["tokenizer", "convert", "--taming", str(tmp_path / "bare.pt"), "--out",
                 str(tmp_path / "vq.safetensors")]) == 0
    converted = load_image_tokenizer(tmp_path / "vq.safetensors")
    # Without --image-size, images are taken at taming's 256x256 (f=2 here, so a 128x128 grid).
    assert converted.config_dict()["attn_levels"] == [1] and converted.grid_size == (128, 128)
    images = np.random.default_rng(0).integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
    assert torch.equal(converted.encode(images), small.encode(images))
    # A checkpoint that pickles other objects is refused by weights_only=True, with the fix in the message.
    torch.save({"state_dict": small.state_dict(), "callbacks": {"cb": _PickledCallback()}}, tmp_path / "lightning.ckpt")
    with pytest.raises(ValueError, match="--trust-checkpoint"):
        load_image_tokenizer(tmp_path / "lightning.ckpt")
    trusted = load_image_tokenizer(tmp_path / "lightning.ckpt", trust_checkpoint=True)
    assert torch.equal(trusted.encode(images), small.encode(images))


class _PickledCallback:
    pass


# ---- text tokenizer -------------------------------------------------------------------------

def test_text_tokenizer_pads_with_zero_and_is_deterministic(tmp_path):
    captions = [c for _, c, _ in shapes.generate_samples(300, seed=0)]
    a = train_text_tokenizer(captions, vocab_size=200, out=tmp_path / "a.json")
    train_text_tokenizer(captions, vocab_size=200, out=tmp_path / "b.json")
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    ids = a.encode_batch(["a small red circle above a large blue square", "A Large Green Square"], 16)
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    assert (ids[0] != 0).sum() == 9 and (ids[0, 9:] == 0).all()  # one token per word here, then padding
    assert a.decode(ids[1]) == "a large green square"
    assert (a.encode_batch(["a small red circle " * 10], 8) != 0).all()  # truncated to the length


def test_shipped_text_tokenizer_reproduces_and_covers_heldout_prompts(tmp_path):
    tok = default_text_tokenizer()
    assert tok.vocab_size <= 1024
    for prompt in shapes.EVAL_PROMPTS["heldout"] + shapes.EVAL_PROMPTS["seen"]:
        ids = tok.encode_batch([prompt], 32)[0]
        assert 1 not in ids.tolist()  # no [UNK]
        assert tok.decode(ids) == prompt
    # The shipped file is exactly what the documented command makes from the seed-0 captions.
    captions = [c for _, c, _ in shapes.generate_samples(10000, seed=0)]
    train_text_tokenizer(captions, vocab_size=1024, out=tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(SHAPES_TEXT_TOKENIZER.read_text())


def test_any_tokenizer_json_with_pad_zero_loads(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A T5-like Unigram tokenizer: <pad> = 0, </s> = 1, <unk> = 2.
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁a", -1.0), ("▁red", -2.0), ("▁circle", -2.0)]
    t5 = Tokenizer(models.Unigram(vocab, unk_id=2))
    t5.pre_tokenizer = pre_tokenizers.Metaspace()
    t5.save(str(tmp_path / "tokenizer.json"))
    tok = load_text_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert tok.encode_batch(["a red circle"], 5).tolist() == [[3, 4, 5, 0, 0]]
    bad = Tokenizer(models.Unigram([("<unk>", 0.0), ("<pad>", 0.0), ("▁a", -1.0)], unk_id=0))
    bad.save(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not id 0"):
        load_text_tokenizer(tmp_path / "bad.json")
