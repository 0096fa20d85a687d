"""A pytest plugin that runs a client library's own tests with torchTensorRef imported.

Loaded by ``client_tests.py`` (``-p client_tests_plugin``); the variant comes from
``TORCHTENSORREF_CLIENT_VARIANT``:

- ``plain``: nothing imported (the reference run);
- ``cpu``: ``import torchTensorRef`` and nothing else (device "cpu", no budget);
- ``sim``: device "sim", Flow, the budget ``TORCHTENSORREF_CLIENT_BUDGET`` (default 256KiB),
  and every collected test runs on "sim": its class's ``torch_device`` attribute (peft) and
  the module-level ``torch_device`` of every loaded module that has one (diffusers' and
  transformers' tests and testing utilities) say "sim".

Each test's outcome is appended to ``TORCHTENSORREF_CLIENT_OUTCOMES`` as
``node id <TAB> outcome <TAB> first line of the error``, by the process that sees every
report (xdist's controller, so a crashed worker's test is reported too).
"""

from __future__ import annotations

import os
import sys

VARIANT = os.environ.get("TORCHTENSORREF_CLIENT_VARIANT", "plain")
OUTCOMES = os.environ.get("TORCHTENSORREF_CLIENT_OUTCOMES")

if VARIANT != "plain":
    import torchTensorRef
    from torchTensorRef import tensorsManager
    from torchTensorRef.core.sizes import parse_size

    if VARIANT == "sim":
        tensorsManager.device = "sim"
        tensorsManager.strategy = "flow"
        # (on top of what the device holds beside the manager: emulated workspaces, say)
        tensorsManager.budget = tensorsManager.outside_bytes() + parse_size(
            os.environ.get("TORCHTENSORREF_CLIENT_BUDGET", "256KiB"), none=False)

_seen: dict = {}
#: whether this process is one of xdist's workers (asked of pytest's configuration: a
#: variable in the environment may be inherited from a pytest run that started this one)
_worker = [False]


def pytest_configure(config):
    _worker[0] = hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    if VARIANT != "sim":
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and hasattr(cls, "torch_device"):
            cls.torch_device = "sim"
    # (a test module imports the name from the library's testing utilities, and so do the
    # mixins its classes inherit from, wherever they are: each module's own global is the
    # one its code reads, and a module with one is a test's or a testing utility's)
    for module in list(sys.modules.values()):
        if isinstance(getattr(module, "torch_device", None), str):
            module.torch_device = "sim"


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return  # (setup and teardown that passed say nothing about the test)
    previous = _seen.get(report.nodeid)
    if previous in ("failed", "error"):
        return  # (a teardown after a failed call does not replace the failure)
    outcome = "error" if report.when != "call" and report.outcome == "failed" else report.outcome
    message = ""
    if outcome != "passed" and report.longrepr is not None:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
        message = text.strip().splitlines()[0][:300] if text.strip() else ""
    _seen[report.nodeid] = outcome
    if OUTCOMES and not _worker[0]:
        with open(OUTCOMES, "a") as f:
            f.write(f"{report.nodeid}\t{outcome}\t{message}\n")


def pytest_report_header(config):
    where = torchTensorRef.__file__ if VARIANT != "plain" else "not imported"
    return f"torchTensorRef variant {VARIANT}: {where}"
