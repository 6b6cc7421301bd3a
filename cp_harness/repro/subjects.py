"""The code under test of a script, and how the script reaches it.

* An **implementation** (``cp_impl``, a broken fixture, your package): the script imports the module by name
  (the default of its ``--impl``) and calls its documented function. ``pythonpath``: the folders the module
  needs (written into the script's run line).
* An **adapter** (``examples/automodel/<adapter>.py``: a framework function serving a documented one): the
  script calls the framework function directly, translating as the adapter does. The adapter's translation is
  copied into the script (``inline``): the served function and every definition of the adapter or of its
  ``_compose`` helpers it uses, the framework imports it needs; a translation that reaches into ``cp_impl``
  cannot be inlined (``NotExportable``). ``--impl MODULE`` calls a module's own function instead (``cp_impl``:
  the bundled one), ``--fixed`` the proposed fix where there is one (``fixes``).

What a script says about its subject (its title, how to run it, its options) is written here, once.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import textwrap

from cp_harness.repro import fixes
from cp_harness.repro.script import SCRIPT, NotExportable

_COMPOSE = "examples.automodel.adapters._compose"


@dataclasses.dataclass
class Subject:
    """``module``: the implementation module, or the adapter whose framework function is inlined (``inlined``:
    then ``translation`` holds the copied source, ``framework_imports`` its import lines, ``serves`` the
    framework callable); ``pythonpath``: folders the script needs on ``PYTHONPATH`` (relative to the
    repository root when under it); ``fix``: the source of the proposed fix (``--fixed``), if any."""

    module: str
    pythonpath: tuple[str, ...] = ()
    inlined: bool = False
    serves: str = ""
    translation: list[str] = dataclasses.field(default_factory=list)
    framework_imports: list[str] = dataclasses.field(default_factory=list)
    fix: list[str] = dataclasses.field(default_factory=list)

    def title(self, function: str) -> str:
        if self.inlined:
            return f"nemo-automodel's {self.serves}, serving {function} as {self.module} translates it"
        return f"{function} of the implementation {self.module}"

    def run_paragraphs(self) -> list[str]:
        """How to run the script: as it is, on the bundled implementation, with the fix."""
        path = "PYTHONPATH=" + ":".join(self.pythonpath or (".",)) + " "
        runs = [("", "exit 1 while the defect is there, 0 once fixed"),
                (" --impl cp_impl", "the bundled implementation: exit 0")]
        if self.fix:
            runs.append((" --fixed", "the fix proposed upstream: exit 0"))
        width = max(len(flag) for flag, _ in runs)
        how = [f"    {path}python {SCRIPT}{flag:<{width}}  # {why}" for flag, why in runs]
        code = (f"The code under test is the framework function, called as {self.module} translates the documented "
                "call (that translation is copied below)." if self.inlined else
                f"The code under test is the module {self.module}, imported by name.")
        return [code + " Run from the repository root (--backend nccl: on GPUs):", "\n".join(how)]

    def imports(self) -> list[str]:
        return list(self.framework_imports)

    def options_source(self) -> str:
        if self.inlined:
            lines = ['    parser.add_argument("--impl", metavar="MODULE",\n'
                     '                        help="the function of MODULE (e.g. cp_impl) instead of the framework\'s")']
            if self.fix:
                lines.append('    parser.add_argument("--fixed", action="store_true",\n'
                             '                        help="the fix proposed upstream instead of the framework\'s")')
        else:
            lines = [f'    parser.add_argument("--impl", default={self.module!r}, metavar="MODULE",\n'
                     '                        help="the implementation module under test (default: the one that failed)")']
        return "def options(parser):\n" + "\n".join(lines) + "\n"

    def code_under_test_source(self, function: str) -> str:
        part, name = function.split(".")
        head = (f"def code_under_test(args):\n    \"\"\"{function} of the module ``args.impl``"
                + (f"; without it, the framework's,\n    as {self.module} translates it (copied below)."
                   if self.inlined else ".") + '"""\n')
        choose = (f"    module = importlib.import_module(args.impl)\n"
                  f"    part = getattr(module, {part!r}, None) or importlib.import_module(args.impl + {'.' + part!r})\n"
                  f"    return part.{name}\n")
        if not self.inlined:
            return head + choose
        fixed = f"    if args.fixed:\n        return {fixes.FIXED[function].__name__}\n" if self.fix else ""
        return head + f"    if not args.impl:\n{textwrap.indent(fixed, '    ')}        return {name}\n" + choose

    def sources(self) -> list[str]:
        return [*self.translation, *self.fix]


def _pythonpath(module) -> tuple[str, ...]:
    """The folder a module is imported from, relative to the working directory when under it."""
    top = importlib.import_module(module.__name__.split(".")[0])
    assert top.__file__ is not None, f"{top.__name__} is a namespace package: no folder to put on the path"
    where = os.path.dirname(os.path.abspath(top.__file__))
    folder = os.path.dirname(where) if os.path.basename(top.__file__) == "__init__.py" else where
    relative = os.path.relpath(folder)
    if relative.startswith(".."):
        return (folder,)
    return tuple(dict.fromkeys((relative, ".")))


def module_subject(name: str) -> Subject:
    """A module under test imported by name (an implementation, a model spec)."""
    return Subject(name, _pythonpath(importlib.import_module(name)))


def subject_of(module_name: str, function: str, translate: bool = True) -> Subject:
    """The subject of a script calling ``function`` (``part.name``) of the implementation ``module_name``: the
    framework function inlined when the module is an adapter serving ``function`` (``translate=False``: the
    family copies what it needs itself, e.g. the sharder a hook returns), else the module itself."""
    module = importlib.import_module(module_name)
    serves = getattr(module, "SERVES", {})
    if function not in serves:
        return Subject(module_name, _pythonpath(module))
    if not translate:
        return Subject(module_name, _pythonpath(module), inlined=True, serves=serves[function])
    part, name = function.split(".")
    served = getattr(getattr(module, part), name)
    imports, blocks = inline(module_name, [served.__name__])
    fix = [_source_of(f) for f in fixes.needed(function)]
    return Subject(module_name, _pythonpath(module), inlined=True, serves=serves[function], translation=blocks,
                   framework_imports=imports, fix=fix)


def _source_of(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


# ------------------------------------------------------------------------------ copying an adapter's translation
def _definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node
    return out


def _imports(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute or None) of every top-level import."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _names(node: ast.AST) -> list[str]:
    return list(dict.fromkeys(n.id for n in ast.walk(node) if isinstance(n, ast.Name)))


def _first_docstring_line(text: str, node: ast.stmt) -> str:
    """``text`` (the source of ``node``) with its docstring cut to the first line: the translation, not its essay."""
    body = getattr(node, "body", None)
    doc = body[0] if body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)) \
            or doc.lineno == doc.end_lineno:
        return text
    assert doc.end_lineno is not None  # ast.parse sets it
    lines = text.splitlines()
    first, last = doc.lineno - node.lineno, doc.end_lineno - node.lineno
    indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
    summary = doc.value.value.strip().splitlines()[0].strip()
    return "\n".join(lines[:first] + [f'{indent}"""{summary}"""'] + lines[last + 1:])


def inline(module_name: str, names: list[str]) -> tuple[list[str], list[str]]:
    """``(framework import lines, source blocks)``: the definitions ``names`` of ``module_name`` and everything of
    that module (or of ``examples.automodel.adapters._compose``) they use, dependencies first. The standard library,
    torch and the framework are imported, never copied."""
    imports: dict[str, str] = {}
    blocks: dict[tuple[str, str], str] = {}

    def visit(module: str, name: str, seen: tuple = ()) -> None:
        if (module, name) in blocks or (module, name) in seen:
            return
        source = inspect.getsource(importlib.import_module(module))
        tree = ast.parse(source)
        node, imported, local = _definitions(tree).get(name), _imports(tree), _definitions(tree)
        if node is None and name in imported and imported[name][0].split(".")[0] == "nemo_automodel":
            origin, attribute = imported[name]
            imports[name] = f"from {origin} import {attribute}" + (f" as {name}" if name != attribute else "")
            return
        if node is None:
            raise NotExportable(f"{module} defines no {name}")
        for used in _names(node):
            if used == name:
                continue
            if used in local:
                visit(module, used, seen + ((module, name),))
            elif used in imported:
                origin, attribute = imported[used]
                if origin == _COMPOSE:
                    visit(_COMPOSE, attribute or used, seen + ((module, name),))
                elif origin.split(".")[0] == "nemo_automodel":
                    imports[used] = (f"from {origin} import {attribute}" + (f" as {used}" if used != attribute else "")
                                     if attribute else f"import {origin} as {used}")
                elif origin.split(".")[0] in ("cp_impl", "cp_harness", "oracle", "examples"):
                    raise NotExportable(f"{module}.{name} uses {origin} ({used}): the translation cannot be copied "
                                        "without the code it reaches")
                elif origin not in ("torch", "numpy"):  # the standard library: imported as the module does
                    imports[used] = (f"from {origin} import {attribute}" + (f" as {used}" if used != attribute else "")
                                     if attribute else f"import {origin}" + (f" as {used}" if used != origin else ""))
        blocks[(module, name)] = _first_docstring_line(ast.get_source_segment(source, node) or "", node)

    for name in names:
        visit(module_name, name)
    return sorted(imports.values()), list(blocks.values())
