"""The coordinator's pages, rendered by the real app on a database filled through Store's writers.

Fast (no processes, no browser): each page shows what it must, user-supplied text is escaped,
nothing loads from outside the coordinator, unknown paths are 404. The same pages in a real
browser after a real run: tests/test_web_browser.py.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from html.parser import HTMLParser

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save_file

from crowdtrain.coordinator import pages
from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.hub import push_checkpoint_to_hub
from crowdtrain.coordinator.service import AuthSettings, create_app

URL = "http://coord.example.org:8000"
EVIL = "<script>alert(1)</script>"
EVIL_PROMPT = 'a small <img src=x onerror="alert(2)"> circle'
PAGES = ["/", "/dashboard", "/leaderboard", "/peers", "/checkpoints", "/samples", "/join", "/organize"]
TINY = {"width": 64, "depth": 4, "heads": 4, "head_dim": 16, "ff_mult": 4, "text_len": 16, "text_vocab_size": 256,
        "text_pad_id": 0, "image_height": 8, "image_width": 8, "image_vocab_size": 64,
        "patterns": ["axial_row", "axial_col", "axial_row", "conv_like"], "share_ids": [0, 1, 2, 3],
        "conv_kernel": 5, "rotary": True, "reversible": False, "checkpointing": False, "image_loss_weight": 7.0,
        "dropout": 0.0}


class Tables(HTMLParser):
    """Cell texts of every <table id=...>, row by row (enough to check what a reader sees)."""

    def __init__(self, html: str):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table = self._row = self._cell = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id"):
            self._table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def body_rows(html: str, table_id: str) -> list[list[str]]:
    return Tables(html).tables[table_id][1:]  # without the header row


def metrics(peer_id: str, user: str, t: float, *, epoch: int, loss: float, rate: float, client_mode=False,
            last_round_peers=2) -> dict:
    return {"peer_id": peer_id, "user": user, "time": t, "epoch": epoch, "loss": loss, "samples": 100,
            "samples_per_second": rate, "steps": 10, "client_mode": client_mode,
            "last_round_peers": last_round_peers, "swarm_peers": 3}


@pytest.fixture
def run(tmp_path):
    """A run folder as the auxiliary peer leaves it, and a database filled through Store's writers."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    now = time.time()
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": "test-run", "task": {"name": "dalle", "model": TINY, "data": "pattern"},
        "swarm": {"target_batch_size": 384, "total_epochs": 60, "compression_threshold": 65536}}))
    store = Store(f"sqlite:///{run_dir / 'coordinator.sqlite'}")
    store.peer_joined("QmAlicePeer00000000000001", "alice", "pk-a")  # token requests, then metrics records
    store.peer_joined("QmBobPeer0000000000000002", "bob", "pk-b")
    now = time.time()
    live = [metrics("QmAlicePeer00000000000001", "alice", now, epoch=12, loss=3.0, rate=40.0),
            metrics("QmBobPeer0000000000000002", "bob", now, epoch=12, loss=3.5, rate=15.5)]
    (run_dir / "status.json").write_text(json.dumps({
        "epoch": 12, "peers": live, "updated": now, "last_checkpoint_epoch": 10, "samples_per_second": 55.5,
        "total_epochs": 60, "target_batch_size": 384}))
    for i in range(40):  # the last 400 s: epochs 4..11, loss falling
        store.record_swarm_point(epoch=4 + i // 5, loss=5.0 - 0.05 * i, active_peers=2, samples_per_second=55.0,
                                 at=now - 400 + 10 * i)
    # dave and EVIL are known from old metrics records only (which create their peers)
    store.record_metrics(live + [metrics("QmGonePeer000000000000003", "dave", now - 3600, epoch=2, loss=5.5,
                                         rate=9.0, client_mode=True, last_round_peers=0),
                                 metrics("QmEvilPeer000000000000004", EVIL, now - 7200, epoch=1, loss=6.0, rate=1.0)])
    for step in range(1, 9):  # as the auxiliary peer credits the peers' ledgers, epochs 4..11
        store.record_credit(peer_id="QmAlicePeer00000000000001", session="a", samples=300 * step, steps=step,
                            epoch=3 + step, samples_per_second=40.0)
        store.record_credit(peer_id="QmBobPeer0000000000000002", session="b", samples=84 * step, steps=step,
                            epoch=3 + step, samples_per_second=15.5)
    store.record_credit(peer_id="QmEvilPeer000000000000004", session="e", samples=5, steps=1, epoch=1,
                        samples_per_second=1.0)
    store.add_user("carol")
    store.peer_joined("QmCarolPeer00000000000005", "carol", "pk-c")
    store.revoke_user("carol")
    store.record_checkpoint(name="step-0000005", epoch=5, loss=4.2, files=["config.json", "model.safetensors"],
                            at=now - 300)
    store.record_checkpoint(name="step-0000010", epoch=10, loss=3.25,
                            files=["config.json", "model.safetensors", "optimizer.safetensors"], at=now - 60)
    store.mark_pruned(["step-0000010"])
    ckpt = run_dir / "checkpoints" / "step-0000010"
    ckpt.mkdir()
    save_file({"layer.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(ckpt / "model.safetensors"))
    save_file({"state": np.zeros(4, dtype=np.float32)}, str(ckpt / "optimizer.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"step": 10}))
    (run_dir / "samples" / "step-0000010").mkdir(parents=True)
    for i, (prompt, tag) in enumerate([("a large red circle in the middle", "seen"),
                                       ("a large red triangle in the middle", "held-out"), (EVIL_PROMPT, "seen")]):
        (run_dir / "samples" / "step-0000010" / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes([i]) * 16)
        store.record_sample(checkpoint="step-0000010", epoch=10, prompt=prompt,
                            path=f"samples/step-0000010/{i}.png", tag=tag)

    def client(auth_mode: str = "open") -> TestClient:
        app = create_app(run_dir, store=store, public_url=URL,
                         auth=AuthSettings(mode=auth_mode, key_path=tmp_path / "coordinator_key.pem"))
        return TestClient(app)

    client.run_dir, client.store = run_dir, store
    yield client
    store.close()


def pin_of(run) -> str:
    """The fingerprint of the key the run's pages were made with (as `crowdtrain join --pin` takes it)."""
    from crowdtrain.runspec.tokens import CoordinatorKey
    from crowdtrain.runspec.trust import fingerprint

    return fingerprint(CoordinatorKey.load_or_create(run.run_dir.parent / "coordinator_key.pem").public_key)


def test_home_says_what_the_run_trains_its_progress_and_how_to_join(run):
    html = run().get("/").text
    assert "Train test-run together" in html
    assert f"<code>crowdtrain join {URL} --pin {pin_of(run)} --user YOUR_NAME</code>" in html
    # what it trains, from run.json
    assert "16 text tokens" in html and "8&times;8 grid of codes" in html and "axial_row, axial_col" in html
    # progress: epoch 12 of 60, the bar at 20%, throughput, mean loss of the live peers, an ETA
    assert re.search(r'data-stat="epoch">12<', html) and re.search(r'data-stat="total_epochs">60<', html)
    assert 'style="width: 20.0%"' in html
    assert 'data-stat="samples_per_second">55.5<' in html and 'data-stat="loss">3.2500<' in html
    assert re.search(r'data-stat="eta">\d+ min \d\d s<', html)  # 48 epochs left at ~1 epoch / 50 s
    # how the training works: shared batch, compression, what crosses the network and what never does
    for phrase in ("One shared batch", "384 samples", "2<sup>16</sup> = 65,536", "8-bit", "fp16",
                   "Never code", "unpickled", "only tensors"):
        assert phrase in html, phrase
    assert 'href="/organize"' in html and 'href="/join"' in html and 'href="/memcalc/"' in html
    assert "alice" in html  # top contributors


def test_join_page_shows_the_right_command_for_open_and_allowlist_runs(run):
    open_html = run("open").get("/join").text
    pin = pin_of(run)
    command = (f'<pre class="command" id="join-command"><code>crowdtrain join {URL} --pin {pin} --user YOUR_NAME'
               '</code></pre>')
    assert command in open_html
    assert "--key" not in open_html.split('id="join-command"')[1].split("</pre>")[0]
    assert f"<code>--pin {pin}</code> is the fingerprint of this coordinator's key" in open_html
    invited = run("allowlist").get("/join").text
    assert f'<code>crowdtrain join {URL} --pin {pin} --key YOUR_KEY</code>' in invited
    assert "crowdtrain users add YOUR_NAME" in invited and "CROWDTRAIN_KEY" in invited
    for html in (open_html, invited):
        assert 'href="/memcalc/"' in html
        assert "What your machine will do" in html and "never" in html and "unpickled" in html
    calculator = run("open").get("/memcalc/").text  # and from the calculator, back to the run
    assert 'href="/"' in calculator and 'href="/join"' in calculator and 'href="/dashboard"' in calculator
    assert pages.join_command("http://h:1", "open") == "crowdtrain join http://h:1 --user YOUR_NAME"
    assert pages.join_command("http://h:1", "allowlist") == "crowdtrain join http://h:1 --key YOUR_KEY"


def test_dashboard_embeds_the_history_and_works_without_a_cdn(run):
    client = run()
    html = client.get("/dashboard").text
    history = json.loads(re.search(r'<script type="application/json" id="history-data">(.*?)</script>', html,
                                   re.S).group(1))
    assert len(history) == 40 and history[0]["loss"] == 5.0 and history[-1]["epoch"] == 11
    for chart in ("chart-loss", "chart-peers", "chart-throughput", "chart-epoch"):
        assert f'id="{chart}"' in html
    assert 'data-refresh-ms="5000"' in html
    assert 'data-stat="epoch">12<' in html and re.search(r'data-stat="eta">\d+ min', html)
    # Without JavaScript: the recent history as a table.
    assert 'id="history-table"' in html and "3.0500" in html
    # Scripts and styles are served by the coordinator itself.
    srcs = re.findall(r'<script[^>]*\ssrc="([^"]+)"', html) + re.findall(r'<link[^>]*\shref="([^"]+)"', html)
    assert sorted(srcs) == ["/static/app.css", "/static/dashboard.js", "/static/favicon.svg", "/static/plotly.min.js"]
    for src in srcs:
        assert client.get(src).status_code == 200, src
    js = client.get("/static/dashboard.js").text
    assert "Plotly.react" in js and "/api/history?since=" in js and "/api/status" in js
    plotly = client.get("/static/plotly.min.js")
    assert plotly.headers["content-type"].startswith("application/javascript") and len(plotly.content) > 1_000_000


def test_dashboard_history_is_averaged_down_for_long_runs():
    points = [{"time": float(i), "epoch": i // 100, "loss": None if i % 7 == 0 else 5.0, "active_peers": 2,
               "samples_per_second": 10.0} for i in range(10_000)]
    out = pages.downsample(points, 1500)
    assert len(out) <= 1500 and out[-1] == points[-1]
    assert all(a["time"] < b["time"] for a, b in zip(out, out[1:]))
    assert all(p["loss"] == 5.0 and p["samples_per_second"] == 10.0 for p in out[:-1])  # gaps averaged over
    assert pages.downsample(points[:10], 1500) == points[:10]


def test_the_dashboards_history_is_read_again_only_when_a_point_was_added(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    for i in range(50):
        store.record_swarm_point(epoch=i, loss=5.0 - i / 100, active_peers=2, samples_per_second=10.0, at=1000.0 + i)
    reads = []
    full = store.swarm_history

    def counted(**kwargs):
        reads.append(kwargs.get("limit"))
        return full(**kwargs)
    store.swarm_history = counted
    drawn = pages.DrawnHistory(store, max_points=20)
    first = drawn.read()
    assert len(first) <= 20 and first[-1]["epoch"] == 49 and reads == [100_000]
    assert drawn.read() is first and reads == [100_000, 1], "no new point: one probe, the same drawing"
    store.record_swarm_point(epoch=50, loss=4.4, active_peers=3, samples_per_second=12.0, at=1050.0)
    again = drawn.read()
    assert again[-1]["epoch"] == 50 and again[-1]["active_peers"] == 3, "a new point: drawn again, with it"
    assert reads == [100_000, 1, 1, 100_000]


def test_downtime_is_a_gap_in_the_charts_and_no_time_to_the_end_is_given_while_nobody_trains(run):
    """A stopped coordinator records no points: the charts must not draw a line across the silence
    (throughput sloping down over minutes when nothing ran), neither on the page nor in the
    incremental history the page polls; and with no peer training there is no time to the end."""
    client = run()
    store, now = run.store, time.time()
    last = store.swarm_history()[-1]["time"]
    # The coordinator comes back 20 minutes later, with nobody training yet.
    for i in range(3):
        store.record_swarm_point(epoch=11, loss=None, active_peers=0, samples_per_second=0.0, at=last + 1200 + 2 * i)
    html = client.get("/dashboard").text
    history = json.loads(re.search(r'id="history-data">(.*?)</script>', html, re.S).group(1))
    gaps = [p for p in history if p.get("gap")]
    assert len(gaps) == 1 and last < gaps[0]["time"] < last + 1200, gaps
    assert gaps[0]["samples_per_second"] is None and gaps[0]["loss"] is None and gaps[0]["epoch"] is None
    assert "None" not in html.split('id="history-table"')[1].split("</table>")[0]  # the table skips markers
    # What the page's poll gets after the last point it has: the gap first, then the new points.
    fresh = client.get(f"/api/history?since={last}").json()
    assert fresh[0].get("gap") and [p["time"] for p in fresh[1:]] == [last + 1200 + 2 * i for i in range(3)]
    assert not any(p.get("gap") for p in client.get(f"/api/history?since={last + 1200}").json())
    # The status file says nobody trains now: no estimate from the pace before the stop.
    (run.run_dir / "status.json").write_text(json.dumps({"epoch": 11, "peers": [], "updated": now,
                                                            "samples_per_second": 0.0, "total_epochs": 100}))
    status = client.get("/api/status").json()
    assert status["active_peers"] == 0 and status["eta_s"] is None
    assert 'data-stat="eta">\u2014<' in client.get("/dashboard").text


def test_leaderboard_ranks_users_by_samples_counted_by_the_swarm(run):
    rows = body_rows(run().get("/leaderboard").text, "leaderboard")
    by_user = {r[1]: r for r in rows}
    assert [r[1] for r in rows[:2]] == ["alice", "bob"]
    # samples, compute time (samples / rate), epochs, peers, status
    assert by_user["alice"][2:6] == ["2,400", "1 min 00 s", "8", "1"]
    assert by_user["bob"][2] == "672" and by_user["bob"][3] == "43 s"
    assert by_user["alice"][7] == "active" and by_user["dave"][7] == "idle"
    assert by_user["carol"][7] == "revoked" and by_user["carol"][2] == "0"
    assert by_user["dave"][6].startswith("1 h ") and by_user["dave"][6].endswith(" ago")
    assert "alice" in by_user and EVIL in by_user  # shown as text (escaped in the HTML)


def test_peers_page_shows_throughput_mode_and_last_round(run):
    client = run()
    rows = body_rows(client.get("/peers").text, "peers")
    assert sorted(r[1] for r in rows) == ["alice", "bob"]  # active: reported metrics lately (carol only got a token)
    alice = next(r for r in rows if r[1] == "alice")
    assert alice[0] == "\u20260000000001" and alice[2] == "40.0" and alice[3] == "full"
    assert alice[5] == "epoch 12 with 2 peers" and alice[6] == "3.0000"
    everyone = {r[1]: r for r in body_rows(client.get("/peers?all=true").text, "peers")}
    assert set(everyone) == {"alice", "bob", "carol", "dave", EVIL}
    assert everyone["dave"][3] == "client" and everyone["dave"][5] == "none yet" and everyone["dave"][9] == "gone"


def test_absurd_values_already_in_the_database_break_no_page(run):
    """Rows stored before records were checked (a peer's time in the year 33658, infinite rates and
    losses) stay in the database across restarts: every page and API still answers, with such
    values shown as unknown, and that peer is not counted as active."""
    store, zed = run.store, "QmFuturePeer0000000000006"
    store.peer_joined(zed, "zed", "pk-z")
    store.record_metrics([metrics(zed, "zed", 1e12, epoch=999, loss=float("inf"), rate=float("inf"))])
    store.record_credit(peer_id=zed, session="z", samples=10, steps=1, epoch=3,
                        samples_per_second=5e-324)  # compute time: inf
    client = run()
    for page in PAGES:
        assert client.get(page).status_code == 200, page

    def strict_json(path: str):
        return json.loads(client.get(path).text, parse_constant=lambda c: pytest.fail(f"{path} holds {c}"))

    for path in ("/api/peers", "/api/leaderboard", "/api/metrics", "/api/history", "/api/status"):
        strict_json(path)
    peer = next(p for p in strict_json("/api/peers") if p["peer_id"] == zed)
    assert peer["last_seen"] is None and not peer["active"] and peer["loss"] is None
    assert zed not in [p["peer_id"] for p in strict_json("/api/peers?active=true")]
    board = {r["user"]: r for r in strict_json("/api/leaderboard")}
    assert not board["zed"]["active"] and board["zed"]["compute_s"] == 0.0
    assert board["alice"]["active"], "others are unaffected"


def test_checkpoints_page_lists_checkpoints_with_working_downloads(run):
    client = run()
    html = client.get("/checkpoints").text
    rows = body_rows(html, "checkpoints")
    assert [r[:3] for r in rows] == [["step-0000010", "10", "3.2500"]]  # the pruned one is gone
    links = re.findall(r'href="(/checkpoints/step-0000010/[^"]+)" download', html)
    assert links == ["/checkpoints/step-0000010/model.safetensors", "/checkpoints/step-0000010/config.json",
                     "/checkpoints/step-0000010/optimizer.safetensors"]
    model = client.get(links[0])
    assert model.status_code == 200 and "attachment" in model.headers["content-disposition"]
    assert load_safetensors(model.content)["layer.weight"].shape == (3, 4)
    assert "crowdtrain generate --checkpoint step-0000010" in html


def test_samples_gallery_marks_seen_and_held_out_prompts(run):
    client = run()
    html = client.get("/samples").text
    assert "Epoch 10" in html
    figures = re.findall(r'<figure class="sample (seen|held-out)">\s*<img src="([^"]+)"', html)
    assert figures == [("seen", "/files/samples/step-0000010/0.png"),
                       ("held-out", "/files/samples/step-0000010/1.png"),
                       ("seen", "/files/samples/step-0000010/2.png")]
    assert "a large red triangle in the middle" in html
    assert client.get(figures[1][1]).content.startswith(b"\x89PNG")


def test_user_supplied_text_is_escaped_everywhere(run):
    client = run()
    for path in ("/", "/leaderboard", "/peers?all=true", "/samples"):
        html = client.get(path).text
        assert "<script>alert" not in html and "<img src=x" not in html, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in client.get("/leaderboard").text
    assert "&lt;img src=x onerror=&#34;alert(2)&#34;&gt;" in client.get("/samples").text


def test_every_page_has_the_nav_and_loads_nothing_from_outside(run):
    client = run()
    for path in PAGES:
        response = client.get(path)
        assert response.status_code == 200, path
        html = response.text
        assert f'<a href="{path}" aria-current="page">' in html, path
        for href, _ in pages.NAV:
            assert f'<a href="{href}"' in html, (path, href)
        assert '<link rel="stylesheet" href="/static/app.css">' in html
        assert not re.search(r'<(script|img|link|iframe)[^>]*\s(src|href)="(https?:)?//', html), path
    css = client.get("/static/app.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_pages_render_while_the_run_is_starting(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    client = TestClient(create_app(tmp_path / "run", store=store, public_url=URL,
                                   auth=AuthSettings(key_path=tmp_path / "k.pem")))
    for path in PAGES:
        response = client.get(path)
        assert response.status_code == 200 and "The run is starting" in response.text, path
    assert "Nobody has contributed yet" in client.get("/leaderboard").text
    assert "No checkpoint yet" in client.get("/checkpoints").text
    assert "No measurements yet" in client.get("/dashboard").text
    store.close()


def test_unknown_pages_and_files_are_404(run):
    client = run()
    for path in ("/nope", "/static/nope.js", "/static/..%2Fpages.py", "/static/%2E%2E/pages.py",
                 "/checkpoints/step-0000010/evil.pkl", "/checkpoints/step-9999999/model.safetensors",
                 "/checkpoints/..%2F..%2Frun/model.safetensors", "/files/samples/..%2F..%2Fcoordinator.sqlite",
                 "/files/samples/step-0000010/9.png"):
        assert client.get(path).status_code == 404, path


def test_organize_page_renders_the_guide_that_ships_with_the_package(run):
    html = run().get("/organize").text
    assert "<h1>Organize a run" in html and "<table>" in html
    assert "crowdtrain data prepare --input my_images/ --out shards/" in html
    assert "push_checkpoint_to_hub" in html and "crowdtrain users add alice" in html
    packaged, repo = pages.GUIDE_PATHS
    assert packaged.read_text() == repo.read_text()


def guide_commands() -> list[str]:
    """Every `crowdtrain ...` line of the guide's shell blocks (continuation lines joined)."""
    text = pages.GUIDE_PATHS[1].read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("crowdtrain "):
                commands.append(line.strip())
    return commands


def test_guide_commands_are_real(capsys):
    from crowdtrain.cli import build_parser

    commands = guide_commands()
    assert len(commands) >= 10
    parser = build_parser()
    for command in commands:
        try:
            args = parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"the guide shows a command that crowdtrain rejects: {command}\n{capsys.readouterr().err}")
        assert args.handler, command


class FakeHfApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", (), kwargs))
        return "https://huggingface.co/me/run/commit/abc"


def test_push_checkpoint_to_hub_builds_the_right_calls(tmp_path):
    import inspect

    from huggingface_hub import HfApi

    ckpt = tmp_path / "step-0000060"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"x")
    api = FakeHfApi()
    assert push_checkpoint_to_hub(ckpt, "me/run", api=api) == "https://huggingface.co/me/run/commit/abc"
    (_, create_args, create_kwargs), (_, _, upload) = api.calls
    assert create_args == ("me/run",) and create_kwargs == {"private": False, "repo_type": "model", "exist_ok": True}
    assert upload == {"repo_id": "me/run", "folder_path": str(ckpt), "path_in_repo": "step-0000060",
                      "repo_type": "model", "allow_patterns": ["*.safetensors", "*.json"],
                      "commit_message": "crowdtrain checkpoint step-0000060"}
    # The calls fit the installed huggingface_hub's signatures.
    inspect.signature(HfApi.create_repo).bind(None, *create_args, **create_kwargs)
    inspect.signature(HfApi.upload_folder).bind(None, **upload)
    api = FakeHfApi()
    push_checkpoint_to_hub(ckpt, "me/run", api=api, model_only=True, private=True)
    assert "optimizer.safetensors" not in str(api.calls[1][2]["allow_patterns"])
    assert api.calls[0][2]["private"] is True
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        push_checkpoint_to_hub(tmp_path, "me/run", api=FakeHfApi())
    with pytest.raises(ValueError, match="OWNER/NAME"):
        push_checkpoint_to_hub(ckpt, "no-owner", api=FakeHfApi())


def test_api_docs_load_swagger_ui_from_the_coordinator_not_a_cdn(run):
    """FastAPI's default /docs takes Swagger UI from a CDN: a blank page offline. (That it renders
    in a browser with the outside blocked: tests/test_web_browser.py.)"""
    client = run()
    html = client.get("/docs").text
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert len(refs) == 3 and all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert not re.search(r"https?://", html), html
    for ref in refs:
        response = client.get(ref)
        assert response.status_code == 200 and len(response.content) > 1000, ref
    assert "SwaggerUIBundle" in client.get("/docs/swagger-ui/swagger-ui-bundle.js").text
    assert client.get("/docs/swagger-ui/index.html").status_code == 404  # the listed files only
    assert client.get("/redoc").status_code == 404  # ReDoc would come from a CDN too
    assert "/api/status" in client.get("/openapi.json").json()["paths"]


def test_the_api_schema_builds_without_warnings_and_downloads_answer_head(run, recwarn):
    client = run()
    schema = client.get("/openapi.json").json()
    assert not [str(w.message) for w in recwarn if "Operation ID" in str(w.message)]
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
    assert list(schema["paths"]["/checkpoints/{name}/{filename}"]) == ["get"]
    head = client.head("/checkpoints/step-0000010/model.safetensors")
    assert head.status_code == 200 and int(head.headers["content-length"]) > 0
