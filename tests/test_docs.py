"""The docs stay true: their code runs, their links resolve, the reference is complete."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import torchTensorRef
from torchTensorRef import strategies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: pages whose ```python blocks form one runnable program each
RUNNABLE = ["README.md", "docs/concepts.md", "docs/custom-strategy.md", "docs/trace.md", "docs/api.md",
            "docs/timeline.md", "docs/disk.md"]
PAGES = ["README.md", "docs/concepts.md", "docs/custom-strategy.md", "docs/trace.md", "docs/api.md",
         "docs/runner.md", "docs/timeline.md", "docs/disk.md"]


def _read(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


#: what a page's program prints once its last block has run
END = "<every block ran>"
#: what the C++ runtime prints when a thread is ended under it as the interpreter finalizes
AT_EXIT_ABORT = "terminate called without an active exception"


@pytest.mark.parametrize("page", RUNNABLE)
def test_code_blocks_run(page, tmp_path):
    blocks = _python_blocks(_read(page))
    assert blocks, f"{page} has no python block"
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks) + f"\n\nprint({END!r}, flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTENSORREF_")}
    # the package of this checkout, whichever copy is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    # (the pages' "sim" is its strict form, which a process that sees a GPU cannot register)
    env["CUDA_VISIBLE_DEVICES"] = ""
    for attempt in range(2):
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env=env)
        # (a run whose every block ran and that aborted as the interpreter finalized, under
        # autograd's thread for "sim": Note [Autograd's device thread at exit] in
        # integrations/backward.py, is run again, once; an abort before its end is not)
        at_exit = done.returncode == -6 and done.stdout.endswith(END + "\n") and AT_EXIT_ABORT in done.stderr
        if done.returncode == 0 or attempt or not at_exit:
            break
    assert done.returncode == 0, f"{page}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("page", PAGES)
def test_local_links_resolve(page):
    folder = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _read(page)):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(folder, target)), f"{page} links to missing {target}"


#: the README's test command: the linter, the type checker, then the suite
TEST_COMMAND = ('pip install -e ".[test]" && python -m ruff check torchTensorRef tests benchmarks && python -m mypy'
                ' && python -m pytest -n 2 -q')


def test_readme_keeps_the_two_set_up_commands():
    readme = _read("README.md")
    assert "    pip install \".[demo]\" && python -m torchTensorRef demo\n" in readme
    assert f"    {TEST_COMMAND}\n" in readme
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        # (CI runs the README's command, pip quietly)
        assert TEST_COMMAND.replace("pip install -e", "pip install -q -e") in f.read()


def test_api_reference_names_every_public_name():
    api = _read("docs/api.md")
    for name in torchTensorRef.__all__:
        assert f"`{name}" in api or f"{name}`" in api, name


def test_runner_page_names_every_strategy():
    runner = _read("docs/runner.md")
    for name in strategies.NAMES:
        assert f"`{name}`" in runner, name
