"""The docs against what they describe, so that they cannot drift silently (issue 35):

- every route the app serves is listed by `tallow serve --help` and in docs/api.md's route
  table, and every route listed there is served;
- every option written after `tallow SUBCOMMAND` in README.md and docs/*.md, and every
  `--option` in docs/cli.md's section of a subcommand, exists in that subcommand's parser, and
  docs/cli.md names every option of every subcommand;
- every relative link in README.md, artifacts/README.md and docs/*.md reaches a file, and every
  `#anchor` a heading of that file (GitHub's slug rules).

The oracles are the code's own: the FastAPI app's route list (built over a stub engine, nothing
served), argparse's parsers, the file system. Fast: no server, no TVM.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tallow.cli.main import build_parser
from tallow.server import paths
from tallow.server.app import create_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "artifacts" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.M | re.S)
ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[^\s`|,]*)")


# -- routes ----------------------------------------------------------------------------------


def app_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD left out (Starlette adds it)."""
    app = create_app(SimpleNamespace(model=None, stats=lambda: None), "m")
    try:
        from fastapi.routing import iter_route_contexts

        routes = [c.original_route for c in iter_route_contexts(app.routes)]
    except ImportError:  # older FastAPI copies included routes into app.routes
        routes = list(app.routes)
    return {(m, r.path) for r in routes for m in (r.methods or ()) if m != "HEAD"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def help_routes(text: str) -> set[tuple[str, str]]:
    listing = text.split("\nroutes:\n", 1)[1]
    return {ROUTE.match(line.strip()).groups() for line in listing.splitlines()}


def section(text: str, heading: str) -> str:
    """The body of `## heading` (up to the next heading of level 2 or above)."""
    start = re.search(rf"^## {re.escape(heading)}[ \t]*$", text, re.M)
    assert start is not None, f"no '## {heading}'"
    end = re.search(r"^#{1,2} ", text[start.end() :], re.M)
    return text[start.end() : start.end() + end.start() if end else len(text)]


def api_md_routes(text: str) -> set[tuple[str, str]]:
    rows = [line for line in section(text, "Routes").splitlines() if line.startswith("| `")]
    return {m for row in rows for m in ROUTE.findall(row.split("|")[1])}


def test_every_route_is_in_the_help_and_in_api_md_and_nothing_else():
    served = app_routes()
    assets = {("GET", p) for p in paths.UI_ASSETS}
    assert assets <= served and all(p.startswith("/ui/") for _, p in assets)
    table = {(r.method, r.path) for r in paths.ROUTES}
    assert served - assets == table
    assert help_routes(subcommands()["serve"].format_help()) == table
    assert api_md_routes((ROOT / "docs" / "api.md").read_text()) == table


# -- options ---------------------------------------------------------------------------------


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Its options, --help included."""
    return {s for a in parser._actions for s in a.option_strings}


COMMAND = re.compile(r"(?<![\w/-])(?:\.venv/bin/)?tallow((?: -v)?) ([a-z]+(?:-[a-z]+)*)\b")
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][a-zA-Z0-9-]*)")


def commands(text: str) -> list[tuple[str, str]]:
    """(subcommand, its text) for every `tallow SUB ...` in code: fenced lines (with their
    continuation lines: a trailing backslash, or indented under the command) and inline code
    spans (which may wrap across lines), from the subcommand to the end of the command."""
    found: list[tuple[str, str]] = []
    for block in FENCE.findall(text):
        lines = block.splitlines()[1:-1]
        for i, line in enumerate(lines):
            if COMMAND.search(line) is None:
                continue
            body, indent = [line], len(line) - len(line.lstrip())
            for nxt in lines[i + 1 :]:
                deeper = len(nxt) - len(nxt.lstrip()) > indent
                if not nxt.strip() or not (body[-1].rstrip().endswith("\\") or deeper):
                    break
                body.append(nxt)
            found.append(" ".join(body))
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", text)):
        found.append(span)
    out = []
    for piece in found:
        for match in COMMAND.finditer(piece):
            rest = piece[match.end() :]
            nxt = COMMAND.search(rest)
            out.append((match.group(2), rest[: nxt.start()] if nxt else rest))
    return out


def written_options(text: str) -> list[tuple[str, str]]:
    """(subcommand, option) for every option written after `tallow SUBCOMMAND`."""
    return [(sub, opt) for sub, body in commands(text) for opt in OPTION.findall(body)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_option_written_after_a_subcommand_exists(doc):
    parsers = subcommands()
    for sub, opt in written_options(doc.read_text()):
        assert sub in parsers, f"{doc.name}: `tallow {sub}` is no subcommand"
        assert opt in options(parsers[sub]), f"{doc.name}: `tallow {sub} {opt}` does not exist"


def test_cli_md_names_every_option_in_its_subcommands_section():
    text = (ROOT / "docs" / "cli.md").read_text()
    named: dict[str, set[str]] = {}
    for sub, opt in written_options(text):  # the synopsis and the examples
        named.setdefault(sub, set()).add(opt)
    for sub, parser in subcommands().items():
        spans = re.findall(r"`([^`]+)`", FENCE.sub("", section(text, sub)))
        in_section = {OPTION.match(s).group(1) for s in spans if s.startswith("--")}
        assert in_section <= options(parser), f"cli.md '## {sub}': {in_section - options(parser)}"
        missing = options(parser) - {"-h", "--help"} - named.get(sub, set()) - in_section
        assert not missing, f"docs/cli.md does not name `tallow {sub}` {sorted(missing)}"


# -- links -----------------------------------------------------------------------------------


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slugs(text: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation but `-` and `_`
    dropped, spaces to `-`; a repeated slug gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in slugs(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    assert broken_links(doc) == []


def test_slugs_follow_githubs_rules():
    # Examples of github.com's own anchors for these headings.
    text = "# Prompt scoring: `echo` and `logprobs`\n## Real shapes in Q4_K_M\n## A\n## A\n"
    assert slugs(text) == {"prompt-scoring-echo-and-logprobs", "real-shapes-in-q4_k_m", "a", "a-1"}
