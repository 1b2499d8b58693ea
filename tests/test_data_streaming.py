"""Streaming shards into model batches: local, HTTP with Range, bad shards, seeds, filters, epochs."""

import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests._data_helpers import codes_of, make_shards, random_vq, shard_rows
from crowdtrain.data.config import StreamConfig
from crowdtrain.data.http_server import serve_directory
from crowdtrain.data.shards import codes_to_bytes, shard_schema
from crowdtrain.data.streaming import DataSourceUnavailable, batch_stream, is_transient, keep_row, stable_seed
from crowdtrain.data.tokenizers import train_text_tokenizer
from crowdtrain.model.config import get_preset

pytestmark = pytest.mark.timeout(120)

CONFIG = get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=512)
SMALL_BUFFER = StreamConfig(shuffle_buffer=16, http_timeout_s=5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    make_shards(d, random_vq(d / "vq.safetensors"), num=40, shard_size=20)
    return d


@pytest.fixture(scope="module")
def text_tok(shards):
    return train_text_tokenizer([r["caption"] for r in shard_rows(shards)], vocab_size=128)


def _stream(source, text_tok, seed_key="peer-a", batch_size=8, config=SMALL_BUFFER):
    return batch_stream(source, text_tokenizer=text_tok, model_config=CONFIG, batch_size=batch_size,
                        seed_key=seed_key, config=config)


def test_batches_match_shards_and_epochs_reshuffle(shards, text_tok):
    rows = shard_rows(shards)
    # (codes, token ids) of every row: an untrained tokenizer may give two images the same codes.
    expected = Counter((codes_of(r["code"]), tuple(text_tok.encode_batch([r["caption"]], 16)[0].tolist()))
                       for r in rows)
    stream = _stream(shards, text_tok)
    epochs = []
    for _ in range(2):
        seen = []
        for _ in range(5):  # 40 rows / 8 per batch = one epoch
            batch = next(stream)
            assert batch["text"].shape == (8, 16) and batch["image"].shape == (8, 64)
            assert batch["text"].dtype == batch["image"].dtype == __import__("torch").long
            seen += [(tuple(i.tolist()), tuple(t.tolist())) for i, t in zip(batch["image"], batch["text"])]
        epochs.append(seen)
    assert Counter(epochs[0]) == expected == Counter(epochs[1])  # each epoch: every row once, with its caption
    assert epochs[0] != epochs[1]  # reshuffled
    assert stream.epoch >= 1 and stream.stats.shards_failed == 0


def test_seed_key_is_stable_across_processes(shards, text_tok):
    first = next(_stream(shards, text_tok, "peer-a"))["image"]
    assert next(_stream(shards, text_tok, "peer-a"))["image"].equal(first)
    assert not next(_stream(shards, text_tok, "peer-b"))["image"].equal(first)
    code = ("from crowdtrain.data.streaming import stable_seed; print(stable_seed('peer-a'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": str(s)}).stdout.strip() for s in (1, 2)}
    assert outs == {str(stable_seed("peer-a"))}


def test_paper_filters(tmp_path, text_tok):
    code = codes_to_bytes(list(range(64)))
    rows = [
        {"caption": "a small red circle on the left", "code": code, "original_width": 64, "original_height": 64,
         "NSFW": "UNLIKELY", "url": "keep"},
        {"caption": "ok", "code": code, "original_width": 64, "original_height": 64, "NSFW": "UNLIKELY", "url": "short"},
        {"caption": "a wide picture", "code": code, "original_width": 300, "original_height": 100, "NSFW": "UNLIKELY",
         "url": "wide"},
        {"caption": "a flagged picture", "code": code, "original_width": 64, "original_height": 64, "NSFW": "NSFW",
         "url": "unsafe"},
        {"caption": "an unsure picture", "code": code, "original_width": 64, "original_height": 64, "NSFW": "UNSURE",
         "url": "unsure"},
    ]
    assert [keep_row(r) for r in rows] == [True, False, False, False, False]
    assert keep_row({**rows[0], "original_width": 128, "original_height": 64})  # ratio exactly 2 stays
    pq.write_table(pa.Table.from_pylist(rows, schema=shard_schema()), tmp_path / "train-00000.parquet",
                   compression="brotli")
    stream = _stream(tmp_path, text_tok, batch_size=3)
    batch = next(stream)
    assert (batch["image"] == batch["image"][0]).all()  # the one kept row, three times (3 epochs)
    assert stream.epoch >= 2


def _corrupt_folder(src, dst):
    """Copy two good shards and add a truncated one and a garbage one, all in the manifest."""
    dst.mkdir()
    good = sorted(src.glob("train-*.parquet"))
    for f in good:
        (dst / f.name).write_bytes(f.read_bytes())
    data = good[0].read_bytes()
    (dst / "train-00002.parquet").write_bytes(data[: len(data) // 2])  # truncated
    (dst / "train-00003.parquet").write_bytes(b"PAR1" + os.urandom(3000) + b"PAR1")  # corrupted
    manifest = json.loads((src / "shards.json").read_text())
    manifest["splits"]["train"] += [{"index": i, "file": f"train-{i:05d}.parquet", "rows": 20, "skipped": {},
                                     "shard_size": 20} for i in (2, 3)]
    (dst / "shards.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize("over_http", [False, True])
def test_bad_shards_are_skipped_logged_once_and_counted(shards, text_tok, tmp_path, caplog, over_http):
    folder = _corrupt_folder(shards, tmp_path / "bad")
    server = serve_directory(folder) if over_http else None
    try:
        caplog.set_level(logging.ERROR, logger="crowdtrain.data.streaming")
        stream = _stream(server.url if server else folder, text_tok, batch_size=8)
        images = [tuple(x.tolist()) for _ in range(10) for x in next(stream)["image"]]  # two epochs
        good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
        assert Counter(images) == Counter({k: 2 * v for k, v in good.items()})  # only good rows, each once per epoch
        assert stream.stats.shards_failed == 2
        assert sorted(s.rsplit("/", 1)[-1] for s, _ in stream.stats.bad_shards) == ["train-00002.parquet",
                                                                                      "train-00003.parquet"]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and all("skipping shard" in r.getMessage() for r in errors)
    finally:
        if server:
            server.close()


def test_all_shards_bad_raises_instead_of_hanging(tmp_path, text_tok):
    (tmp_path / "train-00000.parquet").write_bytes(b"garbage")
    stream = _stream(tmp_path, text_tok)
    t0 = time.time()
    with pytest.raises(ValueError, match="no usable rows"):
        next(stream)
    assert time.time() - t0 < 30


def test_stalled_server_times_out_and_skips(shards, text_tok):
    """A shard whose server stops answering is skipped after http_timeout_s, not waited on forever."""
    files = {p.name: p.read_bytes() for p in shards.iterdir() if p.suffix in (".parquet", ".json")}
    manifest = json.loads(files["shards.json"])
    manifest["splits"]["train"].append({"index": 9, "file": "train-00009.parquet", "rows": 20, "skipped": {}})
    files["shards.json"] = json.dumps(manifest).encode()
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            name = self.path.lstrip("/")
            if name == "train-00009.parquet":
                stop.wait(20)  # never answers in time
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(files[name])))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self):
            name = self.path.lstrip("/")
            data = files[name]
            rng = self.headers.get("Range")
            if rng:
                a, b = rng.split("=")[1].split("-")
                data = data[int(a): int(b) + 1]
                self.send_response(206)
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/"
        stream = _stream(url, text_tok, config=StreamConfig(shuffle_buffer=16, http_timeout_s=1.0))
        t0 = time.time()
        batches = [next(stream) for _ in range(5)]
        assert time.time() - t0 < 20
        assert stream.stats.shards_failed == 1 and "train-00009" in stream.stats.bad_shards[0][0]
        assert sum(len(b["image"]) for b in batches) == 40
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()


def test_range_server(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path.parent / "secret.txt").write_text("no")
    with serve_directory(tmp_path) as server:
        def get(path, rng=None, method="GET"):
            req = urllib.request.Request(server.url + path, method=method, headers={"Range": rng} if rng else {})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status, dict(r.headers), r.read()
            except urllib.error.HTTPError as e:
                return e.code, dict(e.headers), b""

        status, headers, body = get("f.bin")
        assert status == 200 and body == data and headers["Accept-Ranges"] == "bytes"
        status, headers, body = get("f.bin", "bytes=10-19")
        assert status == 206 and body == data[10:20] and headers["Content-Range"] == f"bytes 10-19/{len(data)}"
        assert get("f.bin", "bytes=1000-")[2] == data[1000:]
        assert get("f.bin", "bytes=-5")[2] == data[-5:]
        assert get("f.bin", "bytes=1020-5000")[2] == data[1020:]
        assert get("f.bin", "bytes=5000-")[0] == 416
        status, headers, body = get("f.bin", method="HEAD")
        assert status == 200 and headers["Content-Length"] == str(len(data)) and body == b""
        assert get("../secret.txt")[0] == 404
        assert get("missing.bin")[0] == 404


def test_http_and_local_streams_agree(shards, text_tok):
    with serve_directory(shards) as server:
        remote = next(_stream(server.url, text_tok, "peer-x"))
    local = next(_stream(shards, text_tok, "peer-x"))
    assert remote["image"].equal(local["image"]) and remote["text"].equal(local["text"])


def test_config_mismatch_is_a_clear_error(shards, text_tok):
    wrong = get_preset("tiny", text_len=16, text_vocab_size=128, image_height=4, image_width=4, image_vocab_size=512)
    stream = batch_stream(shards, text_tokenizer=text_tok, model_config=wrong, batch_size=4, seed_key="p")
    with pytest.raises(ValueError, match="64 codes per image but the model expects 16"):
        next(stream)
    with pytest.raises(ValueError, match="text_vocab_size"):
        batch_stream(shards, text_tokenizer=text_tok, model_config=get_preset("tiny", text_vocab_size=8,
                                                                              image_vocab_size=512),
                     batch_size=4, seed_key="p")
    with pytest.raises(FileNotFoundError):
        batch_stream("/no/such/folder/x/y/z", text_tokenizer=text_tok, model_config=CONFIG, batch_size=4, seed_key="p")


# ---- riding out an outage of the data source --------------------------------------------------

def test_transient_failures_are_told_from_broken_data():
    import http.client
    import io as _io

    from crowdtrain.data.streaming import is_transient

    def http_error(code):
        return urllib.error.HTTPError("http://x/s.parquet", code, "x", {}, _io.BytesIO())

    for error in (urllib.error.URLError(ConnectionRefusedError(111, "refused")), TimeoutError("timed out"),
                  ConnectionResetError(), http.client.RemoteDisconnected("gone"), http.client.IncompleteRead(b""),
                  http_error(500), http_error(502), http_error(503), http_error(408), http_error(429)):
        assert is_transient(error), error
    for error in (http_error(404), http_error(403), http_error(416), ValueError("missing column(s)"),
                  pa.ArrowInvalid("Parquet magic bytes not found"), OSError("corrupt")):
        assert not is_transient(error), error


def _outage_stream(url, text_tok, **config):
    settings = {"shuffle_buffer": 16, "http_timeout_s": 2.0, "retry_max_delay_s": 1.0, "outage_patience_s": 60.0,
                **config}
    return _stream(url, text_tok, config=StreamConfig(**settings))


def test_a_source_that_goes_down_is_retried_while_rows_already_read_are_replayed(shards, text_tok):
    """The coordinator restarting: its port refuses connections for a while, then serves again."""
    good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
    server = serve_directory(shards)
    port = server.port
    stream = _outage_stream(server.url, text_tok)
    for _ in range(5):  # one epoch: 40 rows, 2 shards
        next(stream)
    assert stream.stats.shards_read == 2 and stream.stats.retries == 0
    server.close()  # connection refused from now on
    server = None
    try:
        # Batches keep coming (the rows already read, replayed) while the shards are retried.
        deadline = time.monotonic() + 30
        served_while_down = []
        while stream.stats.retries < 3:
            assert time.monotonic() < deadline, stream.stats
            served_while_down += [codes_of(x.numpy().astype("<i2").tobytes()) for x in next(stream)["image"]]
        assert stream.stats.outages == 1 and stream.stats.replayed_rows > 0
        assert served_while_down and set(served_while_down) <= set(good), "only rows of the real shards"
        assert stream.stats.shards_failed == 0, "an outage is not bad data: no shard is skipped"
        read_before = stream.stats.shards_read
        server = serve_directory(shards, port=port)  # the coordinator is back, at the same address
        while stream.stats.shards_read < read_before + 2:
            assert time.monotonic() < deadline, stream.stats
            next(stream)
        assert stream.stats.shards_failed == 0 and stream.stats.outages == 1
    finally:
        if server is not None:
            server.close()


class _FlakyServer:
    """Serves a shard folder (HEAD, GET with Range) but answers 503 to ``down_for`` requests first,
    then serves normally; ``status`` overrides the answer for one file name."""

    def __init__(self, folder, *, status: dict | None = None):
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".parquet", ".json")}
        self.refused, self.down_for = 0, 0
        flaky = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, body: bool):
                name = self.path.lstrip("/")
                code = (status or {}).get(name)
                if code is None and flaky.refused < flaky.down_for:
                    flaky.refused += 1
                    code = 503
                if code is None and name not in files:
                    code = 404
                if code is not None:
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files[name]
                rng = self.headers.get("Range")
                if rng:
                    a, b = rng.split("=")[1].split("-")
                    data = data[int(a): int(b) + 1]
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_source_answering_503_is_waited_for_and_then_every_row_arrives_once(shards, text_tok):
    """Down from the first shard on (nothing to replay yet): the stream waits with back-off instead
    of skipping the shards, then yields the epoch's rows exactly once."""
    good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
    server = _FlakyServer(shards)
    try:
        stream = _outage_stream(server.url, text_tok)  # reads the manifest while the source is up
        server.down_for = 5  # then shard fetches and manifest probes get 503 five times
        images = [codes_of(x.numpy().astype("<i2").tobytes()) for _ in range(5) for x in next(stream)["image"]]
        assert Counter(images) == good, "the whole first epoch, each row once"
        assert server.refused == 5 and stream.stats.outages == 1 and stream.stats.retries >= 2
        assert stream.stats.shards_failed == 0 and stream.stats.replayed_rows == 0, stream.stats
    finally:
        server.close()


def test_a_source_down_longer_than_the_patience_ends_the_stream_with_a_clear_error(shards, text_tok):
    server = _FlakyServer(shards)
    try:
        stream = _outage_stream(server.url, text_tok, outage_patience_s=3.0)
        server.down_for = 10**9  # never comes back
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"has not answered for \d+ s .*outage_patience_s = 3 s.*"
                                             r"--data-outage-patience-s"):
            next(stream)
        assert 3.0 <= time.monotonic() - t0 < 15, "gives up after the patience, not before and not much later"
        assert stream.stats.retries >= 2 and stream.stats.shards_failed == 0
    finally:
        server.close()


def test_a_stream_opened_while_the_source_is_down_waits_for_its_manifest(shards, text_tok):
    """A volunteer starting during a coordinator restart: the shard list is retried, not fatal."""
    good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
    server = _FlakyServer(shards)
    try:
        server.down_for = 3  # the manifest answers 503 three times
        stream = _outage_stream(server.url, text_tok)
        images = [codes_of(x.numpy().astype("<i2").tobytes()) for _ in range(5) for x in next(stream)["image"]]
        assert server.refused == 3 and Counter(images) == good
        server.refused, server.down_for = 0, 10**9  # and one that never comes back
        t0 = time.monotonic()
        with pytest.raises(DataSourceUnavailable, match=r"has not answered for \d+ s .*503.*outage_patience_s = 3 s"):
            _outage_stream(server.url, text_tok, outage_patience_s=3.0)
        assert 2.0 <= time.monotonic() - t0 < 10 and server.refused >= 3
    finally:
        server.close()


class _FlakyHub:
    """Stands in for huggingface_hub.HfFileSystem (no hub is reachable here): the data set
    ``owner/shapes`` is a local shard folder, and while ``down`` every call fails as the hub client
    does when the hub is unreachable (httpx.ConnectError)."""

    down = False
    calls = 0
    _cache: dict = {}  # datasets keeps HfFileSystem's instance cache when it pickles a stream

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, *args, **kwargs):  # HfFileSystem(...)
        return self

    def _check(self):
        import httpx
        type(self).calls += 1
        if type(self).down:
            raise httpx.ConnectError("[Errno 111] Connection refused")

    def _local(self, path: str):
        return self.folder / path.removeprefix("hf://").removeprefix("datasets/owner/shapes").lstrip("/")

    def glob(self, pattern):
        self._check()
        return [f"datasets/owner/shapes/{p.name}" for p in sorted(self.folder.glob("*.parquet"))]

    def ls(self, path, detail=False):
        self._check()
        return [f"datasets/owner/shapes/{p.name}" for p in sorted(self.folder.iterdir())]

    def open(self, path, mode="rb"):
        self._check()
        return open(self._local(path), mode)


def test_a_hub_data_set_rides_out_a_hub_outage_as_a_coordinator_outage(shards, text_tok, monkeypatch):
    import huggingface_hub

    hub = _FlakyHub(shards)
    monkeypatch.setattr(huggingface_hub, "HfFileSystem", hub)
    good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
    # Opened while the hub is down: the file list is retried (not "cannot list hub data set").
    _FlakyHub.down = True
    threading.Timer(2.0, lambda: setattr(_FlakyHub, "down", False)).start()
    stream = _outage_stream("hf://datasets/owner/shapes", text_tok)
    images = [codes_of(x.numpy().astype("<i2").tobytes()) for _ in range(5) for x in next(stream)["image"]]
    assert Counter(images) == good and stream.stats.retries == 0
    # Down mid-run: rows already read are replayed, no shard is skipped, and it resumes.
    _FlakyHub.down = True
    deadline = time.monotonic() + 30
    while stream.stats.retries < 2:
        assert time.monotonic() < deadline, stream.stats
        next(stream)
    assert stream.stats.outages == 1 and stream.stats.replayed_rows > 0 and stream.stats.shards_failed == 0
    _FlakyHub.down = False
    read_before = stream.stats.shards_read
    while stream.stats.shards_read < read_before + 2:
        assert time.monotonic() < deadline, stream.stats
        next(stream)
    assert stream.stats.shards_failed == 0 and stream.stats.outages == 1
    # A hub that refuses (404, a private data set) is about the data: refused at once.
    import httpx
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/x"))
    error = huggingface_hub.errors.HfHubHTTPError("404 Client Error", response=response)
    assert not is_transient(error)
    assert is_transient(huggingface_hub.errors.HfHubHTTPError(
        "503", response=httpx.Response(503, request=httpx.Request("GET", "https://huggingface.co/x"))))


def test_a_source_without_a_manifest_is_refused_at_once_not_waited_for(tmp_path, text_tok):
    server = _FlakyServer(tmp_path)  # answers, but has no shards.json: 404 is about the data
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="HTTP Error 404.*crowdtrain data serve") as refused:
            _outage_stream(server.url, text_tok)
        assert not isinstance(refused.value, DataSourceUnavailable) and time.monotonic() - t0 < 2
    finally:
        server.close()


def test_broken_data_on_a_live_source_is_skipped_not_waited_for(shards, text_tok):
    """A 404 (missing file) is about the data: skipped at once, no retry. A 500 on one file while
    the manifest answers is that file's problem: one more try, then skipped for the epoch."""
    folder = shards
    manifest = json.loads((folder / "shards.json").read_text())
    names = [s["file"] for s in manifest["splits"]["train"]]
    good = Counter(codes_of(r["code"]) for r in shard_rows(shards))
    for code, retries in ((404, 0), (500, 1)):
        server = _FlakyServer(folder, status={names[0]: code})
        try:
            stream = _outage_stream(server.url, text_tok)
            # 16 rows, all from the good shard (20 rows): the epoch is not over, the bad shard was tried once.
            images = [codes_of(x.numpy().astype("<i2").tobytes()) for _ in range(2) for x in next(stream)["image"]]
            assert set(images) <= set(good) and stream.stats.shards_failed == 1, (code, stream.stats)
            assert stream.stats.retries == retries and stream.stats.outages == 0, (code, stream.stats)
        finally:
            server.close()


def test_a_shard_cut_off_mid_read_resumes_after_the_rows_already_yielded(monkeypatch):
    from crowdtrain.data.streaming import StreamStats, _Source

    rows = [{"caption": f"row {i}", "code": b"\0\0", "original_width": None, "original_height": None,
             "NSFW": "UNLIKELY"} for i in range(10)]
    attempts = []

    def read(self, shard):
        attempts.append(shard)
        for i, row in enumerate(rows):
            if len(attempts) == 1 and i == 6:
                raise ConnectionResetError("the server went away mid-read")
            yield row

    monkeypatch.setattr(_Source, "_read", read)
    monkeypatch.setattr(_Source, "_source_answers", lambda self: True)  # it is back at once: no wait
    source = _Source(StreamStats(), StreamConfig(), manifest_url="http://x/shards.json", seed=0)
    assert [r["caption"] for r in source.rows("http://x/a.parquet")] == [r["caption"] for r in rows]
    assert len(attempts) == 2 and source.stats.retries == 1 and source.stats.shards_failed == 0
