"""Tests of the manager's settings that take sizes, folders and hooks: what each refuses."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import torchTensorRef
from paired import budget, values
from torchTensorRef import tensorsManager as tm

SIZE_SETTINGS = ["budget", "host_budget", "sim_capacity", "host_reserve", "pinned_limit", "sim_workspace"]
#: the environment variables that set a size
SIZE_VARIABLES = {"TORCHTENSORREF_BUDGET": "budget", "TORCHTENSORREF_HOST_BUDGET": "host_budget",
                  "TORCHTENSORREF_SIM_WORKSPACE": "sim_workspace"}
#: more digits than a float holds: read as a float, it was infinity
TOO_LARGE = "9" * 400 + "GiB"


def _settings():
    return {name: getattr(tm, name) for name in SIZE_SETTINGS + ["device", "offload_dir", "fault_injector"]}


@pytest.mark.parametrize("name", SIZE_SETTINGS)
def test_a_size_too_large_is_refused_naming_the_setting_and_changes_nothing(name):
    # A size string too large for a float raised OverflowError ("cannot convert float
    # infinity to integer"), naming neither the setting nor what is accepted.
    before = _settings()
    with pytest.raises(ValueError) as info:
        setattr(tm, name, TOO_LARGE)
    message = str(info.value)
    assert message.startswith(f"{name} must be") and '"512MiB"' in message and "2**63 - 1" in message
    assert _settings() == before


@pytest.mark.parametrize("variable", sorted(SIZE_VARIABLES))
def test_a_size_too_large_in_the_environment_names_the_variable_and_changes_nothing(variable):
    # The same OverflowError came from the environment variables, at import.
    before = _settings()
    with pytest.raises(ValueError, match=f"^environment variable {variable}: {SIZE_VARIABLES[variable]} must be"):
        torchTensorRef.configure_from_environment({"TORCHTENSORREF_DEVICE": "cpu", variable: TOO_LARGE})
    assert _settings() == before  # (the device set before the variable refused is given back)


@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint64])
def test_a_budget_of_numpy_integers_is_accepted_as_numpy_floats_are(kind):
    # numpy.int64(2**14) was refused as a budget while numpy.float64(2**14) was accepted.
    nbytes = budget("64KiB")
    tm.budget = kind(nbytes)
    assert tm.budget == nbytes and type(tm.budget) is int
    x = torch.arange(6.0)
    with torchTensorRef.disabled():
        expected = torch.arange(6.0) * 2
    torch.testing.assert_close(values(x * 2).cpu(), expected)


@pytest.mark.parametrize("value", [3, "fail", object()])
def test_a_fault_injector_that_cannot_be_called_is_refused_and_changes_nothing(value):
    # A non-callable fault_injector was accepted, and then every op failed calling it.
    before = _settings()
    with pytest.raises(TypeError, match="fault_injector must be a callable taking a Fault, or None"):
        tm.fault_injector = value
    assert _settings() == before
    with torchTensorRef.disabled():
        expected = torch.ones(3) + 1
    torch.testing.assert_close(values(torch.ones(3) + 1).cpu(), expected)


def test_an_empty_offload_dir_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    # offload_dir = "" was taken as the current folder, where spill files then went unasked.
    monkeypatch.chdir(tmp_path)
    before = _settings()
    with pytest.raises(ValueError, match="offload_dir must be a folder path or None .*\"[.]\" for the current"):
        tm.offload_dir = ""
    assert _settings() == before
    tm.offload_dir = "."  # (the current folder, said so)
    assert tm.offload_dir == os.getcwd()
