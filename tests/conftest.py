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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
