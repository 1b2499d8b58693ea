"""The coordinator under the traffic of a large run: dashboard viewers, volunteers, the auxiliary peer.

A real coordinator web process (uvicorn, as ``crowdtrain coordinator`` runs it) on 127.0.0.1,
on a run folder and database filled as ~1,000 volunteers over some hours leave them (peers,
users, swarm points every 2 s, contributions every epoch, checkpoints with samples, counters,
metrics reports; written with the ``Store``'s own methods), and ``run.json`` and a
``status.json`` listing every live peer, as the auxiliary peer writes them. Three more processes
(so no two share a GIL):

- viewers: ``--viewers`` browsers, each opening a page (``/``, ``/dashboard``, ``/leaderboard``),
  then the dashboard, which polls ``/api/status`` and ``/api/history?since=...`` every 5 s
  (``static/dashboard.js``); now and then one opens another page;
- volunteers: ``--volunteers`` peers, each asking ``/api/join`` every 15 s
  (``crowdtrain.swarm.schedule_watch``) and renewing its token with a signed ``POST /api/token``
  every quarter of the token lifetime (``crowdtrain.swarm.auth.refresh_margin_s``); signed with
  real identities from a pool of ``--keys`` (generated once, kept in ``--work``);
  viewers and volunteers share one asyncio + httpx process;
- ingest: the auxiliary peer's database writes for that many peers publishing a metrics record
  every 5 s: every 2 s a batch of records, a swarm point, a credit per record, ``status.json``
  rewritten. Its rows are counted before and after: a record lost is a failure.

First a baseline on the same server (one client, one request at a time, no other load), then the
load. Reported per endpoint: requests/s, p50 and p99 latency, errors (non-2xx or no answer), and
p50/p99 as ratios to the baseline; the server's CPU seconds per request (steadier than latency on
a shared machine); the client's event-loop lag (if it is high, the client, not the server, was
the bottleneck: use fewer viewers or a bigger machine). Targets: p99 under 200 ms for the pages
and ``/api/status``, no errors, no record lost.

    python benchmarks/bench_coordinator_load.py --db sqlite            # ~1.5 min; JSON in benchmarks/results/
    python benchmarks/bench_coordinator_load.py --db postgres          # a throw-away cluster (tests/postgres.py)
    python benchmarks/bench_coordinator_load.py --db sqlite --viewers 5 --volunteers 20 --seconds 5 --hours 0.2

tests/test_coordinator_load.py runs it at that tiny scale.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results"
PAGES = ("/", "/dashboard", "/leaderboard")
REFRESH_S = 5.0  # crowdtrain.coordinator.pages.REFRESH_MS
JOIN_POLL_S = 15.0  # crowdtrain.swarm.schedule_watch.ScheduleWatch.poll_s
REPORT_S = 5.0  # a peer publishes a metrics record every 5 s (crowdtrain.swarm.peer)
AUX_REFRESH_S = 2.0  # the auxiliary peer's loop (crowdtrain.auxpeer.AuxPeer.run)
TOKEN_LIFETIME_S = 600.0  # crowdtrain.coordinator.service.AuthSettings
TARGET_BATCH = 4096
# A peer's OpenSSH public key and signatures are this long in real records (RSA 2048).
FAKE_KEY = "ssh-rsa " + "A" * 364
FAKE_SIG = "S" * 344


def peer_id(i: int) -> str:
    return "Qm" + hashlib.sha256(f"peer{i}".encode()).hexdigest()[:44]


def user_of(i: int, volunteers: int) -> str:
    """Most users run one peer; one in five runs a second one."""
    return f"volunteer{i % max(1, int(volunteers * 0.8)):04d}"


def record(i: int, volunteers: int, *, at: float, epoch: int, session: str, samples: int, steps: int) -> dict:
    """A PeerMetrics record as the auxiliary peer screens it (``crowdtrain.swarm.metrics.PeerMetrics``)."""
    return {"peer_id": peer_id(i), "epoch": epoch, "samples": samples, "samples_per_second": 20.0 + i % 50,
            "loss": 3.0 + (i % 7) / 10, "steps": steps, "time": at, "client_mode": i % 3 == 0,
            "last_round_peers": 16, "swarm_peers": volunteers, "fingerprint": "f" * 16,
            "user": user_of(i, volunteers),
            "maddrs": [] if i % 3 == 0 else [f"/ip4/10.0.{i // 250}.{i % 250}/tcp/{40000 + i}/p2p/{peer_id(i)}"],
            "identity": FAKE_KEY, "identity_proof": FAKE_SIG, "session": session, "credited_samples": samples,
            "credited_steps": steps}


# ---- the run folder and its database -------------------------------------------------------------
def write_run_files(run_dir: Path, *, volunteers: int, epoch: int, now: float) -> None:
    """``run.json`` from the spec the coordinator really builds, ``status.json`` with every live peer."""
    from crowdtrain.coordinator.run import CoordinatorConfig, build_spec
    from crowdtrain.runspec import files

    spec = build_spec(CoordinatorConfig(run_dir=str(run_dir), data="shapes"), shards_dir=run_dir.parent / "shards")
    info = files.RunInfo(run_id="bench-load", fingerprint="f" * 16, swarm=spec["swarm"], task=spec["task"],
                         initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/QmCoordinator"],
                         coordinator_peer_id="QmCoordinator", text_tokenizer=spec["text_tokenizer"],
                         auth={"mode": "open", "coordinator_public_key": FAKE_KEY,
                               "token_url": "http://127.0.0.1/api/token", "token_lifetime_s": TOKEN_LIFETIME_S},
                         schedule={"total_epochs": 10 * epoch, "finished_at": None})
    files.write_json_atomic(run_dir / files.RUN_INFO, info.to_dict())
    write_status(run_dir, volunteers=volunteers, epoch=epoch, now=now)


def write_status(run_dir: Path, *, volunteers: int, epoch: int, now: float) -> None:
    from crowdtrain.runspec import files

    live = [record(i, volunteers, at=now - i % REPORT_S, epoch=epoch, session="s", samples=0, steps=0)
            for i in range(volunteers)]
    status = files.RunStatus(epoch=epoch, peers=live, updated=now, last_checkpoint_epoch=epoch - epoch % 10,
                             samples_per_second=sum(r["samples_per_second"] for r in live),
                             total_epochs=10 * epoch, target_batch_size=TARGET_BATCH, epochs_per_second=1 / 60,
                             rounds={"window_s": 300.0, "rounds": 5 * volunteers, "apart": 0, "users": []})
    files.write_json_atomic(run_dir / files.STATUS, status.to_dict())


def fill(store, *, volunteers: int, hours: float, now: float, epoch_s: float = 60.0,
         metrics_minutes: float = 5.0) -> dict:
    """The database a run of ``volunteers`` over ``hours`` leaves: each volunteer trains for a
    stretch of the run (a quarter to all of it); swarm points every 2 s; a contribution per peer
    and epoch it trained in (as rows: see below); a checkpoint every 10 epochs, with samples; the last
    ``metrics_minutes`` of metrics records (older ones only fill a table no page scans)."""
    from sqlalchemy import insert

    from crowdtrain.coordinator.db import Contribution

    rng = random.Random(0)
    start = now - hours * 3600
    epochs = max(1, int(hours * 3600 / epoch_s))
    spans = []
    for i in range(volunteers):
        length = rng.uniform(0.25, 1.0) * epochs
        first = int(rng.uniform(0, epochs - length))
        spans.append((first, int(first + length)))
    for i in range(volunteers):
        store.ensure_open_user(user_of(i, volunteers))
        store.peer_joined(peer_id(i), user_of(i, volunteers), FAKE_KEY)
    t = start
    point_every = AUX_REFRESH_S
    credits = []
    for epoch in range(epochs):
        active = [i for i, (a, b) in enumerate(spans) if a <= epoch < b]
        # What Store.record_credit leaves, one row per peer and epoch, written in bulk: 100,000
        # calls of it (one transaction each) would take minutes. The live ingest calls it.
        credits += [{"peer_id": peer_id(i), "user": user_of(i, volunteers), "epoch": epoch, "samples": 64,
                     "steps": 1, "compute_s": 3.2, "time": start + epoch * epoch_s} for i in active]
        end = start + (epoch + 1) * epoch_s
        while t < end:
            store.record_swarm_point(epoch=epoch, loss=4.0 - epoch / epochs, active_peers=len(active),
                                     samples_per_second=20.0 * len(active), at=t)
            t += point_every
        if epoch and epoch % 10 == 0:
            name = f"step-{epoch:06d}"
            store.record_checkpoint(name=name, epoch=epoch, loss=3.5, files=["config.json", "model.safetensors"],
                                    at=end, valid_loss={"valid": 3.6, "heldout": 3.9}, valid_rows={"valid": 256})
            store.record_swarm_point(epoch=epoch, loss=3.5, active_peers=len(active), samples_per_second=1.0,
                                     at=end + 0.5, valid_loss={"valid": 3.6, "heldout": 3.9})
            for k in range(8):
                store.record_sample(checkpoint=name, epoch=epoch, prompt=f"a red square {k}",
                                    path=f"samples/{name}/{k}.png", tag="seen" if k % 2 else "held-out")
    with store.session.begin() as s:
        s.execute(insert(Contribution), credits)
    store.mark_pruned([f"step-{e:06d}" for e in range(epochs - 30, epochs) if e > 0 and e % 10 == 0])
    store.mark_best(f"step-{(epochs - 1) // 10 * 10:06d}" if epochs > 10 else None)
    batch = []
    for at in range(int(now - metrics_minutes * 60), int(now), int(REPORT_S)):
        batch += [record(i, volunteers, at=float(at) + i / volunteers, epoch=epochs, session=f"s{i}", samples=0,
                         steps=0) for i in range(volunteers)]
        if len(batch) >= 2000:
            store.record_metrics(batch)
            batch = []
    store.record_metrics(batch)
    store.add_new_counts({}, {"tokens_issued": 4 * volunteers, "token_requests_rate_limited": 3,
                              "metrics_records_refused": 12})
    return {"epochs": epochs, **table_rows(store)}


def table_rows(store) -> dict:
    from sqlalchemy import text

    with store.engine.connect() as c:
        return {t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in
                ("users", "peers", "metrics", "swarm_points", "contributions", "checkpoints", "samples")}


# ---- the processes ----------------------------------------------------------------------------------
def serve(run_dir: Path, url: str, port: int, requests_per_minute: int) -> None:
    """The coordinator's web process, as ``crowdtrain.coordinator.run.run_coordinator`` runs it."""
    import uvicorn

    from crowdtrain.coordinator.db import Store
    from crowdtrain.coordinator.service import AuthSettings, create_app

    store = Store(url)
    app = create_app(run_dir, store=store, public_url=f"http://127.0.0.1:{port}",
                     auth=AuthSettings(mode="open", key_path=run_dir / "coordinator_key.pem",
                                       token_lifetime_s=TOKEN_LIFETIME_S, requests_per_minute=requests_per_minute))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def ingest(run_dir: Path, url: str, *, volunteers: int, seconds: float, epoch: int, out: Path) -> None:
    """The auxiliary peer's writes (``crowdtrain.auxpeer.AuxPeer.collect``) for ``volunteers`` peers
    each publishing every ``REPORT_S``; an epoch passes every 60 s, so credits are written too."""
    from crowdtrain.coordinator.db import Store

    store = Store(url)
    before = table_rows(store)
    with store.session() as s:
        from sqlalchemy import func, select

        from crowdtrain.coordinator.db import Contribution
        samples_before = s.scalar(select(func.coalesce(func.sum(Contribution.samples), 0)))
    sent = credited = 0
    turns = []
    ledgers = {i: 0 for i in range(volunteers)}
    start = time.time()
    turn_index = 0
    while time.time() - start < seconds:
        t0 = time.time()
        # Peers whose 5 s report fell in this 2 s turn: records of the same peer differ in time.
        due = [i for i in range(volunteers) if int((t0 + i) / REPORT_S) != int((t0 + i - AUX_REFRESH_S) / REPORT_S)]
        current = epoch + int((t0 - start) / 60)
        batch = []
        for i in due:
            if turn_index and (t0 + i * 0.06) % 60 < AUX_REFRESH_S:  # this peer's ledger grew by one step
                ledgers[i] += 1
            batch.append(record(i, volunteers, at=t0 + i / volunteers / 10, epoch=current,
                                session=f"load{i}", samples=ledgers[i] * 64, steps=ledgers[i]))
        store.users_of_peers([r["peer_id"] for r in batch])
        sent += store.record_metrics(batch)
        store.record_swarm_point(epoch=current, loss=3.0, active_peers=volunteers,
                                 samples_per_second=20.0 * volunteers, at=t0)
        for r in batch:
            done = store.record_credit(peer_id=r["peer_id"], session=r["session"], samples=r["credited_samples"],
                                       steps=r["credited_steps"], epoch=current - 1,
                                       samples_per_second=r["samples_per_second"],
                                       max_samples_per_step=2 * TARGET_BATCH)
            credited += done["samples"]
        store.add_new_counts({}, {"metrics_records_refused": 0})
        write_status(run_dir, volunteers=volunteers, epoch=current, now=t0)
        turns.append({"records": len(batch), "seconds": time.time() - t0})
        turn_index += 1
        time.sleep(max(0.0, AUX_REFRESH_S - (time.time() - t0)))
    elapsed = time.time() - start
    after = table_rows(store)
    with store.session() as s:
        samples_after = s.scalar(select(func.coalesce(func.sum(Contribution.samples), 0)))
    durations = sorted(t["seconds"] for t in turns)
    out.write_text(json.dumps({
        "records_sent": sum(t["records"] for t in turns), "records_new": sent,
        "records_stored": after["metrics"] - before["metrics"], "records_per_s": sent / elapsed,
        "samples_credited": credited, "samples_stored": samples_after - samples_before,
        "turns": len(turns), "turn_p50_s": percentile(durations, 50), "turn_max_s": durations[-1] if turns else None,
        "turns_over_refresh": sum(d > AUX_REFRESH_S for d in durations), "seconds": elapsed}))


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def make_keys(folder: Path, count: int) -> list:
    """A pool of real peer identities (RSA 2048: about 0.1 s each to make, so kept between runs)."""
    from crowdtrain.swarm.auth import load_identity

    folder.mkdir(parents=True, exist_ok=True)
    return [load_identity(folder / f"peer{i}.key") for i in range(count)]


async def load(base: str, *, viewers: int, volunteers: int, seconds: float, max_requests: int, keys_dir: Path,
               keys: int, baseline: bool) -> dict:
    import httpx

    from crowdtrain.runspec.tokens import token_request

    pool = [(k, k.get_public_key().to_bytes()) for k in make_keys(keys_dir, keys)]
    samples: dict[str, list[float]] = {}
    errors: dict[str, dict[str, int]] = {}
    issued = 0
    deadline = math.inf  # set when the clients start: making the keys above takes seconds on a busy machine

    def budget() -> bool:
        return issued < max_requests and time.perf_counter() < deadline

    async def request(client, name: str, method: str, path: str, **kwargs):
        """One request, timed; none once the time or the request budget is spent (None)."""
        nonlocal issued
        if not budget():
            return None
        issued += 1
        t0 = time.perf_counter()
        try:
            r = await client.request(method, path, **kwargs)
            ok = 200 <= r.status_code < 300
            what = None if ok else str(r.status_code)
        except httpx.HTTPError as e:
            r, what = None, type(e).__name__
        samples.setdefault(name, []).append(time.perf_counter() - t0)
        if what is not None:
            errors.setdefault(name, {})
            errors[name][what] = errors[name].get(what, 0) + 1
        return r

    def token_body(i: int) -> dict:
        key, public = pool[i % len(pool)]
        return token_request(public, user_of(i, volunteers), key.sign)

    async def sleep_until(t: float) -> None:
        await asyncio.sleep(max(0.0, min(t, deadline) - time.perf_counter()))

    async def viewer(client, rng: random.Random):
        await asyncio.sleep(rng.uniform(0, REFRESH_S))  # viewers arrive at random moments
        if not budget():
            return
        first = rng.choice(PAGES)
        await request(client, first, "GET", first)
        await request(client, "/dashboard", "GET", "/dashboard")
        since = time.time() - 600  # the page embedded the history up to about now
        while budget():
            await sleep_until(time.perf_counter() + REFRESH_S)
            if not budget():
                break
            if rng.random() < REFRESH_S / 60:  # about one other page a minute
                page = rng.choice(PAGES)
                await request(client, page, "GET", page)
            _, history = await asyncio.gather(
                request(client, "/api/status", "GET", "/api/status"),
                request(client, "/api/history", "GET", "/api/history", params={"since": since}))
            if history is not None and history.status_code == 200 and history.json():
                since = history.json()[-1]["time"] or since

    async def volunteer(client, i: int, rng: random.Random):
        now = time.perf_counter()
        next_join, next_token = now + rng.uniform(0, JOIN_POLL_S), now + rng.uniform(0, TOKEN_LIFETIME_S / 4)
        while budget():
            await sleep_until(min(next_join, next_token))
            if not budget():
                break
            if time.perf_counter() >= next_join:
                await request(client, "/api/join", "GET", "/api/join")
                next_join += JOIN_POLL_S
            if time.perf_counter() >= next_token:
                await request(client, "/api/token", "POST", "/api/token", json=token_body(i))
                next_token += TOKEN_LIFETIME_S / 4

    async def sequential(client):
        """The baseline: every endpoint in turn, one request at a time."""
        i = 0
        while budget():
            for name in (*PAGES, "/api/status", "/api/history", "/api/join", "/api/token"):
                if name == "/api/history":
                    await request(client, name, "GET", name, params={"since": time.time() - 10})
                elif name == "/api/token":
                    await request(client, name, "POST", name, json=token_body(i))
                else:
                    await request(client, name, "GET", name)
            i += 1

    lags = []

    async def lag_probe():
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await asyncio.sleep(0.1)
            lags.append(time.perf_counter() - t0 - 0.1)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        if baseline:
            tasks = [sequential(client)]
        else:
            rng = random.Random(1)
            tasks = [viewer(client, random.Random(rng.random())) for _ in range(viewers)]
            tasks += [volunteer(client, i, random.Random(rng.random())) for i in range(volunteers)]
        await asyncio.gather(lag_probe(), *tasks)
        elapsed = time.perf_counter() - t0
    lags.sort()
    return {"seconds": elapsed, "requests": issued, "loop_lag_p99_ms": 1000 * (percentile(lags, 99) or 0.0),
            "endpoints": {name: summary(times, errors.get(name, {}), elapsed) for name, times in sorted(samples.items())}}


def summary(times: list[float], errors: dict[str, int], elapsed: float) -> dict:
    times = sorted(times)
    return {"n": len(times), "per_s": len(times) / elapsed, "p50_ms": 1000 * percentile(times, 50),
            "p99_ms": 1000 * percentile(times, 99), "mean_ms": 1000 * statistics.fmean(times),
            "errors": sum(errors.values()), "error_kinds": errors}


# ---- one database, end to end ------------------------------------------------------------------------
# ``--generator-cpus``: the CPUs the load generator and the feeder run on; the coordinator gets
# the others, so its latency is its own and not the generator's (Linux only).
GENERATOR_CPUS: set[int] = set()


def child(role: str, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if GENERATOR_CPUS:
        mine = GENERATOR_CPUS if role in ("load", "ingest") else set(os.sched_getaffinity(0)) - GENERATOR_CPUS
        popen["preexec_fn"] = lambda: os.sched_setaffinity(0, mine)
    return subprocess.Popen([sys.executable, __file__, "--role", role, *args], env=env, **popen)


def parse_cpus(text: str) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8}."""
    cpus = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def wait_ready(base: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {server.returncode} before answering")
        try:
            if httpx.get(f"{base}/api/version", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator did not answer within {timeout_s:.0f} s")


def run_database(kind: str, args, work: Path) -> dict:
    from crowdtrain.coordinator.db import Store, default_url
    from crowdtrain.launch import free_port

    cluster = None
    run_dir = work / f"run-{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if kind == "postgres":
        from tests.postgres import Cluster  # the test suite's throw-away cluster

        cluster = Cluster()
        url = cluster.new_database()
    else:
        url = default_url(run_dir)
    server = None
    try:
        now = time.time()
        t0 = time.perf_counter()
        store = Store(url)
        rows = fill(store, volunteers=args.volunteers, hours=args.hours, now=now)
        store.close()
        fill_s = time.perf_counter() - t0
        write_run_files(run_dir, volunteers=args.volunteers, epoch=rows["epochs"], now=now)
        print(f"[{kind}] filled in {fill_s:.0f} s: {rows}", flush=True)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # Every volunteer's renewals come from 127.0.0.1, one address: give it the whole population's budget.
        per_minute = max(120, int(2 * args.volunteers * 60 / (TOKEN_LIFETIME_S / 4)) + 60)
        server = child("serve", "--run-dir", str(run_dir), "--url", url, "--port", str(port),
                       "--requests-per-minute", str(per_minute))
        wait_ready(base, server)
        phases = {}
        for phase, seconds in (("baseline", args.baseline_seconds), ("load", args.seconds)):
            out = work / f"{kind}-{phase}.json"
            common = ["--base", base, "--seconds", str(seconds), "--max-requests", str(args.max_requests),
                      "--viewers", str(args.viewers), "--volunteers", str(args.volunteers),
                      "--keys", str(args.keys), "--work", str(work), "--out", str(out)]
            feeder = None
            if phase == "load":
                feeder = child("ingest", "--run-dir", str(run_dir), "--url", url, "--volunteers",
                               str(args.volunteers), "--seconds", str(seconds), "--epoch", str(rows["epochs"]),
                               "--out", str(work / f"{kind}-ingest.json"))
            cpu0 = cpu_s(server.pid)
            client = child("load", *common, *(["--baseline"] if phase == "baseline" else []))
            client.wait(timeout=seconds + 300)
            server_cpu = cpu_s(server.pid) - cpu0
            if client.returncode:
                raise RuntimeError(f"the load generator failed ({client.returncode})")
            result = json.loads(out.read_text())
            result["server_cpu_s"] = server_cpu
            result["server_cpu_ms_per_request"] = 1000 * server_cpu / max(result["requests"], 1)
            if feeder is not None:
                feeder.wait(timeout=seconds + 300)
                ingested = json.loads((work / f"{kind}-ingest.json").read_text())
                ingested["records_lost"] = ingested["records_sent"] - ingested["records_stored"]
                ingested["samples_lost"] = ingested["samples_credited"] - ingested["samples_stored"]
                result["ingest"] = ingested
            phases[phase] = result
        for name, r in phases["load"]["endpoints"].items():
            base_r = phases["baseline"]["endpoints"].get(name)
            if base_r:
                r["p50_ratio"], r["p99_ratio"] = r["p50_ms"] / base_r["p50_ms"], r["p99_ms"] / base_r["p99_ms"]
        return {"db": kind, "fill_s": fill_s, "rows": rows, "token_requests_per_minute": per_minute, **phases}
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
        if cluster is not None:
            cluster.stop()


def print_table(result: dict) -> None:
    print(f"\n{result['db']}: {result['rows']}")
    print(f"{'phase':9s} {'endpoint':14s} {'n':>6s} {'req/s':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'errors':>6s} "
          f"{'p50 x':>6s} {'p99 x':>6s}")
    for phase in ("baseline", "load"):
        r = result[phase]
        for name, e in r["endpoints"].items():
            ratios = (f"{e['p50_ratio']:6.1f} {e['p99_ratio']:6.1f}" if "p50_ratio" in e else f"{'':6s} {'':6s}")
            print(f"{phase:9s} {name:14s} {e['n']:6d} {e['per_s']:7.1f} {e['p50_ms']:8.1f} {e['p99_ms']:8.1f} "
                  f"{e['errors']:6d} {ratios}")
        print(f"{phase:9s} {'(all)':14s} {r['requests']:6d} {r['requests'] / r['seconds']:7.1f}   server "
              f"{r['server_cpu_ms_per_request']:.1f} CPU ms/request, client loop lag p99 {r['loop_lag_p99_ms']:.0f} ms")
    i = result["load"]["ingest"]
    print(f"ingest: {i['records_per_s']:.0f} records/s, {i['turns']} turns (p50 {i['turn_p50_s']:.2f} s, max "
          f"{i['turn_max_s']:.2f} s, {i['turns_over_refresh']} over {AUX_REFRESH_S:.0f} s), records lost "
          f"{i['records_lost']}, samples lost {i['samples_lost']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", nargs="+", choices=("sqlite", "postgres"), default=["sqlite"])
    p.add_argument("--viewers", type=int, default=200)
    p.add_argument("--volunteers", type=int, default=1000)
    p.add_argument("--hours", type=float, default=3.0, help="length of the run the database holds")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the load")
    p.add_argument("--baseline-seconds", type=float, default=8.0)
    p.add_argument("--max-requests", type=int, default=50_000)
    p.add_argument("--keys", type=int, default=64, help="peer identities the volunteers sign with")
    p.add_argument("--work", default="runs/bench-coordinator-load")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/...<timestamp>.json)")
    p.add_argument("--generator-cpus", default="", help="CPUs for the load generator and feeder, e.g. 12-15; "
                                                        "the coordinator runs on the others (default: shared)")
    # The child processes (the script runs itself).
    p.add_argument("--role", choices=("serve", "ingest", "load"), help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--requests-per-minute", type=int, help=argparse.SUPPRESS)
    p.add_argument("--epoch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    GENERATOR_CPUS.update(parse_cpus(args.generator_cpus))
    work = Path(args.work).resolve()
    if args.role == "serve":
        serve(Path(args.run_dir), args.url, args.port, args.requests_per_minute)
        return 0
    if args.role == "ingest":
        ingest(Path(args.run_dir), args.url, volunteers=args.volunteers, seconds=args.seconds, epoch=args.epoch,
               out=Path(args.out))
        return 0
    if args.role == "load":
        result = asyncio.run(load(args.base, viewers=args.viewers, volunteers=args.volunteers, seconds=args.seconds,
                                  max_requests=args.max_requests, keys_dir=work / "keys", keys=args.keys,
                                  baseline=args.baseline))
        Path(args.out).write_text(json.dumps(result))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    make_keys(work / "keys", args.keys)  # once, before anything is timed
    results = {"viewers": args.viewers, "volunteers": args.volunteers, "hours": args.hours, "seconds": args.seconds,
               "cpus": os.cpu_count(), "load_average": os.getloadavg(),
               "databases": [run_database(kind, args, work) for kind in args.db]}
    for result in results["databases"]:
        print_table(result)
    path = Path(args.out) if args.out else RESULTS / f"bench_coordinator_load_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
