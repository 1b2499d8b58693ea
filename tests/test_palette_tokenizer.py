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
    diff = logits[:, :, 1] - logits[:, :, 0]
    assert torch.allclose(diff, diff[:, :1].expand_as(diff), atol=1e-5)
    # The image rows of the table are what the model embeds codes with, and what it scores.
    table = model.embedding_weight()
    assert table.shape == (cfg.vocab_size, cfg.width)
    code = torch.tensor([[cfg.text_vocab_size + 7]])
    assert torch.allclose(model.embed_ids(code)[0, 0], model.image_factors["mask"].weight[2]
                          + model.image_factors["colour"].weight[1])


def test_factors_that_do_not_match_the_vocabulary_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="n_masks \\* n_colours = model.image_vocab_size"):
        get_preset("tiny", image_vocab_size=64, image_code_factors=[4, 3])
    assert get_preset("tiny", image_vocab_size=12, image_code_factors=[4, 3]).fingerprint() != \
        get_preset("tiny", image_vocab_size=12).fingerprint()
