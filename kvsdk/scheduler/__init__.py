"""The engine-agnostic scheduler side of an offloading connector
(:class:`OffloadScheduler`, in :mod:`kvsdk.scheduler.offload`), and the
per-request state and chunk arithmetic it runs on (:mod:`kvsdk.scheduler.request`)."""

from kvsdk.scheduler.offload import DECODE_STORE_CHUNKS, OffloadScheduler, StepJobs, WorkerResult

__all__ = ["DECODE_STORE_CHUNKS", "OffloadScheduler", "StepJobs", "WorkerResult"]
