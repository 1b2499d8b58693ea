"""The notebooks a coordinator serves: ``/join.ipynb`` (train with the run) and ``/generate.ipynb``
(draw from its latest checkpoint), with the coordinator's address filled in.

They are built here as plain nbformat-4 JSON (the coordinator needs no Jupyter package), and do
as little as possible in the notebook itself: each installs the coordinator's crowdtrain, then
calls the same code as the command line (``crowdtrain join`` in a child process, so that Ctrl-C
in a terminal and "interrupt the kernel" in a notebook leave the run the same clean way;
``crowdtrain.remote`` and ``crowdtrain.data.generate`` for drawing). What a notebook user may want
to change sits in its first code cell.

``tests/test_volunteer_from_zero.py`` executes both on a real kernel against a real coordinator.
"""

from __future__ import annotations

import json

_METADATA = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
             "language_info": {"name": "python"}}


def _cell(kind: str, source: str) -> dict:
    cell = {"cell_type": kind, "metadata": {}, "source": source.strip("\n").splitlines(keepends=True)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _notebook(cells: list[tuple[str, str]]) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": _METADATA,
            "cells": [dict(_cell(kind, source), id=f"cell-{i}") for i, (kind, source) in enumerate(cells)]}


# Installs the coordinator's build and the extras this notebook needs; pip keeps what is already
# there (the notebook's torch; crowdtrain itself when it is this build) in a few seconds. The
# wheel's hash comes in an answer signed by the coordinator's key, checked against PIN before pip
# runs (crowdtrain.runspec.trust does the same, once installed), and makes pip refuse any other
# file. Which crowdtrain is installed is asked of a fresh interpreter: the kernel may hold another
# one in memory.
_INSTALL = '''
import base64, hashlib, json, secrets, subprocess, sys, urllib.request

try:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding
except ImportError:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cryptography"], check=True)
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

nonce = secrets.token_hex(16)  # the answer must be signed for this request: no replay of an older one
answer = urllib.request.urlopen(urllib.request.Request(COORDINATOR.rstrip("/") + "/api/version",
                                                       headers={"X-Crowdtrain-Nonce": nonce}), timeout=60)
body, key = answer.read(), answer.headers.get("X-Crowdtrain-Key") or ""
seen = "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(key.split()[1] if key else "")).digest()
                                    ).decode().rstrip("=")
if seen != PIN:
    raise SystemExit(f"the coordinator at {COORDINATOR} has key {seen}, not PIN {PIN}: not installing from it")
serialization.load_ssh_public_key(key.encode()).verify(
    base64.b64decode(answer.headers["X-Crowdtrain-Signature"]), b"crowdtrain-answer-v2\\n" + nonce.encode() + b"\\n" + body,
    padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH), hashes.SHA256())
run = json.loads(body)
subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                f"crowdtrain[{EXTRAS}] @ {run['wheel']}#sha256={run['wheel_sha256']}"], check=True)
probe = subprocess.run([sys.executable, "-c", "from crowdtrain.release import full_version; print(full_version())"],
                       capture_output=True, text=True)
print(f"crowdtrain {probe.stdout.strip()} is installed; the run's is {run['version']} (protocol {run['protocol']})")
if "crowdtrain.release" in sys.modules and sys.modules["crowdtrain.release"].full_version() != run["version"]:
    print("another crowdtrain is loaded in this kernel: restart the kernel, then run all cells again")
'''


def join_notebook(coordinator_url: str, *, run_id: str | None = None, auth_mode: str = "open",
                  pin: str = "") -> dict:
    """``pin``: the fingerprint of the coordinator's key (crowdtrain.runspec.trust)."""
    url = json.dumps(coordinator_url.rstrip("/"))
    title = f"Join the run {run_id}" if run_id else "Join the run"
    key_line = ("KEY = None  # your API key: this run admits invited users only (the organizer makes it)"
                if auth_mode == "allowlist" else
                "KEY = None  # an API key, only for runs that admit invited users")
    return _notebook([
        ("markdown", f"""
# {title}

Your GPU (or CPU) trains one shared text-to-image model with the other volunteers of this run, through
its coordinator at {coordinator_url}. Run all cells: they install the crowdtrain the run uses, pick a batch
size for this device, and train until the run ends or you stop it (**Interrupt the kernel** leaves the run
cleanly; your contribution so far stays on the leaderboard at {coordinator_url.rstrip('/')}/leaderboard).

Nothing else runs on this machine: peers exchange tensors and plain data only, never code."""),
        ("code", f"""
COORDINATOR = {url}  # this run's coordinator
PIN = {json.dumps(pin)}  # its key's fingerprint, as its join page shows it: nothing else is installed or joined
USER = "anonymous"  # the leaderboard's name for you: 1-64 letters, digits, '-', '_', '.'
{key_line}
MINUTES = None  # leave after this many minutes; None: until the run ends or you interrupt the kernel
MAX_EPOCHS = None  # or leave once the swarm reaches this global epoch
# Notebooks (Colab, Kaggle) cannot take incoming connections: this peer then only dials out. On a
# machine with a public address, False lets other peers reach it and makes the swarm faster.
CLIENT_MODE = True
BATCH_SIZE = "auto"  # samples per step; auto: the most the memory calculator says fits this device
EXTRAS = "volunteer"
"""),
        ("code", _INSTALL),
        ("code", """
# The device and batch size `crowdtrain join` will use (it says the same when it starts).
from crowdtrain.swarm.machine import describe_device_and_batch

print(describe_device_and_batch(COORDINATOR, batch_size=BATCH_SIZE, pin=PIN))
"""),
        ("code", """
# Train. The progress line updates in place; Interrupt the kernel to leave cleanly.
import atexit, os, signal, tempfile, time
from IPython.display import display
from crowdtrain.lifecycle import own_session_child

summary_file = os.path.join(tempfile.mkdtemp(prefix="crowdtrain-"), "summary.json")
command = [sys.executable, "-m", "crowdtrain.cli", "join", COORDINATOR, "--pin", PIN, "--user", USER,
           "--batch-size", str(BATCH_SIZE), "--summary-file", summary_file]
command += ["--client-mode"] if CLIENT_MODE else []
command += ["--minutes", str(MINUTES)] if MINUTES else []
command += ["--max-epochs", str(MAX_EPOCHS)] if MAX_EPOCHS else []
env = dict(os.environ, CROWDTRAIN_KEY=KEY) if KEY else None  # not on the command line, where others see it
# Its own session: the kernel's interrupt reaches this cell, which asks the peer to leave; the peer
# gets SIGTERM (a clean leave too) if the kernel itself dies.
peer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                        start_new_session=True, preexec_fn=own_session_child)
atexit.register(lambda: peer.poll() is None and peer.send_signal(signal.SIGTERM))
progress = display("starting...", display_id=True)
contribution, asked = "", 0.0


def credited():
    try:
        board = json.load(urllib.request.urlopen(COORDINATOR + "/api/leaderboard", timeout=10))
        mine = [row for row in board if row.get("user") == USER]
        return f" | on the leaderboard: {mine[0]['samples']} samples" if mine else ""
    except Exception:
        return ""


try:
    for line in peer.stdout:
        line = line.rstrip()
        if " | contributed " in line:
            if time.monotonic() - asked > 30:
                contribution, asked = credited(), time.monotonic()
            progress.update(line + contribution)
        else:
            print(line)
    peer.wait()
except KeyboardInterrupt:
    print("leaving the run cleanly (the last step finishes first)...")
    peer.send_signal(signal.SIGINT)
    for line in peer.stdout:
        print(line.rstrip())
    peer.wait()
print("crowdtrain join exited with code", peer.returncode)
if os.path.exists(summary_file):
    summary = json.load(open(summary_file))
    print(f"you contributed {summary['credited_samples']} samples to {summary['credited_steps']} global steps "
          f"(epochs {summary.get('joined_epoch')} to {summary.get('final_epoch')})")
"""),
    ])


def generate_notebook(coordinator_url: str, *, run_id: str | None = None, pin: str = "") -> dict:
    url = json.dumps(coordinator_url.rstrip("/"))
    title = f"Draw with the run {run_id}" if run_id else "Draw with the run"
    return _notebook([
        ("markdown", f"""
# {title}

Fetch the newest checkpoint of the run at {coordinator_url} with its tokenizers, and draw the run's
prompts (or your own): for each prompt the model draws `SAMPLES` pictures and the best `KEEP` are shown.
A GPU draws in seconds; a CPU takes a few seconds per picture."""),
        ("code", f"""
COORDINATOR = {url}  # this run's coordinator
PIN = {json.dumps(pin)}  # its key's fingerprint, as its join page shows it: every file is checked against its signature
CHECKPOINT = "latest"  # latest, best (lowest validation loss), or a name from the checkpoints page
PROMPTS = None  # a list of your own prompts; None: the prompts the run draws on its samples page
SAMPLES = 32  # pictures drawn per prompt (the paper: 128)
KEEP = 4  # the best ones shown per prompt
EXTRAS = "draw"
"""),
        ("code", _INSTALL),
        ("code", """
import torch
from IPython.display import Image, display
from crowdtrain.data.config import GenerateConfig
from crowdtrain.data.generate import generate_rows
from crowdtrain.remote import fetch_checkpoint, run_prompts

device = "cuda" if torch.cuda.is_available() else "cpu"
checkpoint = fetch_checkpoint(COORDINATOR, which=CHECKPOINT, pin=PIN)
prompts = PROMPTS or run_prompts(COORDINATOR)
print(f"checkpoint {checkpoint.name} on {device}: {len(prompts)} prompts")
result = generate_rows(checkpoint, prompts, GenerateConfig(num_samples=SAMPLES, keep=KEEP),
                       out="crowdtrain-samples.png", device=device, say=print)
display(Image(filename=result["out"]))
"""),
    ])
