import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # SMLA_BACKEND in the caller's environment would change what explain() chooses.
    monkeypatch.delenv("SMLA_BACKEND", raising=False)
