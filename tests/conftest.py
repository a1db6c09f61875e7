"""Run the tests against kvsdk as installed, never the source tree's partial copy.

The repository's root holds the core as ``kvsdk/`` while the adapters and the
built-in backends live in ``plugins/`` and ``backends/``, installed under the
same name (``kvsdk.plugins``, ``kvsdk.backends``) by the editable install's link
tree. ``python -m pytest`` puts the working directory first on ``sys.path``, where
``kvsdk`` would resolve to the core alone; this drops it, and ``PYTHONSAFEPATH``
keeps it out of every Python process a test starts (``python -m kvsdk.cli``,
vLLM's servers, spawned engine workers).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(autouse=True)
def _close_redis_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every redis tier a test opens is closed when the test ends: its local
    index's threads would otherwise keep retrying the test's (stopped) server
    for the rest of the session, and log it into later tests' output."""
    try:
        from kvsdk.backends.redis import RedisBackend
    except ImportError:  # an environment without redis-py (the SGLang venv)
        yield
        return
    opened: list[RedisBackend] = []
    init = RedisBackend.__init__

    def tracked(self: RedisBackend, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(RedisBackend, "__init__", tracked)
    yield
    for backend in opened:
        backend.close()  # a second close (the test's own) does nothing more
