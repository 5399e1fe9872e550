"""The documentation against the code: the options reference is the parser's, every flag a page shows after a
``memfit <command>`` exists for that command, every relative link lands on a page and a heading, and the
MkDocs site builds with ``--strict``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from memfit.cli import build_parser
from memfit.docs_reference import COMMAND, OUTPUT, commands, documented_flags, reference

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
REGENERATE = f"regenerate it with: {COMMAND} (from the repository root)"
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
SHELL_SEPARATOR = re.compile(r"&&|\|\||[|;]")
COMMENT = re.compile(r"(^|\s)#(\s.*)?$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """README.md and every docs page."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def label(page: Path) -> str:
    return str(page.relative_to(ROOT))


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def without_blocks(text: str) -> str:
    """The page with its fenced blocks blanked out, line numbers kept."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)


def code_pieces(text: str) -> Iterator[tuple[int, str]]:
    """(line, code) for each logical line of a fenced block (continuations joined, comments cut) and each inline
    code span outside the blocks."""
    for block in FENCE.finditer(text):
        first_line = line_of(text, block.start())
        logical, start = "", 0
        for number, physical in enumerate(block.group(0).splitlines()[1:-1], start=first_line + 1):
            start = start or number
            if physical.endswith("\\"):
                logical += physical[:-1] + " "
                continue
            yield start, COMMENT.sub("", logical + physical)
            logical, start = "", 0
    prose = without_blocks(text)
    for paragraph in re.finditer(r"(?:[^\n]+\n?)+", prose):
        for span in INLINE_CODE.finditer(paragraph.group(0)):
            yield line_of(prose, paragraph.start() + span.start()), span.group(2).replace("\n", " ")


def mentioned_flags(text: str, names: set[str]) -> Iterator[tuple[int, str, str]]:
    """(line, command, flag) for every ``--flag`` that follows ``memfit <command>`` in the code of a page."""
    invocation = re.compile(r"\bmemfit\s+(" + "|".join(map(re.escape, sorted(names))) + r")(?=\s|$)")
    for line, code in code_pieces(text):
        for piece in SHELL_SEPARATOR.split(code):
            starts = list(invocation.finditer(piece))
            for index, start in enumerate(starts):
                end = starts[index + 1].start() if index + 1 < len(starts) else len(piece)
                for flag in FLAG.findall(piece[start.end():end]):
                    yield line, start.group(1), flag


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(match.group(1)) for match in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


def options_sections() -> dict[str, str]:
    """The committed reference's text per command."""
    text = (ROOT / OUTPUT).read_text(encoding="utf-8")
    parts = re.split(r"^## memfit (\S+)\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_options_reference_is_generated_from_the_parser() -> None:
    committed = (ROOT / OUTPUT).read_text(encoding="utf-8") if (ROOT / OUTPUT).exists() else ""
    generated = reference()
    if committed == generated:
        return
    stale = [f"`memfit {name} {flag}`" for name, flags in documented_flags().items() for flag in sorted(flags)
             if not re.search(rf"`{re.escape(flag)}`", options_sections().get(name, ""))]
    first = next(index for index, (old, new) in enumerate(zip([*committed.splitlines(), ""],
                                                              generated.splitlines(), strict=False))
                 if old != new)
    why = (f"{', '.join(stale)} missing from it" if stale else
           f"line {first + 1} differs from the parser's: {generated.splitlines()[first]!r}")
    pytest.fail(f"{OUTPUT} is out of date ({why}); {REGENERATE}")


def test_every_flag_of_the_parser_is_in_the_options_reference() -> None:
    sections = options_sections()
    missing = [f"`memfit {name} {flag}` is not documented in {OUTPUT}" for name, flags in documented_flags().items()
               for flag in sorted(flags) if not re.search(rf"`{re.escape(flag)}`", sections.get(name, ""))]
    assert not missing, "; ".join(missing) + f"; {REGENERATE}"


def test_every_flag_the_pages_show_exists_for_its_command() -> None:
    flags = documented_flags(with_help=True)
    unknown = [f"{label(page)} line {line}: `memfit {name}` has no {flag} (see {OUTPUT})" for page in pages()
               for line, name, flag in mentioned_flags(page.read_text(encoding="utf-8"), set(flags))
               if flag not in flags[name]]
    assert not unknown, "; ".join(unknown)


def test_the_flag_check_sees_code_blocks_inline_code_and_continuations() -> None:
    text = ("Run `memfit plan --budget 3GiB` or\n\n```\nmemfit train --lr 1 \\\n    --bogus 2  # not --comment\n"
            "memfit estimate: not a command --nope\n```\n\nand `memfit plan ... --save p.json && memfit train\n"
            "--plan p.json`.\n")
    found = list(mentioned_flags(text, {"plan", "train", "estimate"}))
    assert found == [(4, "train", "--lr"), (4, "train", "--bogus"), (1, "plan", "--budget"), (9, "plan", "--save"),
                     (9, "train", "--plan")]


def test_every_relative_link_lands_on_a_page_and_a_heading() -> None:
    broken = []
    for page in pages():
        text = without_blocks(page.read_text(encoding="utf-8"))
        for match in LINK.finditer(text):
            target, _, anchor = match.group(1).partition("#")
            if re.match(r"[a-z]+:", target):
                continue
            path = (page.parent / target).resolve() if target else page
            where = f"{label(page)} line {line_of(text, match.start())}: {match.group(1)}"
            if not path.is_file():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where}: {path.name} has no heading with that anchor")
    assert not broken, "; ".join(broken)


def test_every_command_has_a_section_in_the_reference() -> None:
    assert list(options_sections()) == list(commands(build_parser()))


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs-material is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                            str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                           capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    assert (tmp_path / "site" / "options" / "index.html").is_file()
