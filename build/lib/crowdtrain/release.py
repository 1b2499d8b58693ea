"""Which crowdtrain this is, and the wheel a coordinator serves so volunteers install the same one.

Two numbers decide whether two crowdtrains may train together:

- ``PROTOCOL``: what goes over the wire and into the DHT (the signed records' fields, the access
  token and token request, ``/api/join``'s fields, the averaged tensors' layout and the state a
  newcomer downloads). Peers of different protocols cannot train together: the coordinator turns
  a volunteer of another protocol away before it starts, with the line that installs its own.
  Bump it with any change to those; ``tests/test_release.py`` fails when a record's fields change
  and it was not bumped.
- ``build_id()``: a hash of this package's files, so "the same crowdtrain" means the same code,
  whatever the version string says. The coordinator's wheel carries it as a local version
  (``0.1.0+<build>``): pip then installs the coordinator's build even over another build of the
  same release, and keeps an installed copy that is already it.

The wheel is built here, from the files this process imports (no build backend, no source tree
needed), deterministically: the same code gives the same bytes, so a restarted coordinator keeps
the same install line, hash included.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from crowdtrain import __version__

PROTOCOL = 1
NAME = "crowdtrain"
PACKAGE_ROOT = Path(__file__).resolve().parent
# What joining needs, as an extra of the served wheel: a notebook's own torch (a CUDA build) is
# kept because the base requirement is a range it satisfies.
VOLUNTEER_EXTRA = "volunteer"
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".tmp", "~")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: the same code gives the same bytes


def package_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The package's files, sorted; without byte code and editor leftovers."""
    files = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.is_file() and not _SKIP_DIRS & set(relative.parts) and not path.name.endswith(_SKIP_SUFFIXES) \
                and not path.name.startswith("."):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=None)
def build_id(root: Path = PACKAGE_ROOT) -> str:
    """12 hex digits of the SHA-256 over the package's file names and contents."""
    digest = hashlib.sha256()
    for path in package_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def full_version() -> str:
    """``__version__`` with this build as its local part, e.g. ``0.1.0+3fa2b1c9de07``."""
    return f"{__version__.split('+')[0]}+{build_id()}"


def wheel_filename(version: str | None = None) -> str:
    return f"{NAME}-{version or full_version()}-py3-none-any.whl"


@dataclass(frozen=True)
class Metadata:
    summary: str
    requires_python: str
    dependencies: list[str]
    extras: dict[str, list[str]]
    scripts: dict[str, str]


def _from_pyproject(path: Path) -> Metadata | None:
    import tomllib

    try:
        project = tomllib.loads(path.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != NAME:
        return None
    return Metadata(summary=project.get("description", ""), requires_python=project.get("requires-python", ""),
                    dependencies=list(project.get("dependencies", [])),
                    extras={k: list(v) for k, v in project.get("optional-dependencies", {}).items()},
                    scripts=dict(project.get("scripts", {})))


def _from_installed() -> Metadata:
    from importlib import metadata

    dist = metadata.distribution(NAME)
    base, extras = [], {name: [] for name in dist.metadata.get_all("Provides-Extra") or []}
    for requirement in dist.requires or []:
        match = re.search(r"""^(.*?);\s*(.*?)\s*$""", requirement)
        extra = re.fullmatch(r"""extra\s*==\s*["']([^"']+)["']""", match.group(2)) if match else None
        if extra:
            extras.setdefault(extra.group(1), []).append(match.group(1).strip())
        else:
            base.append(requirement)
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    return Metadata(summary=dist.metadata.get("Summary", ""), requires_python=dist.metadata.get("Requires-Python", ""),
                    dependencies=base, extras=extras, scripts=scripts)


def project_metadata() -> Metadata:
    """From the checkout's pyproject.toml when running from one (its extras may be newer than an
    editable install's record of them), else from the installed distribution."""
    return _from_pyproject(PACKAGE_ROOT.parent / "pyproject.toml") or _from_installed()


def _with_extra(requirement: str, extra: str) -> str:
    name, _, marker = requirement.partition(";")
    marker = marker.strip()
    condition = f'({marker}) and extra == "{extra}"' if marker else f'extra == "{extra}"'
    return f"{name.strip()}; {condition}"


def metadata_text(meta: Metadata, version: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {version}", f"Summary: {meta.summary}"]
    if meta.requires_python:
        lines.append(f"Requires-Python: {meta.requires_python}")
    lines += [f"Requires-Dist: {r}" for r in meta.dependencies]
    for extra, requirements in sorted(meta.extras.items()):
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {_with_extra(r, extra)}" for r in requirements]
    return "\n".join(lines) + "\n"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_bytes(meta: Metadata | None = None, version: str | None = None, root: Path = PACKAGE_ROOT) -> bytes:
    """A py3-none-any wheel of the package at ``root`` (PEP 427), byte for byte reproducible."""
    meta = meta or project_metadata()
    version = version or full_version()
    dist_info = f"{NAME}-{version}.dist-info"
    entries = [(f"{NAME}/{p.relative_to(root).as_posix()}", p.read_bytes()) for p in package_files(root)]
    entries.append((f"{dist_info}/METADATA", metadata_text(meta, version).encode()))
    entries.append((f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: crowdtrain.release\n"
                                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    if meta.scripts:
        scripts = "".join(f"{name} = {target}\n" for name, target in sorted(meta.scripts.items()))
        entries.append((f"{dist_info}/entry_points.txt", f"[console_scripts]\n{scripts}".encode()))
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    entries.append((f"{dist_info}/RECORD", (record + f"{dist_info}/RECORD,,\n").encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return buffer.getvalue()


@dataclass(frozen=True)
class ServedWheel:
    path: Path
    sha256: str

    @property
    def filename(self) -> str:
        return self.path.name


def build_wheel(out_dir: str | Path) -> ServedWheel:
    """This crowdtrain as a wheel in ``out_dir`` (rewritten only when the code changed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = wheel_bytes()
    path = out_dir / wheel_filename()
    if not path.is_file() or path.read_bytes() != data:
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(data)
        tmp.replace(path)
    for stale in out_dir.glob(f"{NAME}-*.whl"):  # other builds: the coordinator serves its own only
        if stale != path:
            stale.unlink()
    return ServedWheel(path=path, sha256=hashlib.sha256(data).hexdigest())


def install_line(public_url: str, wheel: ServedWheel, extra: str = VOLUNTEER_EXTRA) -> str:
    """The one command that installs this coordinator's crowdtrain on a machine with Python and pip.
    The hash makes pip refuse a download that is not this wheel."""
    url = f"{public_url.rstrip('/')}/install/{wheel.filename}#sha256={wheel.sha256}"
    return f'pip install "{NAME}[{extra}] @ {url}"'


def this_crowdtrain() -> dict:
    """What ``crowdtrain join`` says of itself to a coordinator before anything else."""
    return {"version": full_version(), "protocol": PROTOCOL}
