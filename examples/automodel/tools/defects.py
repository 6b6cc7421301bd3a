"""The documented framework defects (``known_defects.json``): loading and checking the file, and the signatures a
failing row must show to count as a documented defect rather than a new finding.

A defect is ``{"id", "title", "classification", "doc", "repro", "backends", "signature", "rows": [...]}``; each row
``{"adapter" | "spec", "row", "why", "case"}`` names the subject (an adapter of ``examples.automodel`` or a model spec
of ``examples.automodel.models``), the verify row label, why the defect reaches that row, and a case of the row that
fails while the defect is there (replayed by ``scripts/real_clients``); an optional ``"when"`` (``{"batch.kind":
"packed"}``: dotted case keys and the values they must hold) restricts the entry to the failing cases it describes,
so that a defect of one batch kind never covers another kind's failure. A signature is one of:

- ``{"kind": "gradients"}``: the forward is right, every failing tensor is a gradient, no problem (no rank raised);
- ``{"kind": "tensors", "names": [...]}``: every failing tensor's name starts with one of ``names``, no problem;
- ``{"kind": "problem", "contains": [...]}``: a problem whose text contains one of these (whatever the tensors).

An entry is an expectation, not a waiver: nothing is skipped and the row stays FAILED in every report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KNOWN = HERE.parent / "known_defects.json"

DEFECT_FIELDS = ("id", "title", "classification", "doc", "repro", "backends", "signature", "rows")
ROW_FIELDS = ("row", "why", "case")
SUBJECTS = ("adapter", "spec", "training")


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failing row or case as data: its failing tensors (``name``, ``gradient``) and its problems' texts."""

    tensors: tuple[dict, ...]
    problems: tuple[str, ...]

    @classmethod
    def of_row(cls, row: dict) -> Failure:
        """From a verify JSON row (``failing_tensors``, ``problems``)."""
        return cls(
            tuple(row["failing_tensors"]), tuple(f"{p['message']}\n{p.get('detail', '')}" for p in row["problems"])
        )

    @classmethod
    def of_report(cls, report) -> Failure:
        """From a ``CaseReport``."""
        return cls(
            tuple(c.as_dict() for c in report.failures()), tuple(f"{p.message}\n{p.detail}" for p in report.problems)
        )


class Signature:
    """How a documented defect fails; ``matches(failure)``; ``text`` says it in words."""

    @property
    def text(self) -> str:
        raise NotImplementedError

    def matches(self, failure: Failure) -> bool:
        raise NotImplementedError


class GradientsWrong(Signature):
    @property
    def text(self) -> str:
        return "forward right, gradients wrong: every failing tensor is a gradient, no rank raised"

    def matches(self, failure: Failure) -> bool:
        return bool(failure.tensors) and not failure.problems and all(t["gradient"] for t in failure.tensors)


@dataclasses.dataclass(frozen=True)
class TensorsWrong(Signature):
    names: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"only these tensors wrong, no problem: {', '.join(self.names)}"

    def matches(self, failure: Failure) -> bool:
        return (
            bool(failure.tensors)
            and not failure.problems
            and all(t["name"].startswith(self.names) for t in failure.tensors)
        )


@dataclasses.dataclass(frozen=True)
class ProblemSaid(Signature):
    contains: tuple[str, ...]

    @property
    def text(self) -> str:
        return "a problem saying " + " or ".join(repr(c) for c in self.contains)

    def matches(self, failure: Failure) -> bool:
        return any(c in problem for problem in failure.problems for c in self.contains)


def signature_of(data: Any, where: str) -> Signature:
    """The ``Signature`` a defect's ``signature`` field describes (``ValueError`` naming ``where``)."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "gradients":
        return GradientsWrong()
    if kind == "tensors" and data.get("names"):
        return TensorsWrong(tuple(data["names"]))
    if kind == "problem" and data.get("contains"):
        return ProblemSaid(tuple(data["contains"]))
    raise ValueError(
        f"{where}: signature {data!r}; give {{'kind': 'gradients'}}, {{'kind': 'tensors', 'names': "
        f"[...]}} or {{'kind': 'problem', 'contains': [...]}}"
    )


def holds(when: dict | None, case: dict | None) -> bool:
    """Whether ``case`` has every dotted key of ``when`` with its value (no ``when``: any case)."""
    if not when:
        return True
    if case is None:
        return False
    for dotted, want in when.items():
        value: Any = case
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value != want:
            return False
    return True


def subject_of(row: dict) -> str:
    """``"adapter:<name>"``, ``"spec:<name>"`` or ``"training:<spec>"``: what a documented row is about."""
    return next(f"{key}:{row[key]}" for key in SUBJECTS if key in row)


def load_defects(path: Path = KNOWN) -> list[dict]:
    """The documented defects of ``path``, checked: every field present, a known signature, every reached row
    named once. ``ValueError`` names the entry and the field."""
    defects = json.loads(Path(path).read_text())["defects"]
    seen: dict[tuple, str] = {}
    for i, defect in enumerate(defects):
        missing = [f for f in DEFECT_FIELDS if f not in defect]
        if missing:
            raise ValueError(f"{path}: defect #{i} ({defect.get('id', '?')}) has no {', '.join(missing)}")
        signature_of(defect["signature"], f"{path}: defect {defect['id']}")
        if not defect["rows"]:
            raise ValueError(f"{path}: defect {defect['id']} lists no row it reaches (rows: [] )")
        for j, row in enumerate(defect["rows"]):
            missing = [f for f in ROW_FIELDS if f not in row] + (
                [] if any(k in row for k in SUBJECTS) else ["adapter (or spec)"]
            )
            if missing:
                raise ValueError(f"{path}: defect {defect['id']} rows[{j}] has no {', '.join(missing)}")
            for backend in defect["backends"]:
                key = (subject_of(row), row["row"], backend, json.dumps(row.get("when"), sort_keys=True))
                if key in seen:
                    raise ValueError(
                        f"{path}: {key[0]} / {row['row']} ({backend}) is listed by both {seen[key]} and "
                        f"{defect['id']}: a row has one documented cause (per 'when')"
                    )
                seen[key] = defect["id"]
    return defects


def load_known(path: Path = KNOWN) -> list[dict]:
    """One entry per documented row: the defect's fields (``id``, ``title``, ``backends``, ``signature`` as a
    ``Signature``, ...), the row's (``row``, ``why``, ``case``), and ``subject`` (``adapter:X`` / ``spec:X``)."""
    out = []
    for defect in load_defects(path):
        signature = signature_of(defect["signature"], defect["id"])
        for row in defect["rows"]:
            out.append(
                {
                    **{k: v for k, v in defect.items() if k != "rows"},
                    **row,
                    "signature": signature,
                    "subject": subject_of(row),
                }
            )
    return out
