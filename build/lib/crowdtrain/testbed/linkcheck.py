"""Measure a shaped link with a real TCP transfer between two namespaces.

The receiver counts bytes and reports the rate over the transfer minus its first half second
(the token bucket lets its burst through at line rate; TCP needs a moment to fill the link).

    python -m crowdtrain.testbed.linkcheck recv PORT SECONDS   (prints JSON)
    python -m crowdtrain.testbed.linkcheck send HOST PORT SECONDS
"""

from __future__ import annotations

import json
import socket
import sys
import time

WARMUP_S = 0.5


def receive(port: int, seconds: float) -> dict:
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(30)
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.settimeout(5)
    start = time.monotonic()
    total = counted = 0
    t_count = None
    t_last = start
    buf = bytearray(1 << 16)
    while True:
        try:
            n = conn.recv_into(buf)
        except socket.timeout:
            break
        if n == 0:
            break
        now = time.monotonic()
        total += n
        if now - start >= WARMUP_S:
            if t_count is None:
                t_count = now
            else:
                counted += n
                t_last = now
        if now - start > seconds + 5:
            break
    conn.close()
    server.close()
    span = (t_last - t_count) if t_count is not None else 0.0
    return {"bytes": total, "counted_bytes": counted, "seconds": span,
            "rate_bps": 8 * counted / span if span > 0 else 0.0}


def send(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    chunk = b"\0" * (1 << 16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn.sendall(chunk)
    conn.close()


def measure(testbed, src: str, dst: str, *, seconds: float = 3.0, port: int = 5201) -> float:
    """Bits/s from node ``src`` to node ``dst`` of a running testbed."""
    import subprocess

    py = sys.executable
    receiver = subprocess.Popen(testbed.exec_argv(dst, [py, "-m", "crowdtrain.testbed.linkcheck", "recv", str(port),
                                                        str(seconds)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the link-check receiver did not start: {receiver.stderr.read()[-2000:]}")
        sender = testbed.run(src, [py, "-m", "crowdtrain.testbed.linkcheck", "send", testbed.nodes[dst].address,
                                   str(port), str(seconds)], timeout=seconds + 40)
        if sender.returncode != 0:
            raise RuntimeError(f"the link-check sender failed: {sender.stderr[-2000:]}")
        out, err = receiver.communicate(timeout=30)
        if receiver.returncode != 0:
            raise RuntimeError(f"the link-check receiver failed: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])["rate_bps"]
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def main(argv: list[str]) -> int:
    if argv[0] == "recv":
        print(json.dumps(receive(int(argv[1]), float(argv[2]))), flush=True)
    elif argv[0] == "send":
        send(argv[1], int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
