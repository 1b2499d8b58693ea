"""Real TLS around a coordinator, for the tests: a certificate authority of the test's own, Caddy
(Debian's package, its internal CA) as the reverse proxy docs/organize-a-run.md describes, and
mitmproxy (Debian's package) as an attacker on the path who holds a certificate the volunteer
trusts and changes what passes (``tamper.py``, driven by a rules file the test writes).

Each server is started once per test module and ends with it."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from crowdtrain.launch import free_port


def make_certificates(folder: Path, hosts=("localhost", "127.0.0.1")) -> dict[str, Path]:
    """A CA and a server certificate it signed for ``hosts``: {"ca", "cert", "key"} PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crowdtrain test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def network_address() -> str:
    """This machine's first non-loopback IPv4 address: a client there is told apart from the
    loopback a local proxy or coordinator uses (the test fails, naming why, on a machine with none)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True)
    addresses = [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]
    assert addresses, f"this test needs a non-loopback IPv4 address on this machine: `ip addr` shows {out.stdout!r}"
    return addresses[0]


def wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.args[0]} did not listen on {port} within {timeout} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Caddy:
    """``caddy run`` with the Caddyfile of docs/organize-a-run.md: HTTPS on ``port`` for
    ``localhost`` with Caddy's internal CA (a real deployment names its domain and gets a public
    certificate the same way), forwarding to the coordinator on 127.0.0.1:``upstream``."""

    def __init__(self, folder: Path, *, upstream: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.port = folder, free_port()
        self.url = f"https://localhost:{self.port}"
        (folder / "Caddyfile").write_text(f"""{{
	admin off
	skip_install_trust
	auto_https disable_redirects
	http_port {free_port()}
	https_port {self.port}
}}

localhost:{self.port} {{
	tls internal
	reverse_proxy 127.0.0.1:{upstream}
}}
""")
        self.env = dict(os.environ, XDG_DATA_HOME=str(folder / "data"), XDG_CONFIG_HOME=str(folder / "config"),
                        HOME=str(folder))
        self.log = folder / "caddy.log"
        self.proc = subprocess.Popen([shutil.which("caddy") or "caddy", "run", "--config", str(folder / "Caddyfile"),
                                      "--adapter", "caddyfile"], stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env=self.env, cwd=folder)
        wait_for_port(self.port, self.proc, self.log)
        self.root_ca = folder / "data" / "caddy" / "pki" / "authorities" / "local" / "root.crt"
        deadline = time.monotonic() + 30
        while not self.root_ca.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.root_ca.is_file(), self.log.read_text()[-3000:]

    def close(self) -> None:
        stop(self.proc)


TAMPER_ADDON = r'''
"""mitmproxy addon: change what passes as the rules file says (written by the test)."""
import base64, hashlib, json, os

RULES = os.environ["TAMPER_RULES"]


def response(flow):
    try:
        with open(RULES) as f:
            rules = json.load(f)
    except (OSError, ValueError):
        return
    path = flow.request.path.split("?")[0]
    for rule in rules:
        if not path.endswith(rule["path_suffix"]) or flow.response.status_code not in (200, 206, 409):
            continue
        if rule["kind"] == "flip":  # one bit of the body, in its middle
            data = bytearray(flow.response.content)
            data[len(data) // 2] ^= 1
            flow.response.content = bytes(data)
        elif rule["kind"] == "replace":  # text in the body; the signature headers stay
            flow.response.content = flow.response.content.replace(rule["old"].encode(), rule["new"].encode())
        elif rule["kind"] == "resign":  # the attacker's own key: body signed by it, its key in the headers
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import padding
            key = serialization.load_pem_private_key(open(rule["key_pem"], "rb").read(), password=None)
            body = flow.response.content.replace(rule["old"].encode(), rule["new"].encode())
            nonce = flow.request.headers.get("X-Crowdtrain-Nonce", "")  # seen in the clear by this proxy
            signature = key.sign(b"crowdtrain-answer-v2\n" + nonce.encode() + b"\n" + body,
                                 padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH),
                                 hashes.SHA256())
            flow.response.content = body
            flow.response.headers["X-Crowdtrain-Signature"] = base64.b64encode(signature).decode()
            flow.response.headers["X-Crowdtrain-Key"] = key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        elif rule["kind"] == "replay":  # the first answer recorded, every later one replaced by it
            signed = ("X-Crowdtrain-Signature", "X-Crowdtrain-Key", "X-Crowdtrain-Nonce")
            if not os.path.exists(rule["file"]):
                with open(rule["file"], "w") as f:
                    json.dump({"body": base64.b64encode(flow.response.content).decode(),
                               "headers": {h: flow.response.headers.get(h, "") for h in signed}}, f)
                continue
            with open(rule["file"]) as f:
                recorded = json.load(f)
            flow.response.content = base64.b64decode(recorded["body"])
            for h in signed:
                flow.response.headers[h] = recorded["headers"][h]
        with open(RULES + ".hits", "a") as f:
            f.write(path + "\n")
'''


class Mitm:
    """mitmdump as an HTTP(S) forward proxy on 127.0.0.1:``port`` that intercepts TLS with its own
    CA (``ca``, which the volunteer is made to trust, as a compromised CA or a corporate proxy
    would be) and verifies the coordinator's certificate against ``upstream_ca``."""

    def __init__(self, folder: Path, *, upstream_ca: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.port = folder, free_port()
        self.rules = folder / "rules.json"
        (folder / "tamper.py").write_text(TAMPER_ADDON)
        self.log = folder / "mitm.log"
        env = dict(os.environ, TAMPER_RULES=str(self.rules), HOME=str(folder))
        self.proc = subprocess.Popen(
            [shutil.which("mitmdump") or "mitmdump", "--listen-host", "127.0.0.1", "--listen-port", str(self.port),
             "--set", f"confdir={folder / 'conf'}", "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}",
             "--set", "connection_strategy=lazy", "-s", str(folder / "tamper.py"), "-q"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, cwd=folder)
        wait_for_port(self.port, self.proc, self.log)
        self.ca = folder / "conf" / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 30
        while not self.ca.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.ca.is_file(), self.log.read_text()[-3000:]
        self.set_rules([])

    def set_rules(self, rules: list[dict]) -> None:
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(json.dumps(rules))
        tmp.replace(self.rules)
        Path(str(self.rules) + ".hits").unlink(missing_ok=True)

    def hits(self) -> list[str]:
        path = Path(str(self.rules) + ".hits")
        return path.read_text().split() if path.is_file() else []

    def env(self, bundle: Path) -> dict[str, str]:
        """What a volunteer behind this proxy has: the proxy in its environment and its CA trusted."""
        proxy = f"http://127.0.0.1:{self.port}"
        return {"HTTPS_PROXY": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "http_proxy": proxy,
                "NO_PROXY": "", "no_proxy": "", "SSL_CERT_FILE": str(bundle)}

    def close(self) -> None:
        stop(self.proc)
