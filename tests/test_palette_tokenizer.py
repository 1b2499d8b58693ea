"""The factorised image codes of the shapes data: (mask, colour) per patch, and the model's
embedding that scores a code as a mask score plus a colour score."""

import numpy as np
import pytest
import torch

from crowdtrain.data import shapes
from crowdtrain.data.image_tokenizer import load_image_tokenizer
from crowdtrain.data.palette_tokenizer import PaletteMaskTokenizer
from crowdtrain.data.tokenizers import SHAPES_IMAGE_TOKENIZER
from crowdtrain.model import DalleTransformer, get_preset


@pytest.fixture(scope="module")
def shipped():
    return load_image_tokenizer(SHAPES_IMAGE_TOKENIZER)


@pytest.mark.parametrize("heldout", [False, True])
def test_the_shipped_codes_give_back_every_picture_and_what_its_caption_says(shipped, heldout):
    """Held-out colour-shape pairs included: their masks were fitted on other colours."""
    samples = list(shapes.generate_samples(300, seed=5, heldout=heldout))
    images = np.stack([image for image, _, _ in samples])
    codes = shipped.encode(images)
    assert codes.shape == (300, 8, 8) and int(codes.max()) < shipped.vocab_size
    back = shipped.decode(codes).numpy()
    assert (back == images).all()
    read_back = np.mean([shapes.judge(caption, shapes.analyse_image(b))["all"]
                         for (_, caption, _), b in zip(samples, back)])
    assert read_back >= 0.95, read_back


def test_a_code_is_a_mask_and_a_colour(shipped):
    n_masks, n_colours = shipped.factors
    assert n_masks * n_colours == shipped.vocab_size and n_colours == len(shapes.COLORS)
    red, blue = list(shapes.COLORS).index("red"), list(shapes.COLORS).index("blue")
    image = np.stack([shapes.render(shapes.Scene((shapes.ShapeObject(c, "triangle", "large"),),
                                                 position="in the middle"), __import__("random").Random(0))
                      for c in ("red", "blue")])
    a, b = shipped.encode(image)
    drawn = a != 0
    assert drawn.any() and (drawn == (b != 0)).all()
    assert ((a[drawn] // n_colours) == (b[drawn] // n_colours)).all(), "the same shape has the same masks"
    assert (a[drawn] % n_colours == red).all() and (b[drawn] % n_colours == blue).all()


def test_off_palette_pixels_and_unseen_masks_take_the_nearest(tmp_path):
    tok = PaletteMaskTokenizer(palette=[(200, 0, 0), (0, 0, 200)], background=(255, 255, 255), n_masks=4)
    image = np.full((1, 64, 64, 3), 255, np.uint8)
    image[0, :8, :4] = (200, 0, 0)  # the left half of the first patch
    image[0, 8:16, :8] = (0, 0, 200)  # the whole second-row patch
    tok.fit(image)
    noisy = image.copy()
    noisy[0, :8, :4] = (190, 20, 10)  # off-palette red
    noisy[0, 0, 4] = (200, 0, 0)  # one more pixel than any fitted mask has
    codes = tok.encode(noisy)
    assert (tok.decode(codes).numpy() == image).all()
    tok.save(tmp_path / "t.safetensors")
    loaded = load_image_tokenizer(tmp_path / "t.safetensors")
    assert isinstance(loaded, PaletteMaskTokenizer) and (loaded.encode(noisy) == codes).all()


def test_a_factorised_embedding_scores_a_code_as_mask_plus_colour():
    cfg = get_preset("tiny", image_vocab_size=12, image_code_factors=[4, 3])
    model = DalleTransformer(cfg).eval()
    h = torch.randn(5, cfg.width)
    logits = model.logits(h, "image").view(5, 4, 3)  # (batch, mask, colour)
    # Additive: the colour part of a logit does not depend on the mask, nor the mask part on the colour.
    diff = logits[:, 1:, 1] - logits[:, 1:, 0]
    assert torch.allclose(diff, diff[:, :1].expand_as(diff), atol=1e-5)
    # The image rows of the table are what the model embeds codes with, and what it scores.
    table = model.embedding_weight()
    assert table.shape == (cfg.vocab_size, cfg.width)
    code = torch.tensor([[cfg.text_vocab_size + 7]])
    assert torch.allclose(model.embed_ids(code)[0, 0], model.image_factors["mask"].weight[2]
                          + model.image_factors["colour"].weight[1])


def test_the_blank_patch_is_one_outcome_and_trains_no_colour():
    cfg = get_preset("tiny", image_vocab_size=12, image_code_factors=[4, 3])
    model = DalleTransformer(cfg).eval()
    h = torch.randn(5, cfg.width)
    p = model.logits(h, "image").softmax(-1).view(5, 4, 3)
    mask_scores = h @ model.image_factors["mask"].weight.t()
    colour_scores = h @ model.image_factors["colour"].weight.t()
    p_mask, p_colour = mask_scores.softmax(-1), colour_scores.softmax(-1)
    # Code 0 carries p(mask 0), the other blank codes nothing; foreground codes keep p(mask) p(colour).
    assert torch.allclose(p[:, 0, 0], p_mask[:, 0], atol=1e-5) and (p[:, 0, 1:] == 0).all()
    assert torch.allclose(p[:, 1:], p_mask[:, 1:, None] * p_colour[:, None, :], atol=1e-5)
    assert torch.allclose(p.sum((1, 2)), torch.ones(5), atol=1e-5)

    text = torch.randint(0, cfg.text_vocab_size, (2, cfg.text_len))
    blank = torch.zeros(2, cfg.image_len, dtype=torch.long)
    # A blank written with any colour is the same patch, with the same loss.
    assert torch.allclose(model(text, blank).image_loss, model(text, blank + 2).image_loss)
    # Blank targets pull no colour: only foreground patches train the colour scores (colour 0 is
    # in the input embedding of the blank, so look at the others).
    model.train()
    model(text, blank).image_loss.backward()
    assert model.image_factors["colour"].weight.grad[1:].abs().max() < 1e-6
    model.zero_grad()
    painted = blank.clone()
    painted[:, 5] = 2 * 3 + 1  # mask 2 in colour 1
    model(text, painted).image_loss.backward()
    assert model.image_factors["colour"].weight.grad[1:].abs().max() > 1e-4


def test_factors_that_do_not_match_the_vocabulary_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="n_masks \\* n_colours = model.image_vocab_size"):
        get_preset("tiny", image_vocab_size=64, image_code_factors=[4, 3])
    assert get_preset("tiny", image_vocab_size=12, image_code_factors=[4, 3]).fingerprint() != \
        get_preset("tiny", image_vocab_size=12).fingerprint()
