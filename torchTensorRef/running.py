"""Running a user's script as plain ``python`` would, and the device the commands default to.

Shared by the command line (``cli``), the demo and ``predict``; imports nothing of the package.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import signal
import sys
import types
from typing import List

import torch


def default_device() -> str:
    """``TORCHTENSORREF_DEVICE`` if set, else ``"cuda"`` where there is a GPU, else ``"sim"``."""
    env = os.environ.get("TORCHTENSORREF_DEVICE")
    if env:
        return env
    return "cuda" if torch.cuda.is_available() else "sim"


def _strip_runner_frames(tb, filename: str):
    """``tb`` from the script's first frame on, or ``None`` if the script never ran."""
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return tb


def run_script(path: str, argv: List[str]) -> int:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *argv]``; return its exit code.

    As under plain ``python``: ``__file__`` is the absolute path, ``sys.path[0]`` the
    script's folder and the script's module stays ``sys.modules["__main__"]``.
    ``SystemExit`` from the script propagates (Python turns it into the exit code); other
    exceptions are reported through ``sys.excepthook`` with the script's traceback and
    give exit code 1.
    """
    filename = os.path.abspath(path)
    sys.argv[:] = [path, *argv]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=filename, __builtins__=builtins, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", filename))
    sys.modules["__main__"] = main
    try:
        with io.open_code(filename) as f:
            code = compile(f.read(), filename, "exec")
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # shown as plain python shows it, without the runner's frames
        tb = _strip_runner_frames(e.__traceback__, filename)
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # Python prints the exception's own
        if isinstance(e, KeyboardInterrupt):
            return -signal.SIGINT
        return 1
    return 0
