"""The README stays an entry point and the documentation's links resolve (no ranks, no torch).

- ``README.md`` has at most 200 lines and no dated line (figures with dates live in ``docs/benchmarks.md``
  and ``docs/history.md``);
- every relative link in ``README.md`` and ``docs/**/*.md`` names an existing file or folder, and a
  ``#anchor`` into a Markdown file names one of its headings (GitHub's anchor rules);
- the README names ``./scripts/test`` as the test command and ``.ci/run`` runs exactly it.
"""

from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 200
TEST_COMMAND = "./scripts/test"

MONTHS = ("January February March April May June July August September October November December "
          "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec").split()
DATE = re.compile(r"20\d\d-\d\d-\d\d|\b(?:" + "|".join(MONTHS) + r")\.?(?:\s+\d{1,2}(?:st|nd|rd|th)?,?)?\s+(?:19|20)\d\d\b")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _pages() -> list[pathlib.Path]:
    return [README] + sorted((ROOT / "docs").rglob("*.md"))


def _prose_lines(text: str, *, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked unless ``blank_code`` is false."""
    out, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(1)
            elif fence.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            out.append((number, INLINE_CODE.sub("", line) if blank_code else line))
    return out


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                          # backticks, emphasis, dots, colons, ...
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every anchor of a Markdown file: its headings' (with GitHub's -1, -2 suffixes for repeated headings)
    and those of ``<a id="...">`` / ``<a name="...">`` tags."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        out.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_anchor(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline and reference link outside code; link text may span lines."""
    text = path.read_text(encoding="utf-8")
    kept = dict(_prose_lines(text))
    prose = "\n".join(kept.get(n, "") for n in range(1, text.count("\n") + 2))  # code lines blanked, numbering kept
    out = [(prose.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in INLINE_LINK.finditer(prose)]
    out += [(n, m.group(1)) for n, line in kept.items() if (m := REFERENCE_LINK.match(line))]
    return sorted(out)


def broken_links(path: pathlib.Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if EXTERNAL.match(target) or target.startswith("//"):
            continue
        file_part, _, fragment = target.partition("#")
        file_part = urllib.parse.unquote(file_part.split("?", 1)[0])
        if file_part.startswith("/"):
            resolved = ROOT / file_part.lstrip("/")
        else:
            resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
            continue
        if fragment and resolved.is_file() and resolved.suffix == ".md":
            fragment = urllib.parse.unquote(fragment)
            known = anchors(resolved)
            if fragment not in known and fragment.lower() not in known:
                problems.append(f"{where}: no heading with anchor #{fragment} in {resolved.relative_to(ROOT)}")
    return problems


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move reference material to a page of docs/")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_carries_no_date():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    dated = sorted({text.count("\n", 0, m.start()) for m in DATE.finditer(text)})  # a date may span a line break
    assert not dated, "dated lines belong in docs/benchmarks.md or docs/history.md:\n" + "\n".join(
        f"README.md:{n + 1}: {lines[n].strip()}" for n in dated)


def test_readme_names_the_test_command_and_ci_runs_exactly_it():
    assert TEST_COMMAND in README.read_text(encoding="utf-8"), f"README.md does not name {TEST_COMMAND}"
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.lstrip().startswith("#")
                and not line.startswith(("set ", "cd "))]
    assert commands == [TEST_COMMAND], f".ci/run must run exactly {TEST_COMMAND}; it runs {commands}"


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Error budgets", "error-budgets"),
    ("### `verify`: the main job", "verify-the-main-job"),
    ("How `c` and the floors were chosen", "how-c-and-the-floors-were-chosen"),
    ("Real models: the framework's own CP path against one device", "real-models-the-frameworks-own-cp-path-against-one-device"),
    ("inkling2 ([API page](api/inkling2_context_parallel.md))", "inkling2-api-page"),
    ("D1: transposed gradients through torch.distributed.nn.functional.all_gather on gloo",
     "d1-transposed-gradients-through-torchdistributednnfunctionalall_gather-on-gloo"),
    ("Scale: CP sizes 1 to 64 on this 2-core machine (issue 21)", "scale-cp-sizes-1-to-64-on-this-2-core-machine-issue-21"),
])
def test_github_anchor_rules(heading, anchor):
    assert github_anchor(heading.lstrip("# ")) == anchor
