"""docs/configuration.md is generated from the schema and must stay in step with it."""

from __future__ import annotations

from pathlib import Path

from kvsdk.config_reference import reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_documents_every_option_of_every_builtin_backend() -> None:
    text = reference_markdown()
    for needle in (
        "`chunk_tokens`",
        "`tenant_quotas`",
        "`admission.min_lookups`",
        "### `backend: cpu`",
        "### `backend: disk`",
        "### `backend: faulty`",
        "`capacity`",
        "`wraps`",
    ):
        assert needle in text


def test_committed_reference_is_up_to_date() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `kvsdk config reference -o docs/configuration.md`"
    )
