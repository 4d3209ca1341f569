"""The tests of experiments/bundled-base/ (not part of the product's suite: run them with
``python -m pytest -q experiments/bundled-base/tests`` from the repository root). They reuse the
product suite's fixtures (tests/conftest.py) and import the research scripts as modules."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/bundled-base/*.py
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.*

from tests.conftest import one_thread, pytest_configure, sample_store  # noqa: E402,F401  (fixtures and markers)
