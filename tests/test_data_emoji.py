"""The emoji data set (real pictures from Debian's fonts-noto-color-emoji) and its judge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.data import emoji
from crowdtrain.data.emoji import TONES, Composition, EmojiFont, make_emoji_set, render
from crowdtrain.data.emoji_judge import EmojiJudge

# The learned tokenizer `crowdtrain demo --data emoji` trains with the default recipe (hands,
# 200 renderings, seed 0, 3000 steps): what the judge must read through.
EMOJI_VQ = Path(__file__).parent / "data" / "emoji_vq.safetensors"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Two torch threads on two busy cores wait on each other (a 5 s test took 100 s): one each."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def font():
    return EmojiFont()


@pytest.fixture(scope="module")
def hands(font):
    return make_emoji_set(font, bases="hands", renderings=2)


@pytest.fixture(scope="module")
def judge(font, hands):
    return EmojiJudge(hands, font)


# ---- captions and bases -------------------------------------------------------------------

def test_captions_read_as_words_and_fit_the_demo_models_text_length(font):
    from crowdtrain.data.tokenizers import train_text_tokenizer
    from crowdtrain.model.config import get_preset

    assert emoji.caption(0x1F44B, 3) == "waving hand, medium skin tone"
    assert emoji.caption(0x1F44D, 0) == "thumbs up, yellow skin tone"
    # 'WHITE UP POINTING INDEX': 'white' is the outline there, not a skin colour.
    assert emoji.caption(0x261D, 5) == "up pointing index, dark skin tone"
    assert emoji.caption(0x1F6CC, 1) == "person in bed, light skin tone"
    everything = make_emoji_set(font, bases="all", renderings=1)
    seen, heldout = everything.compositions
    captions = [c.caption for c in seen]
    assert len(set(captions)) == len(captions)  # one caption, one composition
    tok = train_text_tokenizer(captions, vocab_size=emoji.TEXT_VOCAB_SIZE)
    demo = get_preset("demo")
    assert tok.vocab_size <= demo.text_vocab_size
    lengths = [len(tok.tokenizer.encode(c.caption, add_special_tokens=False).ids) for c in seen + heldout]
    assert max(lengths) <= demo.text_len, max(lengths)
    # Trained on the seen captions only, the tokenizer still knows every word of the held-out ones.
    unk = tok.tokenizer.token_to_id("[UNK]")
    assert all(unk not in tok.tokenizer.encode(c.caption, add_special_tokens=False).ids for c in heldout)


def test_the_bases_are_what_the_font_draws_in_six_tones(font):
    bases = set(font.bases())
    assert {0x1F44B, 0x1F44D, 0x270C, 0x1F469, 0x1F3C4} <= bases
    assert 0x1F600 not in bases  # a face: no skin-tone form
    assert 0x1F3C2 not in bases  # the snowboarder: the font joins the modifier but draws the same picture
    assert 0x1F595 not in bases  # left out on purpose
    # The named groups hold nothing the font cannot tone (a wrong entry in the lists fails here).
    import unicodedata
    listed = {cp for cp in (*emoji.HANDS, *emoji.PEOPLE) if unicodedata.name(chr(cp), None)}
    assert listed <= bases, sorted(hex(cp) for cp in listed - bases)
    # Each tone is one glyph, a different picture from the plain base.
    waving = [np.asarray(font.glyph(Composition(0x1F44B, t).text)) for t in range(len(TONES))]
    assert all(w.shape == waving[0].shape for w in waving)
    assert len({w.tobytes() for w in waving}) == len(TONES)
    # 46 and 96 with Python 3.11's Unicode 14 names; a newer Python names a few more emoji.
    assert set(make_emoji_set(font, bases="hands").bases) == set(emoji.HANDS) & bases
    assert set(make_emoji_set(font, bases="hands+people").bases) == set(emoji.HANDS + emoji.PEOPLE) & bases
    assert len(make_emoji_set(font, bases="all").bases) == len(bases)
    assert len(make_emoji_set(font, bases="hands", max_bases=6).bases) == 6
    with pytest.raises(ValueError, match="unknown group"):
        make_emoji_set(font, bases="feet")


def test_a_missing_font_names_the_package_to_install(tmp_path, monkeypatch):
    missing = tmp_path / "NotoColorEmoji.ttf"
    with pytest.raises(FileNotFoundError, match="sudo apt-get install fonts-noto-color-emoji"):
        EmojiFont(missing)
    monkeypatch.setenv(emoji.FONT_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match="fonts-noto-color-emoji"):
        emoji.ensure_emoji_shards(tmp_path / "out", cache=False)


# ---- splits -------------------------------------------------------------------------------

def test_splits_hold_out_one_tone_per_base_and_see_every_base_and_tone(font):
    small = make_emoji_set(font, bases="hands", max_bases=8, renderings=2, seed=3)
    seen, heldout = small.compositions
    assert len(heldout) == 8 and len(seen) == 8 * 5
    train = [c for _, _, c in small.pictures(font, "train")]
    valid = [c for _, _, c in small.pictures(font, "valid")]
    held = [c for _, _, c in small.pictures(font, "heldout")]
    assert len(train) == len(seen) * 2 and set(train) == set(seen)
    assert set(valid) == set(seen) and set(held) == set(heldout)
    assert not set(heldout) & (set(train) | set(valid))
    assert {c.codepoint for c in train} == set(small.bases)  # every base seen in training ...
    assert {c.tone for c in train} == set(range(len(TONES)))  # ... and every tone
    assert {c.tone for c in heldout} == set(range(len(TONES)))  # every tone held out for some base
    # Valid renderings are fresh: no picture of valid is a picture of train.
    train_pixels = {im.tobytes() for im, _, _ in small.pictures(font, "train")}
    assert not any(im.tobytes() in train_pixels for im, _, _ in small.pictures(font, "valid"))
    # The train split is shuffled: its first shard is not one composition after another.
    assert len(set(train[:10])) > 5


def test_the_set_is_deterministic_from_its_seed(font):
    a = make_emoji_set(font, bases="hands", max_bases=12, renderings=1, seed=0)
    b = make_emoji_set(font, bases="hands", max_bases=12, renderings=1, seed=0)
    c = make_emoji_set(font, bases="hands", max_bases=12, renderings=1, seed=1)
    pictures = [[(im.tobytes(), text) for im, text, _ in s.pictures(font, "train")] for s in (a, b, c)]
    assert pictures[0] == pictures[1]
    assert pictures[0] != pictures[2]
    assert a.compositions == b.compositions and a.compositions[1] != c.compositions[1]
    # The record in shards.json rebuilds the same set (what the judge reads).
    record = json.loads(json.dumps(a.record("hands", 12)))
    assert emoji.emoji_set_from_record(record).compositions == a.compositions


def test_jitter_moves_and_scales_the_emoji(font):
    rng = np.random.default_rng(0)
    places, sizes = set(), set()
    for _ in range(20):
        ink = render(font, Composition(0x1F44B, 2), rng).min(axis=2) < 215
        rows, cols = np.nonzero(ink)
        places.add((rows.min(), cols.min()))
        sizes.add(rows.max() - rows.min())
    assert len(places) >= 15 and len(sizes) >= 8


# ---- the shards, made once ----------------------------------------------------------------

def test_emoji_shards_are_made_once_with_their_tokenizers_and_reused(tmp_path, monkeypatch):
    from crowdtrain.data.shards import read_manifest
    from crowdtrain.data.streaming import list_shards
    import pyarrow.parquet as pq

    cache = tmp_path / "cache"
    kwargs = dict(bases="hands", max_bases=6, renderings=2, vq_steps=4, cache=cache)
    first = emoji.ensure_emoji_shards(tmp_path / "run1" / "emoji", **kwargs)
    manifest = read_manifest(first)
    record = manifest["dataset"]
    assert record["name"] == "emoji" and len(record["bases"]) == 6
    assert record["compositions"] == {"seen": 30, "heldout": 6}
    assert record["caption_tokens_max"] <= 32
    assert (first / record["image_tokenizer"]).is_file() and (first / record["text_tokenizer"]).is_file()
    assert set(emoji.emoji_tokenizers(first)) == {"image", "text"}
    assert record["tokenizer_report"]["psnr_db_valid"] > 0
    rows = {s: [c for f in list_shards(str(first), s) for c in pq.read_table(f)["caption"].to_pylist()]
            for s in ("train", "valid", "heldout")}
    assert [len(rows[s]) for s in ("train", "valid", "heldout")] == [60, 30 * 9, 6 * emoji.HELDOUT_RENDERINGS]
    assert not set(rows["heldout"]) & set(rows["train"])
    assert not (first / "pictures").exists()  # the work folder is gone
    assert len([p for p in (cache / "demo-shards").iterdir() if p.is_dir()]) == 1

    def no_build(*args, **kwargs):
        raise AssertionError("the emoji set was made again instead of reused")
    monkeypatch.setattr(emoji, "_make", no_build)
    assert emoji.ensure_emoji_shards(first, **kwargs) == first
    second = emoji.ensure_emoji_shards(tmp_path / "run2" / "emoji", **kwargs)
    assert (second / "train-00000.parquet").read_bytes() == (first / "train-00000.parquet").read_bytes()
    assert (second / emoji.IMAGE_TOKENIZER_FILE).read_bytes() == (first / emoji.IMAGE_TOKENIZER_FILE).read_bytes()
    with pytest.raises(AssertionError, match="made again"):  # another recipe: another entry
        emoji.ensure_emoji_shards(tmp_path / "run3" / "emoji", **{**kwargs, "renderings": 3})


def test_an_interrupted_build_leaves_nothing_that_passes_for_finished(tmp_path, monkeypatch):
    import torch

    from crowdtrain.data import vq_train

    kwargs = dict(bases="hands", max_bases=6, renderings=1, vq_steps=4, cache=tmp_path / "cache")
    threads = []

    def interrupted(*args, **kwargs):
        threads.append(torch.get_num_threads())
        raise KeyboardInterrupt
    monkeypatch.setattr(vq_train, "train_vq", interrupted)
    torch.set_num_threads(2)
    with pytest.raises(KeyboardInterrupt):
        emoji.ensure_emoji_shards(tmp_path / "run" / "emoji", **kwargs)
    # The tokenizer trains on one thread (the same file on any machine), and the caller's count is back.
    assert threads == [emoji.TORCH_THREADS] and torch.get_num_threads() == 2
    assert [p for p in (tmp_path / "cache" / "demo-shards").iterdir()] == []  # the private folder is gone
    monkeypatch.undo()
    out = emoji.ensure_emoji_shards(tmp_path / "run" / "emoji", **kwargs)
    assert (out / emoji.MARKER).is_file()


def test_cli_draws_the_pictures_with_captions_and_prompts(tmp_path, capsys):
    from crowdtrain.cli import main
    from crowdtrain.data.sample_prompts import read_prompt_file

    out = tmp_path / "emoji"
    assert main(["data", "emoji", "--out", str(out), "--max-bases", "6", "--renderings", "2", "--seed", "1"]) == 0
    assert "30 seen and 6 held-out compositions" in capsys.readouterr().out
    pngs = {s: sorted((out / s).glob("*.png")) for s in ("train", "valid", "heldout")}
    assert [len(pngs[s]) for s in pngs] == [60, 30 * 9, 6 * emoji.HELDOUT_RENDERINGS]
    captions = {s: {p.with_suffix(".txt").read_text().strip() for p in pngs[s]} for s in pngs}
    assert all(c.endswith(" skin tone") for c in captions["train"])
    assert not captions["heldout"] & captions["train"]
    prompts = read_prompt_file(out / "sample_prompts.txt")
    assert {p["tag"] for p in prompts} == {"seen", "held-out"}
    assert all(p["prompt"] in captions["heldout"] for p in prompts if p["tag"] == "held-out")
    assert main(["data", "emoji", "--out", str(out), "--bases", "faces"]) == 2
    assert "unknown group(s) ['faces']" in capsys.readouterr().err


# ---- the judge ----------------------------------------------------------------------------

def _fresh_pictures(font, comps, seed: int = 99) -> np.ndarray:
    """Jittered renderings the judge never saw (its references are the centred ones)."""
    rng = np.random.default_rng(seed)
    return np.stack([render(font, c, rng) for c in comps])


def _pass_rates(judge, comps, images) -> dict:
    verdicts = {"seen": [], "heldout": []}
    for c, im in zip(comps, images):
        verdicts["heldout" if c in judge.heldout_set else "seen"] += judge.judge(c.caption, im[None])
    return {g: {k: float(np.mean([v[k] for v in vs])) for k in ("all", "top5", "both_right")}
            for g, vs in verdicts.items()}


def test_the_judges_prompts_spread_over_bases_and_tones(judge):
    prompts = judge.prompts()
    assert [len(prompts[g]) for g in ("seen", "heldout")] == [8, 8]
    seen = [judge.composition(p) for p in prompts["seen"]]
    held = [judge.composition(p) for p in prompts["heldout"]]
    assert not set(seen) & judge.heldout_set and set(held) <= judge.heldout_set
    assert {c.tone for c in seen} == {c.tone for c in held} == set(range(len(TONES)))
    assert len({c.codepoint for c in seen + held}) >= 12
    assert prompts == EmojiJudge(judge.emoji_set, judge.font).prompts()  # deterministic
    with pytest.raises(ValueError, match="no caption of this emoji data set"):
        judge.judge("a red circle", np.zeros((1, 64, 64, 3), np.uint8))


def test_the_judge_recognises_real_pictures_it_never_saw(font, judge):
    # Every composition of the set, seen and held-out, in a fresh jittered rendering: measured
    # all = 1.00 on the 230 seen and the 46 held-out pictures.
    comps = judge.references
    rates = _pass_rates(judge, comps, _fresh_pictures(font, comps))
    assert rates["seen"]["all"] >= 0.98 and rates["heldout"]["all"] >= 0.98, rates


def test_the_judge_recognises_pictures_through_the_learned_tokenizer(font, judge):
    # What the tokenizer gives back is the best a model can draw. Measured with the shipped
    # fixture (the demo's 3000-step tokenizer, PSNR 25.4 dB on valid): all = 1.00 seen and
    # held-out, top-5 1.00.
    from crowdtrain.data.image_tokenizer import load_image_tokenizer

    tokenizer = load_image_tokenizer(EMOJI_VQ)
    comps = judge.references
    real = _fresh_pictures(font, comps)
    rates = _pass_rates(judge, comps, tokenizer.decode(tokenizer.encode(real)).numpy())
    assert rates["seen"]["all"] >= 0.95 and rates["heldout"]["all"] >= 0.95, rates
    assert rates["seen"]["top5"] >= 0.98 and rates["heldout"]["both_right"] >= 0.95, rates


def test_a_picture_of_another_tone_or_base_fails(font, judge, hands):
    from crowdtrain.data.image_tokenizer import load_image_tokenizer

    tokenizer = load_image_tokenizer(EMOJI_VQ)
    comps = judge.references[::3]
    real = _fresh_pictures(font, comps, seed=7)
    rng = np.random.default_rng(5)
    for images in (real, tokenizer.decode(tokenizer.encode(real)).numpy()):
        wrong_tone, wrong_base = [], []
        for c, im in zip(comps, images):
            for t in range(len(TONES)):
                if t != c.tone:
                    wrong_tone += judge.judge(Composition(c.codepoint, t).caption, im[None])
            other = int(rng.choice([b for b in hands.bases if b != c.codepoint]))
            wrong_base += judge.judge(Composition(other, c.tone).caption, im[None])
        # Measured: 0 of 460 wrong-tone prompts pass, real or through the tokenizer.
        assert np.mean([v["all"] for v in wrong_tone]) <= 0.01
        # Measured ~3% of random other bases pass as seen prompts: look-alikes (raised hand and
        # raised back of hand) fall among the 5 nearest, which is all a seen prompt asks.
        assert np.mean([v["all"] for v in wrong_base]) <= 0.08
        assert not any(v["both_right"] for v in wrong_base)
    # A clearly different base never passes: a thumbs up asked to be an ear.
    thumbs = _fresh_pictures(font, [Composition(0x1F44D, t) for t in range(len(TONES))])
    assert not any(v["all"] for t in range(len(TONES)) for v in judge.judge(Composition(0x1F442, t).caption, thumbs))


def test_blank_and_noise_images_pass_nothing(judge):
    rng = np.random.default_rng(0)
    images = np.concatenate([np.full((1, 64, 64, 3), 255, np.uint8), np.full((1, 64, 64, 3), 128, np.uint8),
                             rng.integers(0, 256, (16, 64, 64, 3), dtype=np.uint8)])
    stray = np.full((1, 64, 64, 3), 255, np.uint8)
    stray[0, rng.integers(0, 64, 6), rng.integers(0, 64, 6)] = 40  # a few dark pixels on white
    images = np.concatenate([images, stray])
    for b in judge.emoji_set.bases:  # whatever it is asked for: each base, in some tone
        c = Composition(b, b % len(TONES))
        verdicts = judge.judge(c.caption, images)
        assert not any(v[k] for v in verdicts for k in ("all", "top5", "base_right", "tone_right", "tone_of_base"))
        assert all(v["nearest"] is None for v in verdicts)  # no emoji of the set


# ---- crowdtrain demo --data emoji ---------------------------------------------------------

TINY = dict(bases="hands", max_bases=6, renderings=2, vq_steps=4, cache=False)


def test_the_demo_gives_the_coordinator_the_runs_tokenizers_and_the_judges_prompts(tmp_path):
    from crowdtrain.coordinator.run import CoordinatorConfig, build_spec, resolve_shards
    from crowdtrain.train.demo import EMOJI_SAMPLE_PROMPTS, emoji_run_data

    data, args = emoji_run_data(tmp_path, TINY)
    flags = dict(zip(args[::2], args[1::2]))
    assert set(flags) == {"--image-tokenizer", "--text-tokenizer", "--sample-prompts"}
    config = CoordinatorConfig(run_id="t", data=data, run_dir=str(tmp_path / "run"),
                               image_tokenizer=flags["--image-tokenizer"], text_tokenizer=flags["--text-tokenizer"],
                               sample_prompts=flags["--sample-prompts"])
    spec = build_spec(config, resolve_shards(config))
    assert spec["task"]["model"]["image_vocab_size"] == 512  # the learned tokenizer's, not the shapes palette's
    assert spec["assets"] == {"text_tokenizer.json": flags["--text-tokenizer"],
                              "image_tokenizer.safetensors": flags["--image-tokenizer"]}
    prompts = EmojiJudge.from_shards(data).prompts()
    assert spec["sample_prompts"] == ([{"prompt": p, "tag": "seen"} for p in prompts["seen"][:EMOJI_SAMPLE_PROMPTS]]
                                      + [{"prompt": p, "tag": "held-out"}
                                         for p in prompts["heldout"][:EMOJI_SAMPLE_PROMPTS]])


def test_a_checkpoint_trained_on_emoji_is_scored_by_the_judge(tmp_path):
    """The demo's evaluation finds the emoji judge through the shards' record (as `crowdtrain eval`)."""
    from crowdtrain.train.demo import evaluate_run, run_local_demo

    summary = run_local_demo(minutes=0.05, out_dir=str(tmp_path / "local"), device="cpu", batch_size=8,
                             data="emoji", data_options=TINY)
    shards = tmp_path / "local" / "data" / "emoji"
    result = evaluate_run(summary["checkpoint"], str(shards), samples_per_prompt=1, max_rows=16)
    assert result["held_out_losses"]["valid"] > 0 and result["held_out_losses"]["heldout"] > 0
    assert result["judge"] == "emoji"
    groups = result["adherence_groups"]
    assert set(groups) == {"seen", "heldout"} and {"top5", "both_right", "tone_right"} <= set(groups["seen"])
    assert 0 <= result["adherence_seen"] <= 1 and result["adherence_seen"] == groups["seen"]["adherence"]
    assert {p["prompt"] for p in result["adherence_per_prompt"]} == {
        p for ps in EmojiJudge.from_shards(shards).prompts().values() for p in ps}


def test_demo_cli_takes_the_data_set_and_its_options(monkeypatch, capsys):
    from crowdtrain.cli import main
    from crowdtrain.train import demo

    calls = []
    monkeypatch.setattr(demo, "run_swarm_demo", lambda **kwargs: calls.append(kwargs))
    assert main(["demo", "--data", "emoji", "--emoji-bases", "hands+people", "--emoji-renderings", "50"]) == 0
    assert calls[-1]["data"] == "emoji" and calls[-1]["data_options"] == {"bases": "hands+people", "renderings": 50}
    assert main(["demo"]) == 0
    assert calls[-1]["data"] == "shapes" and calls[-1]["data_options"] == {}
    assert main(["demo", "--emoji-bases", "hands"]) == 2
    assert "go with --data emoji" in capsys.readouterr().err


def test_an_interrupted_tokenizer_training_continues_where_it_stopped(tmp_path, monkeypatch):
    from crowdtrain.data import vq_train

    kwargs = dict(bases="hands", max_bases=6, renderings=2, vq_steps=6)
    straight = emoji.ensure_emoji_shards(tmp_path / "a" / "emoji", cache=tmp_path / "cache-a", **kwargs)

    real_train_vq = vq_train.train_vq
    monkeypatch.setattr(vq_train, "train_vq", lambda *a, **k: real_train_vq(*a, **k, stop_after_steps=3))
    with pytest.raises(vq_train.TrainingInterrupted, match="stopped at step 3 of 6"):
        emoji.ensure_emoji_shards(tmp_path / "b" / "emoji", cache=tmp_path / "cache-b", **kwargs)
    kept = list((tmp_path / "cache-b" / "demo-shards").iterdir())
    assert [p.name.endswith(".vq-resume.safetensors") for p in kept] == [True]  # only the tokenizer's state
    monkeypatch.undo()
    resumed = emoji.ensure_emoji_shards(tmp_path / "b" / "emoji", cache=tmp_path / "cache-b", **kwargs)
    # As if never stopped: the same tokenizer, so the same shards.
    assert (resumed / emoji.IMAGE_TOKENIZER_FILE).read_bytes() == (straight / emoji.IMAGE_TOKENIZER_FILE).read_bytes()
    assert (resumed / "train-00000.parquet").read_bytes() == (straight / "train-00000.parquet").read_bytes()
    assert not any(p.name.endswith(".vq-resume.safetensors") for p in (tmp_path / "cache-b" / "demo-shards").iterdir())


def test_the_emoji_shards_name_their_judge_for_crowdtrain_eval(tmp_path, font):
    """``crowdtrain eval`` and the demo find the emoji judge from the shards' dataset record alone."""
    from crowdtrain.data import judges
    from crowdtrain.data.emoji_judge import EmojiJudge

    emoji_set = make_emoji_set(font, bases="hands", max_bases=12, renderings=1, seed=3)
    (tmp_path / "shards.json").write_text(json.dumps({"format": "crowdtrain-shards/1", "splits": {},
                                                      "dataset": emoji_set.record("hands", 12)}))
    judge = judges.judge_for_data(tmp_path)
    assert isinstance(judge, EmojiJudge) and isinstance(judge, judges.Judge)
    # The judge holds out what this set held out (seed 3), not the default set's compositions.
    assert {judge.by_caption[p] for p in judge.prompts()["heldout"]} <= set(emoji_set.compositions[1])


def test_the_demo_grid_shows_each_prompts_real_picture_first(tmp_path, judge, font):
    """For a held-out composition the grid's first picture is one the model never saw: the real emoji."""
    prompt = judge.prompts()["heldout"][0]
    real = judge.reference(prompt)
    assert real.shape == (64, 64, 3) and real.dtype == np.uint8
    assert judge.judge(prompt, real[None])[0]["both_right"]  # it is that composition
