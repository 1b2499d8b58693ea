"""A throw-away PostgreSQL cluster for the database tests: Debian's server binaries, a data folder
under the test run's temporary directory, a free port on 127.0.0.1, trust authentication, gone
when the tests end. As root the server runs as the `postgres` user (it refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from crowdtrain.launch import free_port

INSTALL = "apt-get install -y postgresql (make test does it)"


def server_binaries() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).resolve().parent
    raise RuntimeError(f"PostgreSQL's server (pg_ctl, initdb) is not installed: {INSTALL}")


class Cluster:
    def __init__(self):
        self.bin = server_binaries()
        # Its own folder under the system's temporary directory: pytest's are private to root,
        # which the server's user cannot enter.
        root = Path(tempfile.mkdtemp(prefix="crowdtrain-postgres-"))
        self.root, self.data, self.port = root, root / "data", free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(root / "server.log"), "-w", "-o",
                  f"-p {self.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        self._databases = 0

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self.as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        out = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr[-2000:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database: its URL."""
        import psycopg

        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}_{int(time.time() * 1000) % 10**6}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
