"""The fenced blocks of README.md and docs/, and what the doc tests do with each.

A block's language decides: `sh`, `bash`, `shell` and `console` blocks run in the page's one bash
process, `python` blocks run there too (fed to Python on standard input, so they see what the
shell blocks exported), in the page's order. Every other language is not run (`text` for
output, `json`, `http`, `sql`, `ts`, `yaml`, ...); a fence without a language is an error, so
that nobody leaves a command unrun by forgetting to say what it is.

An HTML comment on the line before a block changes that:

- `<!-- doctest: skip: REASON -->`: not run, and REASON is listed in the test output (for
  commands that serve until stopped, or need a service no stand-in replaces);
- `<!-- doctest: file PATH -->`: not run; its text must be PATH's (a file of the repository,
  which another block runs), so the page cannot drift from the file;
- `<!-- doctest: interrupt after TEXT -->` (Python): run in the background until it prints
  TEXT, then sent SIGINT (Ctrl-C): it must exit 0 with no traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = frozenset({"sh", "bash", "shell", "console"})
PYTHON = frozenset({"python", "py"})
NOT_RUN = frozenset({"text", "json", "http", "sql", "ts", "js", "yaml", "toml", "ini", "diff"})
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<lang>[A-Za-z0-9_+-]*)\s*$")
DIRECTIVE = re.compile(
    r"^\s*<!--\s*doctest:\s*(?P<kind>skip|file|interrupt after)\b:?\s*(?P<arg>.*?)\s*-->\s*$"
)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and its directive (if any)."""

    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directive: str | None = None  # skip, file, interrupt after
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.directive not in {"skip", "file"} and (
            self.lang in SHELL or self.lang in PYTHON
        )


def pages() -> list[Path]:
    """README.md, then docs/ (the generated index.md and reference/ left out), in a fixed order."""
    docs = ROOT / "docs"
    found = [
        path
        for path in sorted(docs.rglob("*.md"))
        if path != docs / "index.md" and "reference" not in path.relative_to(docs).parts
    ]
    return [ROOT / "README.md", *found]


def blocks(path: Path) -> list[Block]:
    """The page's fenced blocks in order; a fence inside a list item may be indented."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(previous)
        found.append(
            Block(
                page=page,
                line=i + 1,
                lang=opening["lang"].lower(),
                text=body,
                directive=directive["kind"] if directive else None,
                argument=directive["arg"] if directive else "",
            )
        )
        i = end + 1
    return found
