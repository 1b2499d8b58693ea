"""The demo data path end to end: shipped tokenizers -> demo shards -> model batches -> images."""

import time

import numpy as np
import pytest
import torch

from crowdtrain.data import batch_stream, default_image_tokenizer, default_text_tokenizer, ensure_demo_shards
from crowdtrain.data import shapes
from crowdtrain.model.config import get_preset
from crowdtrain.model.transformer import DalleTransformer

pytestmark = pytest.mark.timeout(180)


def test_demo_shards_feed_the_demo_model(tmp_path):
    t0 = time.time()
    folder = ensure_demo_shards(tmp_path / "shapes", num_train=300, seed=0)
    made = time.time() - t0
    t0 = time.time()
    assert ensure_demo_shards(tmp_path / "shapes", num_train=300, seed=0) == folder
    assert time.time() - t0 < min(made, 5)  # the second call finds the finished folder
    assert sorted(p.name for p in folder.glob("*.parquet"))[-1] == "valid-00000.parquet"

    config = get_preset("demo")
    text_tok, image_tok = default_text_tokenizer(), default_image_tokenizer()
    stream = batch_stream(folder, text_tokenizer=text_tok, model_config=config, batch_size=16, seed_key="peer-0")
    batch = next(stream)
    assert batch["text"].shape == (16, config.text_len) and batch["image"].shape == (16, config.image_len)
    # The codes decode back to pictures of what the captions say (the tokenizer keeps the content).
    images = image_tok.decode(batch["image"]).numpy()
    captions = [text_tok.decode(t) for t in batch["text"]]
    agree = np.mean([shapes.judge(c, shapes.analyse_image(im))["all"] for c, im in zip(captions, images)])
    assert agree >= 0.75  # the shipped tokenizer reads back ~0.95 of images (docs/data.md); 16 images are noisy
    assert all(not shapes.parse_caption(c).is_heldout for c in captions)
    # And the demo model trains on them: a few steps lower the loss on a fixed batch.
    torch.manual_seed(0)
    model = DalleTransformer(config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = None
    text, image = batch["text"][:8], batch["image"][:8]
    for _ in range(4):
        loss = model(text, image).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first

    valid = batch_stream(folder, text_tokenizer=text_tok, model_config=config, batch_size=8, seed_key="v",
                         split="valid")
    assert next(valid)["image"].shape == (8, config.image_len)
