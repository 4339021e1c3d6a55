"""Fixtures the decode service tests share: the tiny generated model and an engine config on it."""
from __future__ import annotations

import pytest

from kvwire.runtime import EngineConfig
from tests.decode_svc.harness import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cfg(model_dir):
    return EngineConfig(model_dir=model_dir, num_pages=128)
