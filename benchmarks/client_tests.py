"""Run a client library's own test suite with torchTensorRef imported, and compare with plain torch.

Nothing in the library's checkout is edited: its tests run under pytest with
``client_tests_plugin.py`` loaded, once per variant (``plain``: the reference; ``cpu``: the
import alone; ``sim``: paging on "sim" under Flow at a small budget), and ``compare`` lists the
tests that pass in one run and not in another, grouped by their first error line.

peft's LoRA tests, from a checkout of peft's repository, against the installed peft::

    python benchmarks/client_tests.py run plain plain.tsv --tests PEFT/tests/test_custom_models.py \\
        -k "lora and (forward or backward or merge or save or disable or parameters)" -n 2
    python benchmarks/client_tests.py run cpu cpu.tsv --tests ... (the same arguments)
    python benchmarks/client_tests.py compare plain.tsv cpu.tsv

Arguments after the named ones go to pytest. The library's own pytest configuration is
replaced by a minimal one (its ``addopts`` may need plugins that are not installed); its
``conftest.py`` files still load (``--rootdir``, the test file's repository).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

HERE = pathlib.Path(__file__).resolve().parent
VARIANTS = ("plain", "cpu", "sim")
#: the markers peft's tests use, declared so that ``--strict-markers`` configurations pass
INI = """[pytest]
markers =
    single_gpu_tests: tests that run on a single GPU
    multi_gpu_tests: tests that run on multiple GPUs
    regression: the regression suite
    bitsandbytes: bitsandbytes integration tests
"""


def run(variant: str, outcomes: str, tests: str, budget: str, pytest_args: List[str]) -> int:
    """Run ``tests`` under ``variant``; each test's outcome goes to the file ``outcomes``."""
    out = pathlib.Path(outcomes).resolve()
    out.unlink(missing_ok=True)
    root = _repository_root(pathlib.Path(tests).resolve())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (not the caller's pytest's)
    env.update(TORCHTENSORREF_CLIENT_VARIANT=variant, TORCHTENSORREF_CLIENT_OUTCOMES=str(out),
               TORCHTENSORREF_CLIENT_BUDGET=budget)
    if variant == "sim":
        # (the device the Hugging Face libraries' testing utilities pick as they load: a test's
        # default argument ``device=torch_device`` is bound then, before the plugin runs)
        env.update(DIFFUSERS_TEST_DEVICE="sim", TRANSFORMERS_TEST_DEVICE="sim")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as folder:
        ini = pathlib.Path(folder) / "pytest.ini"
        ini.write_text(INI)
        command = [sys.executable, "-m", "pytest", "-p", "client_tests_plugin", tests, "-c", str(ini),
                   "--rootdir", str(root), "-p", "no:cacheprovider", "-q", *pytest_args]
        return subprocess.call(command, env=env, cwd=root)


def _repository_root(path: pathlib.Path) -> pathlib.Path:
    for folder in [path, *path.parents]:
        if (folder / ".git").exists() or (folder / "pyproject.toml").exists() or (folder / "setup.py").exists():
            return folder
    return path.parent


def load(path: str) -> Dict[str, Tuple[str, str]]:
    """node id -> (outcome, first error line), as the plugin wrote them."""
    found = {}
    for line in pathlib.Path(path).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            found[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return found


def regressions(base: Dict[str, Tuple[str, str]], other: Dict[str, Tuple[str, str]]) -> Dict[str, Tuple[str, str]]:
    """The tests that pass in ``base`` and not in ``other`` (``missing``: not run there)."""
    return {k: other.get(k, ("missing", "")) for k, (outcome, _m) in base.items()
            if outcome == "passed" and other.get(k, ("missing", ""))[0] != "passed"}


def report(base_path: str, other_path: str, shown: int = 3) -> str:
    base, other = load(base_path), load(other_path)
    lost = regressions(base, other)
    refused = sum("OutOfBudgetError" in m for _o, m in lost.values())
    lines = [f"{base_path}: {dict(collections.Counter(o for o, _m in base.values()))}",
             f"{other_path}: {dict(collections.Counter(o for o, _m in other.values()))}",
             f"regressions: {len(lost)}, of which OutOfBudgetError: {refused}"]
    groups = collections.defaultdict(list)
    for node, (outcome, message) in lost.items():
        groups[(outcome, re.sub(r"0x[0-9a-f]+|\d+", "N", message)[:160])].append(node)
    for (outcome, message), nodes in sorted(groups.items(), key=lambda g: -len(g[1])):
        lines.append(f"[{len(nodes)}] {outcome}: {message}")
        lines += [f"    {n}" for n in nodes[:shown]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ran = sub.add_parser("run", help="run the tests under a variant")
    ran.add_argument("variant", choices=VARIANTS)
    ran.add_argument("outcomes", help="the file each test's outcome is written to")
    ran.add_argument("--tests", required=True, help="the test file or folder, in the library's checkout")
    ran.add_argument("--budget", default="256KiB",
                     help="the sim variant's budget, on top of what the device holds outside the manager "
                          "(default 256KiB)")
    compared = sub.add_parser("compare", help="the tests that pass in BASE and not in OTHER")
    compared.add_argument("base")
    compared.add_argument("other")
    compared.add_argument("--shown", type=int, default=3, help="tests named per group")
    args, rest = parser.parse_known_args(argv)
    if args.command == "compare":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        print(report(args.base, args.other, args.shown))
        return 0
    return run(args.variant, args.outcomes, args.tests, args.budget, rest)


if __name__ == "__main__":
    sys.exit(main())
