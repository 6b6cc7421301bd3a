"""The GitHub workflows stay hardened the way zizmor checks them (no ranks, no torch).

- every ``uses:`` names an action by a full 40-hex commit SHA (a tag or branch can be moved under us), with the
  version it stands for in a comment on the same line (``uses: actions/checkout@<sha> # v4.4.0``), and one SHA
  carries the same version comment everywhere;
- every ``actions/checkout`` step sets ``persist-credentials: false`` (otherwise the token is written into
  ``.git/config``, and a job that uploads its workspace uploads the token with it).

Local actions (``uses: ./path``) need no pin. The workflows are read with PyYAML (the ``models`` extra installs it);
without it the test skips. Comments are invisible to a YAML parser, so the version comment is read from the text
line of each ``uses:``, and the number of such lines must match what the parser found.
"""

from __future__ import annotations

import pathlib
import re

import pytest

yaml = pytest.importorskip(
    "yaml", reason="PyYAML reads the workflows: install the models extra (scripts/bootstrap.sh does)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"

PINNED = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")
USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<q>[\"']?)(?P<ref>[^\s\"'#]+)(?P=q)\s*(?:#\s*(?P<comment>.*?))?\s*$")
VERSION_COMMENT = re.compile(r"^v\d+(?:\.\d+)*$")


def _uses_in(workflow: dict) -> list[tuple[str, dict]]:
    """(the ``uses`` value, the step or job that holds it) for every step and reusable-workflow job."""
    found = []
    for job in (workflow.get("jobs") or {}).values():
        if "uses" in job:
            found.append((job["uses"], job))
        for step in job.get("steps") or ():
            if "uses" in step:
                found.append((step["uses"], step))
    return found


def workflow_problems(text: str, name: str) -> list[str]:
    """What keeps one workflow from being hardened, one line per problem (empty when it is)."""
    problems = []
    uses = _uses_in(yaml.safe_load(text) or {})
    remote = [(ref, holder) for ref, holder in uses if not ref.startswith("./")]
    for ref, holder in remote:
        if not PINNED.match(ref):
            problems.append(f"{name}: `uses: {ref}` is not pinned to a full 40-hex commit SHA "
                            "(write `owner/repo@<sha> # vX.Y.Z`)")
        if ref.startswith("actions/checkout@"):
            persist = (holder.get("with") or {}).get("persist-credentials")
            if persist is not False and str(persist).lower() != "false":
                problems.append(f"{name}: `uses: {ref}` lacks `with: persist-credentials: false`")
    lines = [(number, match) for number, line in enumerate(text.splitlines(), 1)
             if (match := USES_LINE.match(line))]
    if len(lines) != len(uses):
        problems.append(f"{name}: the parser found {len(uses)} `uses:` but {len(lines)} lines read `uses: REF`; "
                        "write each `uses:` on a line of its own (block style) so its version comment can be read")
    for number, match in lines:
        ref, comment = match.group("ref"), match.group("comment")
        if not ref.startswith("./") and not (comment and VERSION_COMMENT.match(comment)):
            problems.append(f"{name}:{number}: `uses: {ref}` has no version comment (`# vX.Y.Z`) on its line")
    return problems


def version_comments(text: str) -> dict[str, set[str]]:
    """The version comments each pinned ``owner/repo@sha`` carries in one workflow."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = USES_LINE.match(line)
        if match and PINNED.match(match.group("ref")) and match.group("comment"):
            out.setdefault(match.group("ref"), set()).add(match.group("comment"))
    return out


def _workflow_files() -> list[pathlib.Path]:
    files = sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])
    assert files, f"no workflow found in {WORKFLOWS}"
    return files


@pytest.mark.parametrize("path", _workflow_files(), ids=lambda p: p.name)
def test_every_action_is_pinned_with_its_version_and_no_checkout_keeps_the_token(path):
    text = path.read_text(encoding="utf-8")
    assert _uses_in(yaml.safe_load(text) or {}), f"{path.name} uses no action: was it parsed as intended?"
    assert workflow_problems(text, path.name) == []


def test_one_sha_carries_one_version_comment_across_workflows():
    seen: dict[str, set[str]] = {}
    for path in _workflow_files():
        for ref, comments in version_comments(path.read_text(encoding="utf-8")).items():
            seen.setdefault(ref, set()).update(comments)
    assert seen, "no pinned action found in the workflows"
    assert {ref: sorted(c) for ref, c in seen.items() if len(c) > 1} == {}


BAD = """\
on: push
jobs:
  a:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@a26af69be951a213d495a4c3e4e4022e16d87065
      - uses: actions/checkout@11d5960a326750d5838078e36cf38b85af677262 # v4.4.0
        with:
          persist-credentials: true
      - uses: ./local-action
  b:
    uses: org/repo/.github/workflows/w.yml@main
"""


def test_the_check_names_each_kind_of_unhardened_use():
    assert workflow_problems(BAD, "bad.yml") == [
        "bad.yml: `uses: actions/checkout@v4` is not pinned to a full 40-hex commit SHA "
        "(write `owner/repo@<sha> # vX.Y.Z`)",
        "bad.yml: `uses: actions/checkout@v4` lacks `with: persist-credentials: false`",
        "bad.yml: `uses: actions/checkout@11d5960a326750d5838078e36cf38b85af677262` lacks "
        "`with: persist-credentials: false`",
        "bad.yml: `uses: org/repo/.github/workflows/w.yml@main` is not pinned to a full 40-hex commit SHA "
        "(write `owner/repo@<sha> # vX.Y.Z`)",
        "bad.yml:6: `uses: actions/checkout@v4` has no version comment (`# vX.Y.Z`) on its line",
        "bad.yml:7: `uses: actions/setup-python@a26af69be951a213d495a4c3e4e4022e16d87065` has no version comment "
        "(`# vX.Y.Z`) on its line",
        "bad.yml:13: `uses: org/repo/.github/workflows/w.yml@main` has no version comment (`# vX.Y.Z`) on its line",
    ]


def test_a_uses_the_line_scan_cannot_read_is_reported():
    flow = ("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
            "    steps: [{uses: \"actions/cache@" + "0" * 40 + "\"}]\n")
    assert workflow_problems(flow, "flow.yml") == [
        "flow.yml: the parser found 1 `uses:` but 0 lines read `uses: REF`; "
        "write each `uses:` on a line of its own (block style) so its version comment can be read"]


def test_a_sha_with_two_version_comments_is_seen():
    sha = "actions/cache@" + "1" * 40
    text = f"      - uses: {sha} # v4.2.0\n      - uses: {sha} # v4.3.0\n"
    assert version_comments(text) == {sha: {"v4.2.0", "v4.3.0"}}
