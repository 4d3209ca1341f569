"""Shared fixtures: the bundled sample prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from genolong.data.prepare import prepare_genome
from genolong.quickstart import SAMPLE_EVAL, SAMPLE_TRAIN, sample_fasta


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample prepared once per test session (read-only for tests)."""
    out = tmp_path_factory.mktemp("sample") / "genome"
    prepare_genome([sample_fasta()], out, train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, progress=False)
    return out
