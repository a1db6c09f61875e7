"""The backend conformance suite: the checks every storage backend passes.

kvsdk's own ``disk`` and ``redis`` backends run exactly these checks, and a
third-party backend runs them the same way, either from a plain function::

    from kvsdk.testing import run_backend_conformance

    def test_my_backend_conforms(tmp_path):
        run_backend_conformance(
            lambda ctx: MyBackend(MyOptions(path=str(tmp_path)), ctx),
            persistent=True,
            shared=True,
        )

or as a pytest class, one test per check (a failure names the behaviour)::

    import pytest
    from kvsdk.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        persistent = True
        shared = True

        @pytest.fixture
        def backend_factory(self, tmp_path):
            return lambda ctx: MyBackend(MyOptions(path=str(tmp_path)), ctx)

The factory is called with a :class:`~kvsdk.backend.TierContext` (as
kvsdk's store factory calls ``cls(options, context)``) and must open the
*same storage location* on every call within one run: that is how the suite
builds a second namespace on the same location, and, with ``persistent`` or
``shared``, a second instance. Give it room for at least
:data:`MIN_CAPACITY_BYTES`. Every check starts with ``clear()`` on what it opens.

What the suite pins down:

- Payloads of 0, 1, 13, 4 KiB, 256 KiB + 3 and 1 MiB + 1 bytes round-trip
  exactly. ``put`` accepts ``bytes``, ``bytearray`` and ``memoryview`` (also
  of a numpy ``uint8`` row, which is what the tiered store passes); ``get``
  returns a flat byte buffer whose ``len()`` is its byte length. A
  zero-length payload is included on purpose: the store never writes one,
  but a backend that tests ``if value:`` instead of ``is not None`` would
  turn a stored chunk into a miss, and a framed entry is never empty anyway.
- Batched calls answer one value per key, in order, with duplicate and
  missing keys interleaved; empty batches are fine. A missing key is a miss:
  ``exists`` False, ``get`` None, ``delete`` counts 0, never an exception.
- ``delete`` returns how many distinct stored keys it removed; ``clear``
  drops every entry of the backend's namespace and no other namespace's.
- ``put`` of a key already stored returns True and the key stays readable
  (keys are content hashes: a second value for the same key is equal in
  practice; a backend may keep either).
- ``stats()`` is a ``dict`` of names to finite numbers.
- Two namespaces on one location never see each other's entries.
- Several threads calling one instance at once get correct answers.
- ``close()`` may be called twice.
- ``iter_keys()`` lists exactly the stored keys (when ``supports_listing``).
- ``get_into`` fills right-sized buffers and answers False for a missing key
  or a buffer of another size; ``put_parts`` / ``get_into_parts`` move a
  payload given as parts. Declared capabilities are honest: a backend that
  sets ``supports_get_into`` / ``supports_scatter_gather`` overrides those
  methods (the defaults copy).
- ``capacity_bytes()`` is a positive int or None; ``corrupt_count()`` an int
  that grows when a corrupt entry is read (checked with raw access).
- ``persistent=True``: a new instance on the same location, opened after the
  first was closed, sees its entries.
- ``shared=True``: two live instances see each other's puts, deletes and clears;
  the backend then declares a ``locality`` wider than ``PROCESS``.

Integrity checks need raw access to what the backend stored; a backend
that keeps bytes outside the process (and so frames them with
:mod:`kvsdk.chunk_format`) provides it as a :class:`RawAccess` (``raw=`` or
the class attribute): ``read_raw(backend, key)`` returns the stored bytes,
``write_raw(backend, key, data)`` replaces (or creates) them. With it the
suite checks that entries are chunk-format frames for the right namespace
and key, and that a corrupt, truncated, foreign, pickled or garbage value is
a miss that the backend deletes. Without it those two checks are skipped.

Capacity and eviction are not checked here: their semantics are each
backend's own (test them next to the backend).
"""

from kvsdk.testing.harness import (
    CHUNK_BYTES,
    MIN_CAPACITY_BYTES,
    NAMESPACE_A,
    NAMESPACE_B,
    PAYLOAD_SIZES,
    BackendFactory,
    ConformanceReport,
    RawAccess,
    conformance_context,
)
from kvsdk.testing.runner import BackendConformance, run_backend_conformance

__all__ = [
    "CHUNK_BYTES",
    "MIN_CAPACITY_BYTES",
    "NAMESPACE_A",
    "NAMESPACE_B",
    "PAYLOAD_SIZES",
    "BackendConformance",
    "BackendFactory",
    "ConformanceReport",
    "RawAccess",
    "conformance_context",
    "run_backend_conformance",
]
