"""Fixtures for the SGLang adapter tests (helpers live in ``sglang_rig.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sglang_rig import Rig, set_parallel


@pytest.fixture(scope="session", autouse=True)
def _sglang_process_state() -> Iterator[None]:
    try:
        import sglang  # noqa: F401
    except ImportError:
        yield
        return
    set_parallel()
    yield


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """Rigs built in a test are closed after it."""
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


@pytest.fixture
def make_rig(rigs: list[Rig]) -> Any:
    def make(**kw: Any) -> Rig:
        rig = Rig(**kw)
        rigs.append(rig)
        return rig

    return make
