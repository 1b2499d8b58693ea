"""A run's own sample prompts (--sample-prompts, or captions of its data), the gallery drawn from
them, and the start-up check that the run's tokenizers fit its model."""

from __future__ import annotations

import html as html_lib
import json
import sqlite3

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from crowdtrain.checkpoint import save_checkpoint
from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.run import CoordinatorConfig, build_spec, sample_prompts_for
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.data.image_tokenizer import load_image_tokenizer
from crowdtrain.data.sample_prompts import data_prompts, read_prompt_file
from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER
from crowdtrain.model.config import get_preset
from crowdtrain.model.transformer import DalleTransformer

from ._data_helpers import make_stripes_shards, shard_rows

@pytest.fixture(scope="module")
def stripes(tmp_path_factory):
    """A non-shapes shard folder (train and valid) and the VQ it was coded with."""
    return make_stripes_shards(tmp_path_factory.mktemp("stripes"))


def test_a_prompts_file_takes_one_prompt_a_line_with_optional_tags(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("# what the gallery draws\n\na red apple on a table\n[held-out]  a blue apple on a table\n"
                 "[] an untagged one\n")
    assert read_prompt_file(f) == [{"prompt": "a red apple on a table", "tag": None},
                                   {"prompt": "a blue apple on a table", "tag": "held-out"},
                                   {"prompt": "an untagged one", "tag": None}]
    for text, says in [("[held-out a blue apple\n", "line 1.*does not close"), ("ok\n[seen]\n", "line 2: a tag with no"),
                       ("# only comments\n\n", "holds no prompt"), ("x" * 400 + "\n", "line 1: the prompt has 400"),
                       ("\n".join(f"p{i}" for i in range(20)), "holds 20 prompts; at most 16"),
                       ("[" + "t" * 30 + "] p\n", "tags are short labels")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=says):
            read_prompt_file(f)
    f.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompt_file(f)
    with pytest.raises(FileNotFoundError, match="no such file; write one prompt a line"):
        read_prompt_file(tmp_path / "missing.txt")
    # The coordinator refuses a bad file at once, before it creates anything.
    f.write_text("[oops a prompt\n")
    with pytest.raises(ValueError, match="does not close"):
        CoordinatorConfig(run_dir=str(tmp_path / "run"), sample_prompts=str(f))
    assert not (tmp_path / "run").exists()


def test_own_data_samples_the_first_captions_of_its_valid_split_with_their_real_images(stripes, tmp_path):
    shards, vq = stripes
    valid = shard_rows(shards, "valid")
    prompts = data_prompts(shards)
    assert [p["prompt"] for p in prompts] == [r["caption"] for r in valid[:6]]
    assert all(p["tag"] is None and p["split"] == "valid" for p in prompts)
    assert prompts[0]["reference"] == np.frombuffer(valid[0]["code"], dtype="<i2").tolist()
    # No valid split: the train split's captions.
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    for f in shards.glob("train-*.parquet"):
        (only_train / f.name).write_bytes(f.read_bytes())
    assert [p["split"] for p in data_prompts(only_train, n=2)] == ["train", "train"]
    with pytest.raises(ValueError, match="pass --sample-prompts FILE"):
        data_prompts(tmp_path / "only_train" / "nothing-here")

    config = CoordinatorConfig(run_dir=str(tmp_path / "run"), data=str(shards), image_tokenizer=str(vq))
    assert sample_prompts_for(config, shards) == prompts
    spec = build_spec(config, shards)
    assert spec["sample_prompts"] == prompts and spec["task"]["model"]["image_vocab_size"] == 512
    # The shapes data (a folder the shapes generator made) keeps its seen and held-out prompts.
    (shards / "demo.json").write_text("{}")
    try:
        assert [p["tag"] for p in sample_prompts_for(config, shards)] == ["seen"] * 3 + ["held-out"] * 3
    finally:
        (shards / "demo.json").unlink()
    own = tmp_path / "own.txt"
    own.write_text("[mine] a green gradient\n")
    config = CoordinatorConfig(run_dir=str(tmp_path / "run"), data=str(shards), sample_prompts=str(own))
    assert sample_prompts_for(config, shards) == [{"prompt": "a green gradient", "tag": "mine"}]


def test_a_run_whose_tokenizers_do_not_fit_its_model_is_refused_naming_the_setting(stripes, tmp_path):
    shards, vq = stripes

    def spec(**kwargs):
        return build_spec(CoordinatorConfig(run_dir=str(tmp_path / "run"), data=str(shards), **kwargs), shards)

    with pytest.raises(ValueError, match=r"has 512 codes but the model draws 1000: use --model image_vocab_size=512"):
        spec(image_tokenizer=str(vq), model_overrides={"image_vocab_size": 1000, "image_code_factors": None})
    with pytest.raises(ValueError, match=r"8x8 codes per image but the model draws 16x16: add --model "
                                         r"image_height=8 --model image_width=8"):
        spec(image_tokenizer=str(vq), model_overrides={"image_height": 16, "image_width": 16})
    with pytest.raises(ValueError, match=r"has \d+ tokens but the model reads 50: add --model text_vocab_size="):
        spec(image_tokenizer=str(vq), model_overrides={"text_vocab_size": 50})
    # The shards say 512 codes; the shapes palette tokenizer has 1280: not the one they were made with.
    from crowdtrain.coordinator.run import ASSETS
    with pytest.raises(ValueError, match="512-code small_vq tokenizer.*pass --image-tokenizer FILE"):
        spec(image_tokenizer=str(ASSETS / "shapes_palette.safetensors"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        spec(image_tokenizer=str(vq), text_tokenizer=str(bad))
    with pytest.raises(FileNotFoundError, match="--image-tokenizer .*missing.safetensors: no such file"):
        CoordinatorConfig(run_dir=str(tmp_path / "run"), image_tokenizer=str(tmp_path / "missing.safetensors"))
    assert spec(image_tokenizer=str(vq))["task"]["model"]["image_code_factors"] is None


def test_the_checkpointer_draws_a_runs_own_prompts_after_their_real_images(stripes, tmp_path):
    from crowdtrain.auxpeer import AuxPeer

    shards, vq = stripes
    torch.manual_seed(0)
    config = get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=512)
    ckpt = save_checkpoint(tmp_path / "checkpoints" / "step-0000003", DalleTransformer(config), step=3, assets={
        "text_tokenizer.json": SHAPES_TEXT_TOKENIZER, "image_tokenizer.safetensors": vq})
    prompts = data_prompts(shards, n=2) + [{"prompt": "a green gradient", "tag": "mine"}]
    prompts[1]["reference"] = [9999] * 64  # a stranger's codes that the model cannot draw: no real image
    aux = AuxPeer.__new__(AuxPeer)
    aux.run_dir, aux.samples_possible, aux.model_config = tmp_path, True, config
    aux.spec = {"sample_prompts": prompts}
    aux.store = Store(f"sqlite:///{tmp_path / 'run.db'}")
    aux.make_samples(ckpt, epoch=3)
    rows = aux.store.samples()
    assert [(r["prompt"], r["tag"], r["reference"], r["held_out"]) for r in rows] == [
        (prompts[0]["prompt"], None, True, False), (prompts[1]["prompt"], None, False, False),
        ("a green gradient", "mine", False, False)]
    sizes = [Image.open(tmp_path / r["path"]).size for r in rows]
    assert sizes == [(3 * (5 * 66 + 2), 3 * 68), (3 * (4 * 66 + 2), 3 * 68), (3 * (4 * 66 + 2), 3 * 68)]
    first = np.asarray(Image.open(tmp_path / rows[0]["path"]))[::3, ::3]  # back to 1x
    real = load_image_tokenizer(vq).decode(torch.tensor(prompts[0]["reference"]).view(1, 8, 8))[0].numpy()
    assert (first[3:65, 3:65] == real[1:63, 1:63]).all()  # the real image, inside its frame
    index = json.loads((tmp_path / "samples" / "step-0000003" / "prompts.json").read_text())
    assert [(e["file"], e["tag"], e["first_is_real_image"]) for e in index] == [
        ("0.png", None, True), ("1.png", None, False), ("2.png", "mine", False)]
    aux.store.close()


def test_an_old_database_gets_the_new_columns_and_keeps_its_samples(tmp_path):
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.executescript("""
        CREATE TABLE checkpoints (name VARCHAR(64) PRIMARY KEY, epoch INTEGER, loss FLOAT, time FLOAT,
                                  files TEXT, pruned BOOLEAN);
        CREATE TABLE samples (id INTEGER PRIMARY KEY, checkpoint VARCHAR(64) REFERENCES checkpoints(name),
                              epoch INTEGER, prompt TEXT, path TEXT, held_out BOOLEAN, time FLOAT);
        INSERT INTO checkpoints VALUES ('step-1', 1, 2.0, 0, '[]', 0);
        INSERT INTO samples VALUES (1, 'step-1', 1, 'a red circle', 'samples/step-1/0.png', 0, 1.0);
        INSERT INTO samples VALUES (2, 'step-1', 1, 'a red triangle', 'samples/step-1/1.png', 1, 1.0);
    """)
    con.commit()
    con.close()
    store = Store(f"sqlite:///{db}")
    assert [(s["prompt"], s["tag"], s["reference"]) for s in store.samples()] == [
        ("a red circle", "seen", False), ("a red triangle", "held-out", False)]
    store.record_sample(checkpoint="step-1", epoch=1, prompt="stripes", path="samples/step-1/2.png", reference=True)
    assert store.samples()[-1]["tag"] is None and store.samples()[-1]["reference"] is True
    store.close()
    Store(f"sqlite:///{db}").close()  # a second start finds the columns there


def test_a_non_shapes_runs_pages_show_its_prompts_without_composition_tags(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "samples" / "step-0000004").mkdir(parents=True)
    store = Store(f"sqlite:///{run_dir / 'coordinator.sqlite'}")
    store.record_checkpoint(name="step-0000004", epoch=4, loss=1.0, files=["config.json", "model.safetensors"])
    evil = "stripes $(touch /tmp/pwned) 'quoted'"
    for i, (prompt, tag, ref) in enumerate([(evil, None, True), ("a green gradient", "mine", False)]):
        (run_dir / "samples" / "step-0000004" / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        store.record_sample(checkpoint="step-0000004", epoch=4, prompt=prompt,
                            path=f"samples/step-0000004/{i}.png", tag=tag, reference=ref)
    (run_dir / "sample_prompts.json").write_text(json.dumps([{"prompt": evil, "tag": None}]))
    client = TestClient(create_app(run_dir, store=store, public_url="http://127.0.0.1:8000",
                                   auth=AuthSettings(mode="open", key_path=tmp_path / "key.pem")))
    html = client.get("/samples").text
    assert "badge seen" not in html and "badge held-out" not in html and "never saw" not in html
    assert '<span class="badge tag">mine</span>' in html and "the first picture of its row" in html
    assert 'class="sample with-reference"' in html
    page = client.get("/checkpoints").text
    # The suggested command quotes the caption for the shell: a caption is a stranger's text.
    assert "crowdtrain generate --checkpoint step-0000004 &#39;stripes $(touch /tmp/pwned) &#39;&#34;&#39;&#34;&#39;quoted" in page
    assert "a small red circle" not in page
    store.close()


def test_the_memory_calculator_opens_on_the_runs_model_in_the_sites_style(stripes, tmp_path):
    from crowdtrain.runspec.swarm import laptop_swarm_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shards, vq = stripes
    spec = build_spec(CoordinatorConfig(run_dir=str(run_dir), data=str(shards), image_tokenizer=str(vq),
                                        swarm_preset="demo"), shards)
    (run_dir / "coordinator.json").write_text(json.dumps(spec))
    store = Store(f"sqlite:///{run_dir / 'c.sqlite'}")

    def page():
        app = create_app(run_dir, store=store, auth=AuthSettings(key_path=tmp_path / "key.pem"))
        return html_lib.unescape(TestClient(app).get("/memcalc/").text)

    html = page()  # sync mode, the demo preset: 8-bit LAMB offloaded
    assert "<option selected>crowdtrain-demo</option>" in html and "<option selected>8bit</option>" in html
    assert 'name="offload" checked' in html and "the demo preset's model, 8-bit LAMB, offloaded" in html
    assert '<link rel="stylesheet" href="/static/app.css">' in html and 'class="topbar"' in html
    assert '<a href="/memcalc/" aria-current="page">' in html and '<a href="/leaderboard"' in html
    spec["swarm"] = laptop_swarm_config().to_dict()  # DiLoCo with AdamW inner steps
    (run_dir / "coordinator.json").write_text(json.dumps(spec))
    html = page()
    assert "<option selected>fp32</option>" in html and 'name="offload" checked' not in html
    assert "AdamW (DiLoCo mode)" in html
    (run_dir / "coordinator.json").unlink()  # no run yet: the calculator's own default
    assert "<option selected>gpt2-large</option>" in page()
    store.close()
