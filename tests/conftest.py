"""Shared test setup: quiet, offline environment; the project root importable; a throw-away project copy."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

for _key, _value in {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # flows/ and tasks/ are not installed; --import-mode=importlib adds no paths
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def tmp_project(tmp_path: Path) -> Path:
    """A temporary project root holding a copy of params.yaml (outputs and the MLflow store land inside it)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path
