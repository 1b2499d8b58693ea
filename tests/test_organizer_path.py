"""The organizer's path from images to a run: `data prepare`'s fit report per split on a random
sample and its caption check, data-neutral /samples that lists only checkpoints whose images
exist, and the guide naming what an organizer needs (splits, --threads, the schedule)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.data import shapes
from crowdtrain.data.captions import caption_report, format_caption_report
from crowdtrain.data.shards import fit_sample, tokenizer_fit_report
from crowdtrain.data.tokenizers import default_text_tokenizer, train_text_tokenizer

pytestmark = pytest.mark.timeout(120)


def numbered_folder(folder, num: int):
    """Pictures whose file order is their number, each a different grey, so a picture tells which it is."""
    folder.mkdir()
    for i in range(num):
        Image.fromarray(np.full((64, 64, 3), 2 * i, np.uint8)).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(f"a small red circle number {i}")
    return folder


def test_the_fit_report_is_written_per_split_on_a_seeded_random_sample(tmp_path):
    from crowdtrain.data.tokenizers import resolve_image_tokenizer

    images = numbered_folder(tmp_path / "images", 100)
    (images / "0007.txt").unlink()  # an item prepare skips is never drawn
    sample, population = fit_sample(images, 8, seed=0)
    names = [item.source for item in sample]
    assert population == 99 and len(names) == 8 and "0007.png" not in names
    assert names != [f"{i:04d}.png" for i in range(8)] and max(names) > "0050.png"  # not the first files
    assert names == [item.source for item in fit_sample(images, 8, seed=0)[0]]  # reproducible
    assert names != [item.source for item in fit_sample(images, 8, seed=1)[0]]
    tokenizer = resolve_image_tokenizer("shapes")
    out = tmp_path / "out"
    out.mkdir()
    train = tokenizer_fit_report(images, tokenizer, out, num=8, split="train")
    valid = tokenizer_fit_report(numbered_folder(tmp_path / "valid", 5), tokenizer, out, num=8, split="valid")
    assert train["picture"].endswith("fit_report-train.png") and valid["picture"].endswith("fit_report-valid.png")
    assert (out / "fit_report-train.png").is_file() and (out / "fit_report-valid.png").is_file()
    assert train["sources"] == names and train["of"] == 99 and valid["images"] == 5
    # The picture shows the sample: the top-left original is the first drawn picture's grey.
    sheet = np.asarray(Image.open(out / "fit_report-train.png"))
    assert sheet[4, 4, 0] == 2 * int(names[0][:4])


def test_the_caption_check_counts_what_the_model_cuts_and_the_words_the_tokenizer_does_not_know(tmp_path):
    captions = ["a small red circle on the left"] * 6 + ["grinning face with big eyes and a thumbs up sign"] * 4
    shipped = caption_report(captions, default_text_tokenizer(), 8)
    assert shipped["captions"] == 10 and shipped["cut"] == 4 and shipped["longest"] > 8
    assert shipped["distinct_unknown"] >= 8 and "grinning" in shipped["top_unknown"] and "red" not in \
        shipped["top_unknown"]
    text = format_caption_report(shipped, tokenizer_name="shipped", text_len_from="--text-len 8")
    assert "4 of 10 captions (40.0%) are longer than 8 tokens and will be cut" in text
    assert f"--model text_len={shipped['longest']}" in text and "shorten the captions" in text
    assert "not words the text tokenizer knows" in text and "crowdtrain tokenizer train-text" in text
    # A tokenizer trained on these captions knows their words; a longer text length cuts nothing.
    own = train_text_tokenizer(captions * 3, vocab_size=200)
    fits = caption_report(captions, own, 16)
    text = format_caption_report(fits, tokenizer_name="own", text_len_from="--text-len 16")
    assert fits["cut"] == 0 and fits["unknown_words"] == 0 and "WARNING" not in text
    assert "no caption is cut at 16 tokens" in text


def test_data_prepare_prints_the_caption_check_for_the_model_it_will_feed(tmp_path, capsys):
    from crowdtrain.cli import main

    folder = tmp_path / "mine"
    shapes.write_shapes_folder(folder, num=6, seed=3, progress=False)
    for i, caption in enumerate(["thumbs up sign with medium dark skin tone and a grinning face"] * 3):
        (folder / f"{i:06d}.txt").write_text(caption)
    assert main(["data", "prepare", "--input", str(folder), "--out", str(tmp_path / "s"), "--image-tokenizer",
                 "shapes", "--text-len", "12"]) == 0  # the shapes captions fit in 12 tokens
    out = capsys.readouterr().out
    assert "captions: 6 with the text tokenizer (the shipped shapes tokenizer)" in out and "--text-len 12" in out
    assert "3 of 6 captions (50.0%) are longer than 12 tokens" in out and "crowdtrain tokenizer train-text" in out
    assert "(train split, a random sample of 6, seed 0)" in out and (tmp_path / "s" / "fit_report-train.png").is_file()
    assert not (tmp_path / "s" / "fit_report.png").exists()
    # The valid split gets its own picture, and the demo preset's length when no --text-len is given.
    assert main(["data", "prepare", "--input", str(folder), "--out", str(tmp_path / "s"), "--image-tokenizer",
                 "shapes", "--split", "valid"]) == 0
    out = capsys.readouterr().out
    assert "the demo preset's text_len" in out and (tmp_path / "s" / "fit_report-valid.png").is_file()
    # A wrong tokenizer is said before the encoding pass: nothing is written.
    assert main(["data", "prepare", "--input", str(folder), "--out", str(tmp_path / "t"), "--text-tokenizer",
                 str(tmp_path / "missing.json")]) == 2
    assert "crowdtrain tokenizer train-text" in capsys.readouterr().err and not (tmp_path / "t").exists()


# ---- /samples -------------------------------------------------------------------------------------

def gallery(tmp_path, prompts: list[tuple[str, str | None]], *, missing: str | None = None) -> str:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "swarm": {}, "task": {}}))
    (run_dir / "sample_prompts.json").write_text(json.dumps([{"prompt": p, "tag": t} for p, t in prompts]))
    store = Store(f"sqlite:///{run_dir / 'coordinator.sqlite'}")
    try:
        for name, epoch in (("step-0000005", 5), ("step-0000010", 10)):
            folder = run_dir / "samples" / name
            folder.mkdir(parents=True)
            for i, (prompt, tag) in enumerate(prompts):
                if name != missing:
                    (folder / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n")
                store.record_sample(checkpoint=name, epoch=epoch, prompt=prompt, path=f"samples/{name}/{i}.png",
                                    tag=tag)
        app = create_app(run_dir, store=store, auth=AuthSettings(key_path=tmp_path / "key.pem"))
        return " ".join(TestClient(app).get("/samples").text.split())
    finally:
        store.close()


def test_samples_explain_colours_and_shapes_only_for_the_shapes_prompts(tmp_path):
    from crowdtrain.data.sample_prompts import shapes_prompts

    shapes_html = gallery(tmp_path / "a", [(p["prompt"], p["tag"]) for p in shapes_prompts()])
    assert "combine colours and shapes" in shapes_html
    emoji_html = gallery(tmp_path / "b", [("grinning face", "seen"), ("thumbs up: dark skin tone", "held-out")])
    assert "colour" not in emoji_html and "shape" not in emoji_html.lower()
    assert "The organizer tagged the prompts" in emoji_html and "generalizes" in emoji_html
    plain = gallery(tmp_path / "c", [("grinning face", None)])
    assert "organizer tagged" not in plain and "colours" not in plain


def test_samples_list_no_checkpoint_before_all_its_images_exist(tmp_path):
    html = gallery(tmp_path, [("grinning face", None), ("red heart", None)], missing="step-0000010")
    assert "Epoch 5" in html and "Epoch 10" not in html and "step-0000010" not in html


def test_the_aux_peer_records_a_checkpoints_samples_once_all_are_drawn():
    """The gallery's rows are written after the last image (the order in make_samples), so a page
    read while they are being drawn lists none of them."""
    import inspect

    from crowdtrain.auxpeer import AuxPeer

    source = inspect.getsource(AuxPeer.make_samples)
    assert source.index("record_sample") > source.index('"prompts.json"') > source.index("grid.save(path)")


# ---- the guide ------------------------------------------------------------------------------------

def test_the_organizers_guide_covers_splits_threads_and_the_schedule(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        html = TestClient(create_app(tmp_path, store=store, auth=AuthSettings(key_path=tmp_path / "k.pem"))
                          ).get("/organize").text
    finally:
        store.close()
    for phrase in ("--split valid", "--split heldout", "--threads N", "--time-budget", "fit_report-train.png",
                   "total_epochs", "has finished", "crowdtrain eval", "--text-len"):
        assert phrase in html, phrase
    assert re.search(r"extend", html)
