"""A tool's command line run in this process: `main(argv)` with stdout and stderr captured and its
exit status as `python tools/X.py ...` would give it (SystemExit included: argparse's errors).
Seconds cheaper than a fresh interpreter per call, which re-imports torch; the tools' own tests of
`python tools/X.py` as a process stay where the process is the point (exit codes through a shell,
signals, files left behind)."""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import types

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def run_tool(name: str, *args: str, cwd: str | None = None) -> types.SimpleNamespace:
    """(returncode, stdout, stderr) of tools/<name>.py's main(list(args))."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    tool = importlib.import_module(name)
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = tool.main([str(a) for a in args])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(old)
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())
