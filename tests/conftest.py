"""Shared fixtures: the converted tiny model (made once per machine and cached)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from connector.model_files import ensure_hf_model

    return ensure_hf_model()
