"""`crowdtrain generate` (likelihood and CLIP re-ranking) on a tiny checkpoint, and the shapes
judge's adherence metric (`crowdtrain eval` on a run's data: tests/test_data_eval.py)."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests._data_helpers import random_vq
from crowdtrain.checkpoint import save_checkpoint
from crowdtrain.data.config import GenerateConfig
from crowdtrain.data.generate import Generator, generate_grid
from crowdtrain.data.rerank import ClipReranker, LikelihoodReranker
from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER
from crowdtrain.model.config import get_preset
from crowdtrain.model.transformer import DalleTransformer

pytestmark = pytest.mark.timeout(180)

PROMPT = "a small red circle above a large blue square"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    config = get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=512)
    model = DalleTransformer(config)
    return save_checkpoint(d / "step-1", model, step=1, assets={
        "text_tokenizer.json": SHAPES_TEXT_TOKENIZER,
        "image_tokenizer.safetensors": random_vq(d / "vq.safetensors")})


def test_generate_cli_writes_best_of_n_grid(checkpoint, tmp_path, capsys):
    from crowdtrain.cli import main

    out = tmp_path / "grid.png"
    rc = main(["generate", "--checkpoint", str(checkpoint), PROMPT, "--num-samples", "8", "--keep", "3",
               "--seed", "1", "--out", str(out)])
    assert rc == 0
    said = capsys.readouterr()
    assert "best 3 of 8 by likelihood" in said.out
    # Before it starts, which re-ranker and why; while it runs, a progress bar with the time left.
    assert "keeping the best 3 by likelihood: no --clip DIR given, so the model's own likelihood" in said.out
    assert "sampling: 100%" in said.err and "8/8" in said.err
    rc = main(["generate", "--checkpoint", str(checkpoint), PROMPT, "--num-samples", "4", "--keep", "2",
               "--rerank", "none", "--out", str(tmp_path / "raw.png")])
    assert rc == 0 and "by none: --rerank none: the first samples drawn" in capsys.readouterr().out
    grid = Image.open(out)
    assert grid.size == (4 * (3 * 66 + 2), 4 * (66 + 2))  # 3 tiles of 64 px with 2 px gaps, 4x upscaled


def test_likelihood_rerank_keeps_the_highest_scores(checkpoint, tmp_path):
    cfg = GenerateConfig(num_samples=8, keep=2, seed=3, rerank="likelihood")
    result = generate_grid(checkpoint, PROMPT, cfg, out=tmp_path / "g.png")
    gen = Generator.from_checkpoint(checkpoint)
    codes, images = gen.sample(PROMPT, 8, top_k=cfg.top_k, top_p=cfg.top_p, temperature=cfg.temperature, seed=3)
    scores = LikelihoodReranker(gen.model).scores(PROMPT, images, codes, gen.text_ids(PROMPT))
    # The kept samples are the two best, in order; the score is the mean log-probability of the codes.
    assert result["indices"] == torch.argsort(scores, descending=True)[:2].tolist()
    assert result["scores"] == pytest.approx(sorted(scores.tolist(), reverse=True)[:2])
    with torch.no_grad():
        out = gen.model(gen.text_ids(PROMPT), codes[:1].reshape(1, -1), return_logits=True)
    manual = out.image_logits.log_softmax(-1).gather(-1, codes[:1].reshape(1, -1, 1)).mean()
    assert scores[0].item() == pytest.approx(manual.item(), abs=1e-5)
    assert float(scores.max()) > float(scores.min())


def _tiny_clip(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    words = sorted(set(PROMPT.split()) | {"green", "triangle"})
    vocab = {"<|pad|>": 0, "<|startoftext|>": 1, "<|endoftext|>": 2, "<|unk|>": 3,
             **{w: i + 4 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", unk_token="<|unk|>", bos_token="<|startoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(directory)
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(image_size=32, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        projection_dim=16)
    model = CLIPModel(config).eval()
    model.save_pretrained(directory)
    return model


def test_clip_rerank_with_a_local_random_clip(checkpoint, tmp_path, capsys):
    from crowdtrain.cli import main

    clip_dir = tmp_path / "clip"
    clip = _tiny_clip(clip_dir)
    rc = main(["generate", "--checkpoint", str(checkpoint), PROMPT, "--num-samples", "6", "--keep", "2",
               "--clip", str(clip_dir), "--out", str(tmp_path / "c.png")])
    assert rc == 0 and "by clip" in capsys.readouterr().out
    # The re-ranker's score is CLIP's own image-text cosine similarity (logits_per_image / logit_scale).
    reranker = ClipReranker(clip_dir)
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (3, 64, 64, 3), dtype=np.uint8))
    scores = reranker.scores(PROMPT, images, None, None)
    tok = reranker.tokenizer([PROMPT], return_tensors="pt")
    with torch.no_grad():
        out = clip(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                   pixel_values=reranker._pixels(images))
    expected = out.logits_per_image[:, 0] / clip.logit_scale.exp()
    assert torch.allclose(scores, expected, atol=1e-5)


def test_eval_scores_a_perfect_drawer_as_perfect():
    """The metric itself: a 'model' that renders the prompt exactly scores 1.0 on both groups."""
    import random

    from crowdtrain.data import shapes
    from crowdtrain.data.evaluate import evaluate_generator

    class Perfect:
        def sample(self, prompt, num, **kw):
            scene = shapes.parse_caption(prompt)
            rng = random.Random(kw["seed"])
            return None, torch.from_numpy(np.stack([shapes.render(scene, rng) for _ in range(num)]))

    class Wrong(Perfect):
        def sample(self, prompt, num, **kw):
            return Perfect().sample("a large purple square in the middle", num, **kw)

    perfect = evaluate_generator(Perfect(), samples_per_prompt=3)
    assert perfect["groups"]["seen"]["adherence"] == 1.0 and perfect["groups"]["heldout"]["adherence"] == 1.0
    wrong = evaluate_generator(Wrong(), samples_per_prompt=2)
    assert wrong["groups"]["heldout"]["adherence"] == 0.0


def test_generate_rejects_mismatched_tokenizer(tmp_path):
    torch.manual_seed(0)
    model = DalleTransformer(get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=64))
    ckpt = save_checkpoint(tmp_path / "c", model, step=0, assets={
        "text_tokenizer.json": SHAPES_TEXT_TOKENIZER, "image_tokenizer.safetensors": random_vq(tmp_path / "v.st")})
    with pytest.raises(ValueError, match="image tokenizer"):
        Generator.from_checkpoint(ckpt)


def _sampler(run_dir):
    """The coordinator's checkpointer, its sampling part only (no DHT, no swarm)."""
    from crowdtrain.coordinator.db import Store
    from crowdtrain.auxpeer import AuxPeer

    aux = AuxPeer.__new__(AuxPeer)
    aux.run_dir, aux.samples_possible, aux.spec = run_dir, True, {}  # a spec without prompts: the shapes run
    aux.store = Store(f"sqlite:///{run_dir / 'run.db'}")
    return aux


def test_the_checkpointer_draws_the_gallery_from_a_checkpoint(checkpoint, tmp_path):
    aux = _sampler(tmp_path)
    aux.make_samples(checkpoint, epoch=1)
    samples = aux.store.samples()
    assert len(samples) == 6 and sum(s["held_out"] for s in samples) == 3
    for sample in samples:
        assert Image.open(tmp_path / sample["path"]).size == (3 * (4 * 66 + 2), 3 * (66 + 2))  # 4 tiles, 3x


def test_a_run_whose_model_no_image_tokenizer_fits_gets_no_gallery_and_one_line_saying_why(tmp_path, caplog):
    # `tiny` draws 64 codes; with no tokenizer in its checkpoints (a run on pattern data), the
    # shipped one has 1280. The checkpointer used to warn at every checkpoint.
    import logging

    ckpt = save_checkpoint(tmp_path / "step-1", DalleTransformer(get_preset("tiny")), step=1)
    aux = _sampler(tmp_path)
    with caplog.at_level(logging.INFO, logger="crowdtrain.auxpeer"):
        aux.make_samples(ckpt, epoch=1)
    assert not aux.samples_possible and aux.store.samples() == []
    assert [r.levelname for r in caplog.records] == ["INFO"] and "no sample images for this run" in caplog.text
