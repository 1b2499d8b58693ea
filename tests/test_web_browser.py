"""The pages in a real browser after a real run: a coordinator and two volunteers (alice, bob) train
the tiny preset as separate processes on 127.0.0.1, then chromium (through Playwright) reads the
dashboard's plotted loss, watches it refresh, reads the leaderboard and the join command, and
downloads a checkpoint.

Needs Debian's chromium (`apt-get install -y chromium`; `.ci/run` installs it) or another one named
by CROWDTRAIN_CHROMIUM. Without it these tests fail: they never skip. A screenshot of the
dashboard is left in out/test_web_browser/dashboard.png.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright
from safetensors.numpy import load as load_safetensors

from crowdtrain.launch import CHROMIUM, CHROMIUM_ARGS, LocalSwarm, get_json

SCREENSHOT = Path(__file__).resolve().parents[1] / "out" / "test_web_browser" / "dashboard.png"
EPOCHS = 4
LOSS_POINTS = 3  # the dashboard test waits for this many plotted losses
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# TRAINED_IN_THE_LANE: the tests of the trained run are in the swarm lane: its auxiliary peer must
# record points and checkpoint while the volunteers train, and beside the lane's swarms (niced, with
# their sessions) a volunteer's first DHT ping to the coordinator went unanswered within hivemind's 3 s.


def require_chromium() -> None:
    """A missing browser is a failure that says how to fix it, never a skip."""
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"chromium not found at {CHROMIUM}: install it (`apt-get install -y chromium`, as .ci/run "
                    "does) or point CROWDTRAIN_CHROMIUM at a chromium binary")


def launch_chromium(playwright):
    require_chromium()
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished short run whose coordinator is still serving: alice and bob trained EPOCHS epochs
    or more, until the history holds LOSS_POINTS points with a training loss (the dashboard test
    plots them) and the auxiliary peer has saved a checkpoint (the download test takes it). The
    auxiliary peer records a point every 2 s or so, and `tiny`'s epochs here take about 2 s each:
    EPOCHS of them alone leave 2 to 3 such points, and none come once the peers have left; on a
    busy machine its checkpoint can come epochs after the one that asked for it."""
    require_chromium()  # before two minutes of training, not after
    swarm = LocalSwarm(tmp_path_factory.mktemp("web"), swarm={"target_batch_size": 96, "checkpoint_every_epochs": 2,
                                                        "matchmaking_time_s": 2.0})
    try:
        swarm.start_coordinator()
        for name in ("alice", "bob"):
            swarm.join(name, batch_size=4, max_epochs=10 * EPOCHS)  # the cap: the run's end is the test's to call
        def enough() -> bool:
            # Both volunteers in one recorded point too: on a busy machine one of them can start
            # late enough that the other trains the first epochs alone.
            try:
                history = get_json(f"{swarm.url}/api/history")
                return (swarm.status()["epoch"] >= EPOCHS and LOSS_POINTS <= sum(p["loss"] is not None for p in history)
                        and any(p["active_peers"] == 2 for p in history)
                        and len(get_json(f"{swarm.url}/api/checkpoints")) >= 1)
            except OSError:  # a busy machine's slow answer: ask again
                return False

        deadline = time.monotonic() + 200
        while not enough():
            assert time.monotonic() < deadline, {n: swarm.log(n)[-2000:] for n in ("alice", "bob")}
            assert all(swarm.procs[n].poll() is None for n in ("alice", "bob")), \
                {n: swarm.log(n)[-2000:] for n in ("alice", "bob")}
            time.sleep(0.5)
        codes = swarm.interrupt_all(["alice", "bob"])  # Ctrl-C: both leave cleanly
        assert codes == {"alice": 0, "bob": 0}, {n: swarm.log(n)[-3000:] for n in codes}
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


@pytest.fixture
def page(trained, browser):
    """A page that records every request that leaves the coordinator and every script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.outside, page.errors = [], []
    page.on("request", lambda r: None if r.url.startswith(trained.url) else page.outside.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("response", lambda r: page.errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    yield page
    assert not page.outside, f"the page loaded resources from outside the coordinator: {page.outside}"
    assert not page.errors, f"script errors: {page.errors}"
    context.close()


def plotted(page, chart: str) -> dict:
    return page.evaluate("id => { const d = document.getElementById(id).data;"
                         " return d ? {x: d[0].x.map(String), y: d[0].y} : null; }", chart)


@pytest.mark.swarm  # the trained run (TRAINED_IN_THE_LANE)
def test_dashboard_plots_the_loss_and_refreshes_live(page, trained):
    page.goto(f"{trained.url}/dashboard")
    page.wait_for_function("() => { const d = document.getElementById('chart-loss').data;"
                           f" return d && d[0].y.filter(v => v !== null).length >= {LOSS_POINTS}; }}",
                           timeout=60_000)
    loss = plotted(page, "chart-loss")
    values = [v for v in loss["y"] if v is not None]
    assert all(math.isfinite(v) and 0 < v < 20 for v in values), values
    # The chart plots what the swarm reported (that training lowers it is tests/test_swarm.py's job).
    history = get_json(f"{trained.url}/api/history")
    assert values == [p["loss"] for p in history if p["loss"] is not None][:len(values)]
    assert max(plotted(page, "chart-peers")["y"]) == 2  # alice and bob together
    assert max(plotted(page, "chart-throughput")["y"]) > 0
    assert max(plotted(page, "chart-epoch")["y"]) >= EPOCHS - 1
    status = get_json(f"{trained.url}/api/status")
    assert page.inner_text('[data-stat="epoch"]') == str(status["epoch"])
    assert page.inner_text('[data-stat="total_epochs"]') == str(status["total_epochs"])
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Live: the auxiliary peer records the swarm every 2 s; the page polls every 5 s and redraws.
    before = len(loss["x"])
    page.wait_for_function(f"() => document.getElementById('chart-loss').data[0].x.length > {before}",
                           timeout=30_000)
    assert page.inner_text("#live-status").startswith("Live: refreshed")
    assert not page.locator("#history-table").is_visible()  # the no-JavaScript table gave way to the charts


@pytest.mark.swarm  # the trained run (TRAINED_IN_THE_LANE)
def test_leaderboard_lists_both_volunteers(page, trained):
    page.goto(f"{trained.url}/leaderboard")
    users = page.locator("#leaderboard tbody td.user").all_inner_texts()
    assert {"alice", "bob"} <= set(users), users
    board = {row["user"]: row for row in get_json(f"{trained.url}/api/leaderboard")}
    for row in page.locator("#leaderboard tbody tr").all():
        cells = row.locator("td").all_inner_texts()
        if cells[1] in ("alice", "bob"):
            assert cells[2] == f"{board[cells[1]]['samples']:,}"
    assert sum(board[u]["samples"] for u in ("alice", "bob")) > 0, board


@pytest.mark.swarm  # the trained run (TRAINED_IN_THE_LANE)
def test_join_page_shows_the_command_for_this_coordinator(page, trained):
    page.goto(f"{trained.url}/join")
    from crowdtrain.runspec.tokens import CoordinatorKey
    from crowdtrain.runspec.trust import fingerprint

    pin = fingerprint(CoordinatorKey.load_or_create(trained.run_dir / "coordinator_key.pem").public_key)
    assert page.inner_text("#join-command") == f"crowdtrain join {trained.url} --pin {pin} --user YOUR_NAME"
    assert pin in page.inner_text("#pin")
    page.click("text=memory calculator")
    page.wait_for_url(f"{trained.url}/memcalc/")
    assert "memory" in page.inner_text("h1").lower()
    page.click("nav >> text=Dashboard")  # and back to the run's pages
    page.wait_for_url(f"{trained.url}/dashboard")


@pytest.mark.swarm  # the trained run (TRAINED_IN_THE_LANE)
def test_a_checkpoint_downloads_as_safetensors(page, trained):
    page.goto(f"{trained.url}/checkpoints")
    link = page.locator("#checkpoints a[href$='/model.safetensors']").first
    name = link.get_attribute("href").split("/")[2]
    with page.expect_download() as info:
        link.click()
    download = info.value
    assert download.suggested_filename == f"{name}-model.safetensors"
    data = Path(download.path()).read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]  # safetensors: u64 header size, JSON header, raw tensors
    header = json.loads(data[8:8 + header_len])
    assert any("dtype" in v and "shape" in v for k, v in header.items() if k != "__metadata__")
    tensors = load_safetensors(data)
    assert tensors and all(math.isfinite(float(t.sum())) for t in tensors.values())


@pytest.mark.swarm  # the trained run (TRAINED_IN_THE_LANE)
def test_every_page_loads_from_the_nav_and_works_without_javascript(trained, browser):
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(f"{trained.url}/")
    links = page.locator("header nav a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert "/dashboard" in links and "/organize" in links
    for href in links:
        response = page.goto(f"{trained.url}{href}")
        assert response.status == 200, href
    page.goto(f"{trained.url}/dashboard")
    assert page.locator("#history-table").is_visible()  # stands in for the charts
    assert page.locator("#history-table tbody tr").count() > 0 and not page.locator("#charts").is_visible()
    assert page.inner_text('[data-stat="epoch"]') != ""
    context.close()


def serve_app(run_dir: Path, store):
    """The coordinator's app for ``run_dir`` served by uvicorn in a thread: (url, stop)."""
    import threading
    import time

    import uvicorn

    from crowdtrain.coordinator.service import AuthSettings, create_app
    from crowdtrain.launch import free_port

    port = free_port()
    app = create_app(run_dir, store=store, public_url=f"http://127.0.0.1:{port}",
                     auth=AuthSettings(key_path=run_dir.parent / "k.pem"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=10)
    return f"http://127.0.0.1:{port}", stop


@pytest.fixture
def starting_coordinator(tmp_path):
    """The coordinator's app on a run that has not started yet: the API docs need no training."""
    from crowdtrain.coordinator.db import Store

    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    url, stop = serve_app(tmp_path / "run", store)
    yield url
    stop()
    store.close()


def test_samples_of_a_run_on_own_images_show_its_captions_after_their_real_images(tmp_path, browser):
    """A run on data that is not the shapes set: /samples shows the captions of its valid split,
    each row's images after the real one, and no seen/held-out label (the run cannot know them)."""
    import torch

    from crowdtrain.checkpoint import save_checkpoint
    from crowdtrain.coordinator.db import Store
    from crowdtrain.coordinator.run import CoordinatorConfig, build_spec
    from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER
    from crowdtrain.model.transformer import DalleTransformer
    from crowdtrain.auxpeer import AuxPeer
    from tests._data_helpers import make_stripes_shards

    shards, vq = make_stripes_shards(tmp_path)
    run_dir = tmp_path / "run"
    spec = build_spec(CoordinatorConfig(run_dir=str(run_dir), data=str(shards), image_tokenizer=str(vq),
                                        preset="tiny", model_overrides={"text_len": 16, "text_vocab_size": 128}),
                      shards)
    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    aux = AuxPeer.__new__(AuxPeer)  # the checkpointer's sampling part, on the run's real spec
    aux.run_dir, aux.samples_possible, aux.spec, aux.store = run_dir, True, spec, store
    from crowdtrain.model.config import ModelConfig
    aux.model_config = ModelConfig.from_dict(spec["task"]["model"])
    torch.manual_seed(0)
    ckpt = save_checkpoint(run_dir / "checkpoints" / "step-0000002", DalleTransformer(aux.model_config), step=2,
                           assets={"text_tokenizer.json": SHAPES_TEXT_TOKENIZER, "image_tokenizer.safetensors": vq})
    store.record_checkpoint(name=ckpt.name, epoch=2, loss=3.0, files=["config.json", "model.safetensors"])
    aux.make_samples(ckpt, epoch=2)
    url, stop = serve_app(run_dir, store)
    try:
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{url}/samples")
        captions = page.locator("figure.sample figcaption").all_inner_texts()
        assert [c.strip() for c in captions] == [p["prompt"] for p in spec["sample_prompts"]]
        assert len(captions) == 6 and all("number" in c for c in captions)  # the stripes captions
        assert page.locator(".badge").count() == 0 and "never saw" not in page.content()
        assert "the first picture of its row, framed, is the real image" in page.inner_text("main")
        # Every image arrived and holds five tiles: the real one, then four samples. The page loads
        # them lazily (those below the fold once scrolled to): scroll each into view, and wait for
        # the loads that ended, well or not (a missing image is complete with width 0).
        for img in page.locator("figure.sample img").all():
            img.scroll_into_view_if_needed()
        page.wait_for_function("() => [...document.querySelectorAll('figure.sample img')].every(i => i.complete)",
                               timeout=30_000)
        sizes = page.locator("figure.sample img").evaluate_all(
            "imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert sizes == [[True, 3 * (5 * 66 + 2), 3 * 68]] * 6
        context.close()
    finally:
        stop()
        store.close()


def test_the_dashboard_draws_validation_losses_next_to_the_training_loss_and_warns_of_memorising(tmp_path, browser):
    """The losses the auxiliary peer records at checkpoints, as a real browser shows them: a line
    per held-out split on the loss chart, and the memorising problem kept current by the poll."""
    import json
    import time

    from crowdtrain.coordinator.db import Store

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "memo", "task": {"data": "shards"}}))
    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    now = time.time() - 120
    valid = [3.0, 2.5, 2.7, 2.8, 2.9]  # best at epoch 4, then above it by more than 5% three times
    for i in range(60):
        store.record_swarm_point(epoch=i // 6, loss=4.0 - 0.04 * i, active_peers=2, samples_per_second=50.0,
                                 at=now + 2 * i)
        if i % 12 == 11:
            k = i // 12
            losses = {"valid": valid[k], "heldout": valid[k] + 1.0}
            store.record_checkpoint(name=f"step-{2 * k + 2:07d}", epoch=2 * k + 2, loss=4.0 - 0.04 * i, files=[],
                                    at=now + 2 * i, valid_loss=losses)
            store.record_swarm_point(epoch=i // 6, loss=4.0 - 0.04 * i, active_peers=2, samples_per_second=50.0,
                                     at=now + 2 * i + 0.5, valid_loss=losses)
    url, stop = serve_app(run_dir, store)
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        page.goto(f"{url}/dashboard")
        page.wait_for_function("() => { const d = document.getElementById('chart-loss').data;"
                               " return d && d.length === 3; }", timeout=30_000)
        traces = page.evaluate("() => document.getElementById('chart-loss').data.map("
                               "t => ({name: t.name, y: t.y}))")
        assert [t["name"] for t in traces] == ["training", "valid (validation)", "heldout (validation)"]
        assert traces[1]["y"] == valid and traces[2]["y"] == [v + 1.0 for v in valid]
        assert len(traces[0]["y"]) == 65  # every swarm point, the checkpoints' included
        problems = page.locator("#problems li").all_inner_texts()
        assert len(problems) == 1 and "memorising" in problems[0] and "total_epochs" in problems[0]
        page.wait_for_function("() => document.getElementById('live-status').textContent.startsWith('Live')",
                               timeout=30_000)  # after a poll of /api/status the warning is still shown
        assert page.locator("#problems li").all_inner_texts() == problems and page.locator("#problems").is_visible()
        assert not errors, errors
        context.close()
    finally:
        stop()
        store.close()


def test_api_docs_render_with_every_request_outside_the_coordinator_blocked(starting_coordinator, browser):
    """/docs on a network without the Internet: Swagger UI must come from the coordinator itself."""
    from urllib.parse import urlsplit

    context = browser.new_context()
    page = context.new_page()
    blocked, errors = [], []

    def only_local(route):
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{starting_coordinator}/docs")
    # Swagger UI drew the operations from /openapi.json: one block per endpoint, /api/status among them.
    status = page.locator(".opblock-summary-path[data-path='/api/status']")
    status.wait_for(timeout=30_000)
    assert page.locator(".opblock").count() >= 10
    status.click()  # and it works: the operation opens with its "Try it out" button
    page.locator(".opblock.is-open .try-out__btn").wait_for(timeout=10_000)
    assert not blocked, f"/docs asked for files outside the coordinator: {blocked}"
    assert not errors, errors
    context.close()
