"""Running the checks: as one call (:func:`run_backend_conformance`) or as a pytest
class with one test per check (:class:`BackendConformance`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvsdk.testing.checks import CHECKS
from kvsdk.testing.harness import (
    BackendFactory,
    CheckSkipped,
    ConformanceReport,
    RawAccess,
    harness,
)


def run_backend_conformance(
    make_backend: BackendFactory,
    *,
    persistent: bool,
    shared: bool,
    raw: RawAccess | None = None,
    checks: Sequence[str] | None = None,
) -> ConformanceReport:
    """Run every check (or those named in ``checks``) against backends from ``make_backend``.

    Raises :class:`AssertionError` listing each failed check with its reason;
    otherwise returns which checks passed and which were skipped (and why).
    """
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; expected some of {list(CHECKS)}")
    report = ConformanceReport(backend="backend")
    failures: list[str] = []
    for name in names:
        try:
            with harness(make_backend, persistent, shared, raw) as h:
                try:
                    CHECKS[name](h)
                finally:
                    report.backend = h.backend_name or report.backend
        except CheckSkipped as exc:
            report.skipped[name] = str(exc)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        except Exception as exc:
            failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
        else:
            report.passed.append(name)
    if failures:
        raise AssertionError(
            f"{report.backend}: {len(failures)} of {len(names)} conformance checks failed:\n"
            + "\n".join(f"  - {f}" for f in failures)
        )
    return report


class BackendConformance:
    """A pytest mixin: one test per check. Subclass it as ``Test...``, set
    ``persistent`` / ``shared`` (and ``raw`` to enable the integrity checks)
    and provide a ``backend_factory`` fixture returning a :data:`BackendFactory`."""

    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    raw: ClassVar[RawAccess | None] = None

    def _run(self, name: str, factory: BackendFactory) -> None:
        try:
            with harness(factory, self.persistent, self.shared, self.raw) as h:
                CHECKS[name](h)
        except CheckSkipped as exc:
            import pytest

            pytest.skip(str(exc))

    def test_declares_name_options_medium_and_locality(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("class_attributes", backend_factory)

    def test_payloads_of_every_size_round_trip(self, backend_factory: BackendFactory) -> None:
        self._run("round_trip", backend_factory)

    def test_put_accepts_every_buffer_type(self, backend_factory: BackendFactory) -> None:
        self._run("buffer_types", backend_factory)

    def test_empty_batches_give_empty_answers(self, backend_factory: BackendFactory) -> None:
        self._run("empty_batches", backend_factory)

    def test_missing_keys_are_misses(self, backend_factory: BackendFactory) -> None:
        self._run("missing_keys", backend_factory)

    def test_batches_keep_order_with_duplicates_and_misses(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("batch_order_and_duplicates", backend_factory)

    def test_delete_counts_distinct_stored_keys(self, backend_factory: BackendFactory) -> None:
        self._run("delete_counts", backend_factory)

    def test_clear_drops_every_entry(self, backend_factory: BackendFactory) -> None:
        self._run("clear", backend_factory)

    def test_put_of_a_stored_key_succeeds(self, backend_factory: BackendFactory) -> None:
        self._run("put_existing_key", backend_factory)

    def test_stats_are_finite_numbers(self, backend_factory: BackendFactory) -> None:
        self._run("stats", backend_factory)

    def test_namespaces_never_see_each_other(self, backend_factory: BackendFactory) -> None:
        self._run("namespaces", backend_factory)

    def test_entries_are_chunk_format_frames(self, backend_factory: BackendFactory) -> None:
        self._run("chunk_format_frames", backend_factory)

    def test_corrupt_or_foreign_entries_are_deleted_misses(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("corrupt_entries_are_misses", backend_factory)

    def test_concurrent_calls_get_correct_answers(self, backend_factory: BackendFactory) -> None:
        self._run("concurrent_calls", backend_factory)

    def test_close_twice_is_fine(self, backend_factory: BackendFactory) -> None:
        self._run("close_idempotent", backend_factory)

    def test_iter_keys_lists_exactly_the_stored_keys(self, backend_factory: BackendFactory) -> None:
        self._run("listing", backend_factory)

    def test_get_into_fills_right_sized_buffers(self, backend_factory: BackendFactory) -> None:
        self._run("get_into", backend_factory)

    def test_payloads_in_parts_round_trip(self, backend_factory: BackendFactory) -> None:
        self._run("scatter_gather", backend_factory)

    def test_capacity_and_corrupt_count_are_typed(self, backend_factory: BackendFactory) -> None:
        self._run("capacity_and_counters", backend_factory)

    def test_a_reopened_instance_sees_stored_entries(self, backend_factory: BackendFactory) -> None:
        self._run("persistent", backend_factory)

    def test_live_instances_share_entries(self, backend_factory: BackendFactory) -> None:
        self._run("shared", backend_factory)
