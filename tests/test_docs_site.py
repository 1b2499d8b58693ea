"""The docs cannot rot: the site builds with warnings as errors, and what the pages name is real.

`mkdocs build --strict` (mkdocs.yml) fails on a link to a missing page or anchor, a page left out
of the nav, and an API reference entry (``::: crowdtrain.x.y``) naming a module or object that no
longer exists. What MkDocs cannot see is checked here in-process: every ``crowdtrain SUB ...``
command quoted in a code span or block names a real subcommand and real flags of crowdtrain.cli's
parser; every ``crowdtrain/...``, ``benchmarks/...``, ``tests/...``, ``examples/...`` and
``docs/...`` path exists (and a ``tests/x.py::name`` names a function of that file); every
dotted ``crowdtrain.x.y`` name resolves in the source; the README's relative links (GitHub reads
them, MkDocs does not) point at files and headings that exist; and the organizer's guide, which
the coordinator also serves at ``/organize``, has only links that work there; and every module
is in the API reference.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _pages() -> list[Path]:
    """README and every hand-written docs page (the API pages hold only ``:::`` directives)."""
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts)


def _code(text: str) -> list[str]:
    """The code in a markdown text: fenced and indented blocks line by line (a trailing backslash
    joins a line to the next), and every inline code span."""
    out, prose, fence, in_indented = [], [], None, False
    for line in text.split("\n"):
        if line.strip().startswith("```"):
            if fence is None:
                fence = []
            else:
                out += "\n".join(fence).replace("\\\n", " ").split("\n")
                fence = None
        elif fence is not None:
            fence.append(line)
        elif line.startswith("    ") and (in_indented or not prose or not prose[-1].strip()):
            out.append(line)  # an indented code block: four spaces after a blank line
            in_indented = True
        else:
            in_indented = in_indented and not line.strip()
            prose.append(line)
    out += re.findall(r"`([^`\n]+)`", "\n".join(prose))
    return [line for line in out if line.strip()]


def _all_code() -> list[tuple[Path, str]]:
    return [(page, code) for page in _pages() for code in _code(page.read_text())]


def test_the_docs_site_builds_strictly_with_no_warning(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:  # a failure, not a skip: `make test` installs both with the dev extra
        pytest.fail(f"{e.name} is not installed: pip install -e '.[dev]' (mkdocs, mkdocstrings[python])")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    problems = [l for l in log.splitlines() if l.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not problems, "mkdocs build --strict failed:\n" + log[-4000:]
    assert (tmp_path / "site" / "organize-a-run" / "index.html").is_file()
    # The API reference has the docstrings in it, not just headings.
    swarm_api = (tmp_path / "site" / "api" / "runspec" / "index.html").read_text()
    assert "matchmaking_time_s" in swarm_api and "Tuning by symptom" in swarm_api


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# `crowdtrain SUB ...` as a command, run directly, from a venv's bin/, or as `python -m crowdtrain.cli`.
COMMAND = re.compile(r"(?:(?<=bin/)|(?<![\w./\-\[]))(?:crowdtrain|python -m crowdtrain\.cli)\s+(?=[a-z])(.*)")


def _commands() -> list[tuple[Path, str, list[str]]]:
    """Each quoted command with its words, up to the end of the command (a comment, `;`, `&&`)."""
    found = []
    for page, code in _all_code():
        for match in COMMAND.finditer(code):
            words = re.split(r"\s*(?:#|;|&&|\s\|\s)", match.group(1))[0].split()
            found.append((page, match.group(0), words))
    return found


def test_the_commands_quoted_in_the_docs_are_real_subcommands_and_flags():
    from crowdtrain.cli import build_parser

    top = build_parser()
    commands = _commands()
    assert len(commands) > 50, "the command finder found too few commands: is the regex still right?"
    wrong = []
    for page, text, words in commands:
        where = f"{page.relative_to(ROOT)}: `{text}`"
        subs = _subparsers(top)
        if words[0] not in subs:
            wrong.append(f"{where}: no subcommand {words[0]!r}")
            continue
        parsers, rest = [top, subs[words[0]]], words[1:]
        nested = _subparsers(parsers[-1])
        if nested and rest and re.fullmatch(r"[a-z][\w\-]*(?:\\?\|[a-z][\w\-]*)*", rest[0]):
            names = re.split(r"\\?\|", rest[0])
            missing = [n for n in names if n not in nested]
            if missing:
                wrong.append(f"{where}: {words[0]} has no subcommand {', '.join(missing)}")
                continue
            # Flags must belong to one of the alternatives (`users add|list|revoke --run-id`).
            parsers.append(nested[names[0]])
            alternatives = [nested[n] for n in names]
        else:
            alternatives = [parsers[-1]]
        for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w\-]*)", " ".join(rest)):
            known = any(flag in p._option_string_actions for p in [top, *alternatives])
            if not known:
                wrong.append(f"{where}: {' '.join(words[:1 + (len(parsers) > 2)])} has no option {flag}")
    assert not wrong, "commands in the docs that the CLI does not have:\n" + "\n".join(wrong)


PATH = re.compile(r"(?<![\w./~\-])((?:crowdtrain|benchmarks|tests|examples|docs)/[\w./*{},\-]*[\w/*}])(::\w+)?")


def _expand(pattern: str) -> list[str]:
    """`a_{x,y}.json` -> a_x.json, a_y.json (the shell's brace expansion, as the docs write it)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _written_by_a_benchmark(path: str) -> bool:
    """A result file that is not checked in but named for the script that writes it when run
    (`benchmarks/results/bench_data.json` from `benchmarks/bench_data.py`)."""
    stem = re.split(r"[.\-]", path.removeprefix("benchmarks/results/"))[0]
    return any((ROOT / "benchmarks" / f"{stem}{ext}").is_file() for ext in (".py", ".sh"))


def test_the_paths_the_docs_name_exist():
    named = 0
    wrong = []
    for page in _pages():
        text = page.read_text()
        for match in PATH.finditer(text):
            path, test_name = match.group(1), match.group(2)
            named += 1
            for one in _expand(path):
                if one.startswith("benchmarks/results/") and _written_by_a_benchmark(one):
                    continue
                if not list(ROOT.glob(one)) and not (ROOT / one).exists():
                    wrong.append(f"{page.relative_to(ROOT)}: {one} does not exist")
                elif test_name and f"def {test_name[2:]}(" not in (ROOT / one).read_text():
                    wrong.append(f"{page.relative_to(ROOT)}: {one} has no {test_name[2:]}")
    assert named > 50, "the path finder found too few paths: is the regex still right?"
    assert not wrong, "paths in the docs that are not in the repository:\n" + "\n".join(wrong)


def _resolves(package, dotted: str) -> bool:
    """Whether ``crowdtrain.a.b`` is defined in the source, read statically. A package that exports
    names lazily (an ``_EXPORTS`` dict of name -> module, read by its ``__getattr__``) defines
    them in the module it names."""
    import griffe

    path = dotted.removeprefix("crowdtrain.")
    try:
        package[path]
        return True
    except (KeyError, griffe.AliasResolutionError):
        pass
    parent, _, name = path.rpartition(".")
    try:
        exports = ast.literal_eval(str(package[parent]["_EXPORTS"].value)) if parent else {}
    except (KeyError, ValueError, SyntaxError):
        return False
    return name in exports and _resolves(package, f"{exports[name]}.{name}")


def test_the_dotted_names_the_docs_quote_resolve_in_the_source():
    import griffe

    package = griffe.load("crowdtrain", search_paths=[str(ROOT)], allow_inspection=False)
    names = {(page, m) for page, code in _all_code()
             for m in re.findall(r"(?<![\w./])crowdtrain(?:\.[A-Za-z_]\w*)+", code)}
    assert len(names) > 10, "the name finder found too few names: is the regex still right?"
    wrong = [f"{page.relative_to(ROOT)}: {name}" for page, name in sorted(names) if not _resolves(package, name)]
    assert not wrong, "names in the docs that the source does not define:\n" + "\n".join(wrong)


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_github_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def test_the_readmes_relative_links_point_at_files_and_headings_that_exist():
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)\s]+)\)", readme.read_text())
    relative = [l for l in links if not re.match(r"[a-z]+://", l)]
    assert len(relative) > 5
    wrong = []
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else readme
        if not target.is_file():
            wrong.append(f"{link}: no file {path}")
        elif anchor and anchor not in _headings(target):
            wrong.append(f"{link}: {path} has no heading #{anchor}")
    assert not wrong, "README links that lead nowhere on GitHub:\n" + "\n".join(wrong)


def test_the_readme_stays_a_landing_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines: move studies and long tables into docs/ (see mkdocs.yml)"


def test_the_organizers_guide_has_only_links_that_work_on_the_coordinators_organize_page():
    """The coordinator renders docs/organize-a-run.md at /organize (crowdtrain.coordinator.pages),
    where a relative link such as `data.md` would lead to a 404 and an anchor to no heading id: the
    guide links only to absolute addresses and to the coordinator's own pages."""
    from crowdtrain.coordinator.pages import GUIDE_PATHS, _guide_html

    assert GUIDE_PATHS[0].resolve() == (DOCS / "organize-a-run.md").resolve(), \
        "crowdtrain/coordinator/docs/organize-a-run.md must stay a link to docs/organize-a-run.md"
    html = _guide_html()
    assert html and "<h1>Organize a run" in html
    hrefs = re.findall(r'href="([^"]*)"', html)
    wrong = [h for h in hrefs if not re.match(r"(https?://|/(?!/))", h)]
    assert not wrong, f"links in organize-a-run.md that are broken at /organize: {wrong}"


def test_every_module_is_in_the_api_reference():
    """A new module gets its docstrings into the site: every module of the package is named by a
    ``::: crowdtrain...`` entry of docs/api/ (command-line modules excepted: `--help` documents
    them)."""
    entries = set(re.findall(r"^::: (crowdtrain[\w.]*)", "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md")),
                             flags=re.M))
    modules = set()
    for path in (ROOT / "crowdtrain").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] in ("cli", "__main__") or (parts[-1] == "__init__" and len(parts) == 2):
            continue
        modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    missing = sorted(modules - entries)
    assert not missing, f"modules missing from the API reference (add a `::: NAME` line to docs/api/): {missing}"
