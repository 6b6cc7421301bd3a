"""Run exported repro scripts as their users do, without the harness, several in one interpreter.

``python run_scripts.py < runs``: one run a line, ``[script path, [argument, ...]]`` as JSON, each started as soon as
its line arrives (the test writes a script's runs while it exports the next one) until stdin closes. Before anything
else this process makes ``cp_harness``, ``oracle`` and ``hypothesis`` unimportable (a script that reached for
them fails with ``ImportError``), then imports torch once (and what torch imports lazily on a first ``backward(gradient)``); each script is loaded from its file and its
``main(argv + ["--start-method", "fork"])`` runs with this process's and its ranks' output captured (file
descriptors 1 and 2), so the ranks are forked from one interpreter instead of each importing torch. One JSON
object per run on stdout: ``{"script", "args", "exit", "output", "seconds"}``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time

BLOCKED = ("cp_harness", "oracle", "hypothesis")


class Blocker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the blocked packages (torch's own probes of what is installed still work) and refuses to load them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not available to a standalone repro")

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} is not available to a standalone repro")


def captured(fn, *args) -> tuple[int, str]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            code = fn(*args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - a script that crashes: its traceback is its output
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return code, out.read().decode(errors="replace")


def main() -> int:
    sys.meta_path.insert(0, Blocker())
    for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
        del sys.modules[name]
    import torch  # noqa: F401 - once, before the ranks are forked
    import torch.fx.experimental.symbolic_shapes  # noqa: F401 - what torch imports on a first backward(gradient): sympy, seconds

    for i, line in enumerate(sys.stdin):
        path, args = json.loads(line)
        started = time.perf_counter()
        spec = importlib.util.spec_from_file_location(f"repro_script_{i}", path)
        module = importlib.util.module_from_spec(spec)
        code, output = captured(lambda: (spec.loader.exec_module(module), module.main([*args, "--start-method", "fork"]))[1])
        print(json.dumps({"script": path, "args": args, "exit": code, "output": output,
                          "seconds": round(time.perf_counter() - started, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
