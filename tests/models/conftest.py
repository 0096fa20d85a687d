"""Fixtures for the model tests: offline Hugging Face, one run per strategy."""

from __future__ import annotations

import os

# Models are built from small configs with random weights: nothing may be downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from torchTensorRef import strategies  # noqa: E402


@pytest.fixture(params=strategies.NAMES)
def strategy(request, fresh_manager):
    """Every strategy the package ships, set on the manager (new ones are covered by name)."""
    fresh_manager.strategy = request.param
    return request.param
