"""Every package folder of the three top-level trees is in the distribution.

pyproject lists the packages by hand (``[tool.setuptools] packages``) because
``plugins/`` and ``backends/`` are mapped under ``kvsdk`` through
``package-dir``; a new folder left out of that list would be missing from the
wheel while the editable install still found it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    """The import name of every folder holding an ``__init__.py``, as mapped."""
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            dotted = ".".join([name, *rel.parts])
            if not any(
                dotted.startswith(other + ".") and len(other) > len(name) for other in package_dir
            ):  # a folder mapped elsewhere counts once, under its own name
                found.add(dotted)
    return found


def test_every_package_folder_is_listed() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(conf["packages"]) == packages_on_disk(conf["package-dir"])
