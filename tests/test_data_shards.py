"""`data prepare`: inputs (folder, webdataset tar, parquet), shard layout, resume, skip summary."""

import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests._data_helpers import codes_of, random_vq, shard_rows
from crowdtrain.data import shapes
from crowdtrain.data.image_tokenizer import load_image_tokenizer
from crowdtrain.data.shards import COLUMNS, codes_to_bytes, prepare_shards

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def vq_path(tmp_path_factory):
    return random_vq(tmp_path_factory.mktemp("vq") / "vq.safetensors")


def _folder(tmp_path, num=25):
    d = tmp_path / "images"
    shapes.write_shapes_folder(d, num=num, seed=1, progress=False)
    # Three broken inputs, one of each kind of skip.
    (d / "000003.txt").unlink()  # missing caption
    (d / "000004.txt").write_text("   \n")  # empty caption
    (d / "000005.png").write_bytes(b"not a png at all")  # unreadable image
    return d


def test_prepare_folder_layout_codes_and_summary(tmp_path, vq_path):
    src = _folder(tmp_path)
    tok = load_image_tokenizer(vq_path)
    summary = prepare_shards(src, tmp_path / "out", tok, shard_size=10, progress=False)
    assert summary.rows == 22 and summary.shards_written == 3
    assert summary.skipped == {"missing caption (.txt)": 1, "empty caption": 1, "unreadable image (UnidentifiedImageError)": 1}
    text = summary.format()
    assert "skipped 3 items" in text and "unreadable image" in text
    # Each skipped file is named with its reason.
    assert "  000003.png: missing caption (.txt)" in text and "  000004.png: empty caption" in text
    assert "  000005.png: unreadable image (UnidentifiedImageError: cannot identify image file" in text
    assert summary.skipped_file is None and not (tmp_path / "out" / "skipped-train.txt").exists()
    files = sorted((tmp_path / "out").glob("train-*.parquet"))
    assert [f.name for f in files] == ["train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    pf = pq.ParquetFile(files[0])
    assert pf.schema_arrow.names == list(COLUMNS)
    assert pf.metadata.row_group(0).column(1).compression == "BROTLI"
    rows = shard_rows(tmp_path / "out")
    first = rows[0]
    assert first["url"] == "000000.png" and first["NSFW"] == "UNLIKELY"
    assert (first["original_width"], first["original_height"]) == (64, 64)
    assert first["caption"] == (src / "000000.txt").read_text().strip()
    image = np.asarray(Image.open(src / "000000.png"))
    expected = tok.encode(image[None])[0]
    assert len(first["code"]) == 64 * 2  # 8x8 int16
    assert codes_of(first["code"]) == tuple(expected.flatten().tolist())
    manifest = json.loads((tmp_path / "out" / "shards.json").read_text())
    assert manifest["image_tokenizer"]["grid"] == [8, 8] and len(manifest["splits"]["train"]) == 3


def test_prepare_resumes_after_interrupt(tmp_path, vq_path):
    src = _folder(tmp_path)
    tok = load_image_tokenizer(vq_path)
    out = tmp_path / "out"
    first = prepare_shards(src, out, tok, shard_size=10, progress=False, stop_after_shards=1)
    assert first.shards_written == 1
    done = out / "train-00000.parquet"
    mtime = done.stat().st_mtime_ns
    (out / "train-00001.parquet.tmp").write_bytes(b"half-written")  # what a kill leaves behind
    second = prepare_shards(src, out, tok, shard_size=10, progress=False)
    assert second.shards_resumed == 1 and second.shards_written == 2
    assert done.stat().st_mtime_ns == mtime  # not redone
    assert second.rows == 22 and sum(second.skipped.values()) == 3  # summary covers the resumed shard too
    assert sorted(source for source, _ in second.skipped_items) == ["000003.png", "000004.png", "000005.png"]
    fresh = prepare_shards(src, tmp_path / "fresh", tok, shard_size=10, progress=False)
    assert shard_rows(out) == shard_rows(tmp_path / "fresh")
    assert fresh.rows == second.rows
    # A different tokenizer must not be mixed into the same folder.
    other = load_image_tokenizer(random_vq(tmp_path / "other.safetensors", seed=1))
    with pytest.raises(ValueError, match="another image tokenizer"):
        prepare_shards(src, out, other, shard_size=10, progress=False)


def test_prepare_webdataset_tar(tmp_path, vq_path):
    tar_path = tmp_path / "data.tar"
    samples = list(shapes.generate_samples(6, seed=2))
    with tarfile.open(tar_path, "w") as tar:
        for i, (image, caption, _) in enumerate(samples):
            buf = io.BytesIO()
            Image.fromarray(image).resize((96, 80)).save(buf, format="JPEG")
            members = {f"s{i:03d}.jpg": buf.getvalue()}
            if i == 1:
                members[f"s{i:03d}.json"] = json.dumps({"caption": caption, "NSFW": "UNSURE"}).encode()
            elif i != 2:  # sample 2 has no caption at all
                members[f"s{i:03d}.txt"] = caption.encode()
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    summary = prepare_shards(tar_path, tmp_path / "out", load_image_tokenizer(vq_path), progress=False)
    assert summary.rows == 5 and summary.skipped == {"missing caption": 1}
    rows = shard_rows(tmp_path / "out")
    assert [r["caption"] for r in rows] == [samples[i][1] for i in (0, 1, 3, 4, 5)]
    assert rows[1]["NSFW"] == "UNSURE" and rows[0]["NSFW"] == "UNLIKELY"
    assert (rows[0]["original_width"], rows[0]["original_height"]) == (96, 80)  # size before resizing
    assert rows[0]["url"] == "data.tar/s000"


def test_prepare_parquet_of_image_bytes_via_cli(tmp_path, vq_path, capsys):
    samples = list(shapes.generate_samples(5, seed=3))
    images = []
    for image, _, _ in samples:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        images.append({"bytes": buf.getvalue(), "path": None})
    images[4] = {"bytes": b"\x89PNG broken", "path": None}
    table = pa.table({"image": images, "caption": [c for _, c, _ in samples]})
    pq.write_table(table, tmp_path / "in.parquet")
    from crowdtrain.cli import main

    rc = main(["data", "prepare", "--input", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "out"),
               "--image-tokenizer", str(vq_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "4 rows" in out and "unreadable image" in out
    rows = shard_rows(tmp_path / "out")
    assert [r["caption"] for r in rows] == [c for _, c, _ in samples[:4]]


def test_codes_bytes_are_little_endian_int16():
    blob = codes_to_bytes(np.array([[1, 8191], [256, 0]]))
    assert blob == b"\x01\x00\xff\x1f\x00\x01\x00\x00"
    with pytest.raises(ValueError):
        codes_to_bytes(np.array([40000]))


# ---- the demo shards: made once, then reused from the cache ---------------------------------

def test_demo_shards_are_made_once_and_reused_from_the_cache(tmp_path, monkeypatch):
    from crowdtrain.data import demo
    from crowdtrain.data.streaming import list_shards

    cache = tmp_path / "cache"
    first = demo.ensure_demo_shards(tmp_path / "run1" / "shapes", num_train=300, cache=cache)
    manifest = json.loads((first / "shards.json").read_text())
    assert sorted(manifest["splits"]) == ["heldout", "train", "valid"]
    captions = {split: [c for f in list_shards(str(first), split) for c in pq.read_table(f)["caption"].to_pylist()]
                for split in manifest["splits"]}
    assert [len(captions[s]) for s in ("train", "valid", "heldout")] == [300, demo.VALID_SIZE, demo.HELDOUT_SIZE]
    held = {s: [shapes.parse_caption(c).is_heldout for c in captions[s]] for s in captions}
    assert not any(held["train"]) and not any(held["valid"]) and all(held["heldout"])
    assert not set(captions["valid"]) <= set(captions["train"])  # fresh images, not copies of training ones
    assert len(list((cache / "demo-shards").iterdir())) == 1

    # From now on nothing may be generated: the same folder and a new one both come from the cache.
    def no_generation(*args, **kwargs):
        raise AssertionError("demo shards were generated again instead of reused")
    monkeypatch.setattr(demo, "prepare_shards", no_generation)
    assert demo.ensure_demo_shards(first, num_train=300, cache=cache) == first
    second = demo.ensure_demo_shards(tmp_path / "run2" / "shapes", num_train=300, cache=cache)
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())
    assert (second / "train-00000.parquet").read_bytes() == (first / "train-00000.parquet").read_bytes()
    # Another recipe is another cache entry: it must be generated.
    with pytest.raises(AssertionError, match="generated again"):
        demo.ensure_demo_shards(tmp_path / "run3" / "shapes", num_train=301, cache=cache)


def test_a_cache_entry_is_made_by_one_maker_while_a_second_waits_for_it(tmp_path):
    """Two makers of one entry at once (threads here: the lock is per open file, as between
    processes): the second waits for the first and reuses its entry instead of making it again."""
    import logging
    import threading

    from crowdtrain.data import demo

    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for it to finish" in record.getMessage():
                waiting.set()

    made = []

    def make(folder, _entry):
        made.append(threading.current_thread().name)
        started.set()
        # Hold the entry until the second maker has found it busy (it says so before it waits).
        assert waiting.wait(30), "the second maker did not wait for the first"
        (folder / "data.txt").write_text("rows")
        (folder / "done.json").write_text("{}")

    def finished(folder):
        return (folder / "done.json").is_file()

    def build(name, results):
        results[name] = demo.build_cached(tmp_path / name, cache_root=tmp_path / "cache", entry="set", recipe={"n": 1},
                                          marker="done.json", make=make, is_finished=finished,
                                          clear=lambda out: None, what="a test set")

    handler, logger = Waiting(), logging.getLogger(demo.__name__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    started, results = threading.Event(), {}
    try:
        first = threading.Thread(target=build, args=("first", results), name="first")
        first.start()
        assert started.wait(60)
        second = threading.Thread(target=build, args=("second", results), name="second")
        second.start()
        first.join(120)
        second.join(120)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert made == ["first"], made
    assert all((results[n] / "data.txt").read_text() == "rows" for n in ("first", "second")), results
    assert len(list((tmp_path / "cache" / "demo-shards").iterdir())) == 1  # one entry, no private folder left


def test_the_coordinators_shapes_data_comes_from_the_shared_cache_and_a_failed_build_says_so(tmp_path, monkeypatch,
                                                                                             capfd):
    """`crowdtrain coordinator --data shapes` makes the bundled set (50,000 images, minutes on a
    fresh machine) in a child process, or takes the shared cache's entry. The entry here is a
    small set filed under the 50,000-image recipe: the child's real lookup, links and hand-over,
    in seconds. Its log reaches the coordinator's stderr (a first build shows its progress)."""
    import shutil

    from crowdtrain.coordinator.run import CoordinatorConfig, ShapesBuildFailed, resolve_shards
    from crowdtrain.data import demo
    from crowdtrain.data.tokenizers import default_image_tokenizer

    cache = tmp_path / "cache"
    monkeypatch.setenv("CROWDTRAIN_CACHE", str(cache))
    small = demo.ensure_demo_shards(tmp_path / "small", num_train=300, cache=False)
    recipe = demo.demo_recipe(demo.DEFAULT_NUM_TRAIN, 0, default_image_tokenizer())

    def file_small_under_the_full_recipe(folder, _entry):
        for f in small.iterdir():
            if f.name != demo.MARKER:
                shutil.copy(f, folder / f.name)
        (folder / demo.MARKER).write_text(json.dumps(recipe))

    demo.build_cached(tmp_path / "seeded", cache_root=cache, entry=f"shapes-{demo.DEFAULT_NUM_TRAIN}", recipe=recipe,
                      marker=demo.MARKER, make=file_small_under_the_full_recipe,
                      is_finished=lambda folder: demo._is_finished(folder, recipe), clear=demo._clear, what="seeded")
    capfd.readouterr()
    got = resolve_shards(CoordinatorConfig(run_id="t", data="shapes", run_dir=str(tmp_path / "run")))
    assert got == tmp_path / "run" / "data" / "shapes"
    assert (got / "train-00000.parquet").read_bytes() == (small / "train-00000.parquet").read_bytes()
    assert json.loads((got / demo.MARKER).read_text()) == recipe
    assert f"{demo.DEFAULT_NUM_TRAIN} demo images: reusing {cache}" in capfd.readouterr().err

    (tmp_path / "not_a_folder").write_text("")
    with pytest.raises(ShapesBuildFailed, match=r"making the bundled shapes data in .*not_a_folder.* failed .*--data"):
        resolve_shards(CoordinatorConfig(run_id="t", data="shapes", run_dir=str(tmp_path / "not_a_folder")))
    assert "Traceback" in capfd.readouterr().err  # the child's error, above the coordinator's one line


def test_demo_shards_small_sets_stay_out_of_the_shared_cache(tmp_path, monkeypatch):
    from crowdtrain.data import demo

    monkeypatch.setenv("CROWDTRAIN_CACHE", str(tmp_path / "shared"))
    assert demo.default_cache_dir() == tmp_path / "shared"
    folder = demo.ensure_demo_shards(tmp_path / "shapes", num_train=200)
    assert (folder / "demo.json").exists() and not (tmp_path / "shared").exists()
    assert demo.DEFAULT_NUM_TRAIN >= 50_000 >= demo.SHARED_CACHE_MIN_IMAGES


def test_prepare_lists_every_skipped_file_in_a_file_when_there_are_many(tmp_path, vq_path):
    src = _folder(tmp_path, num=30)
    for i in range(6, 30):
        (src / f"{i:06d}.txt").unlink()
    summary = prepare_shards(src, tmp_path / "out", load_image_tokenizer(vq_path), shard_size=10, progress=False)
    assert summary.rows == 3 and len(summary.skipped_items) == 27
    listing = (tmp_path / "out" / "skipped-train.txt").read_text().splitlines()
    assert len(listing) == 27 and "000029.png\tmissing caption (.txt)" in listing
    assert f"all 27 listed in {tmp_path / 'out' / 'skipped-train.txt'}" in summary.format()
    assert summary.format().count(": missing caption (.txt)") == 18  # 20 named: 000003 and 000006-000022


def test_prepare_reports_how_well_the_tokenizer_keeps_the_images_and_warns_when_poorly(tmp_path, capsys):
    from crowdtrain.cli import main

    shapes_dir = tmp_path / "shapes"
    shapes.write_shapes_folder(shapes_dir, num=6, seed=2, progress=False)
    assert main(["data", "prepare", "--input", str(shapes_dir), "--out", str(tmp_path / "a"),
                 "--image-tokenizer", "shapes"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer fit: exact, mean error 0.0/255 on 6 of your images" in out and "WARNING" not in out
    # Gradients in colours the palette does not have: the palette codes lose them.
    grads = tmp_path / "gradients"
    grads.mkdir()
    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    for i in range(5):
        image = np.stack([np.tile(ramp, (64, 1)), np.tile(ramp[:, None], (1, 64)), np.full((64, 64), 40 * i, np.uint8)],
                         axis=-1)
        Image.fromarray(image).save(grads / f"{i}.png")
        (grads / f"{i}.txt").write_text(f"a gradient number {i}")
    assert main(["data", "prepare", "--input", str(grads), "--out", str(tmp_path / "b"),
                 "--image-tokenizer", "shapes"]) == 0
    out = capsys.readouterr().out
    psnr = float(out.split("tokenizer fit: PSNR ")[1].split(" dB")[0])
    assert psnr < 22 and "WARNING: the image tokenizer (shapes) loses much of your images" in out
    assert "crowdtrain tokenizer train --data DIR" in out
    sheet = Image.open(tmp_path / "b" / "fit_report-train.png")
    assert sheet.size == (2 * 8 * 66, 2 * (2 * 64 + 6))  # 5 pairs on one row of 8, at 2x
