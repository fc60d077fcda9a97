"""Every thread pool of an engine's process, sized together: what ``cosyvoice-cpu doctor`` shows under "pools".

A process that synthesizes runs several pools at once, each from its own library: ONNX Runtime's intra-op threads
(one pool per graph session), OpenVINO's inference threads and the TBB arena it compiles on, NumPy's BLAS
(OpenBLAS's worker threads, made when NumPy is imported), the LM scheduler's thread and a server's synthesis
threads. The guide's "thread contention" pitfall is pools that each take every core. Here:

- ORT and OpenVINO run ``threads`` intra-op threads per call (the usable physical cores by default,
  :meth:`~cosyvoice_cpu.hardware.cpu.Hardware.threads`), with spinning off, so an idle pool sleeps;
- the LM scheduler is one thread that runs the LM's calls (batched across requests) while the callers' threads
  run the flow and the vocoder: two stages can compute at once (the streaming pipeline), each on ``threads``;
- NumPy's BLAS is never called by the runtime (``tests/unit/test_no_blas.py``): its workers stay asleep. A BLAS
  product could also wait forever for workers that a ``fork()`` in another thread shut down (issue 35).

:func:`blas_pool` reads OpenBLAS's size from the loaded library itself (the way threadpoolctl does, without it).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# OpenBLAS's thread-count getter under the names its builds export (NumPy's wheels prefix and suffix it)
_GETTERS = (
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
)


@dataclass(frozen=True)
class Pool:
    """One thread pool: its name, its size in threads, and what it runs."""

    name: str
    threads: int
    what: str


def blas_pool(maps: Path = Path("/proc/self/maps")) -> tuple[str, int] | None:
    """(library file name, worker threads) of the OpenBLAS that NumPy loaded, or None when NumPy uses another BLAS,
    is not imported, or the maps are unreadable (not Linux)."""
    try:
        paths = {line.split()[-1] for line in maps.read_text().splitlines() if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/") and ".so" in p):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
        for name in _GETTERS:
            getter = getattr(lib, name, None)
            if getter is not None:
                getter.restype = ctypes.c_int
                return Path(path).name, int(getter())
    return None


GUIDED_ROWS = 2  # a flow-estimator call's rows with guidance (flow.guidance.guidance_rows)


def splits_rows(threads: int, groups: int) -> bool:
    """Whether a call split into ``groups`` row groups runs them as one-thread calls at once on a session of
    ``threads`` threads (``SessionConfig.row_groups``): only where each group gets a thread of its own. Concurrent
    calls on one ONNX Runtime session share its one intra-op pool, so with more threads than groups they would not
    get a share each."""
    return groups >= 2 and threads == groups


def thread_pools(
    threads: int, lm_batch_rows: int, max_active: int | None = None, split_rows: bool = True
) -> list[Pool]:
    """The pools of an engine loaded with ``threads`` intra-op threads, ``lm_batch_rows`` (0: no scheduler) and
    ``split_rows`` (``EngineConfig.split_rows``); ``max_active`` when a server runs it."""
    pools = [
        Pool("onnxruntime", threads, "intra-op threads per graph call (one pool per session; idle threads sleep)"),
        Pool("openvino", threads, "inference threads per call of an OpenVINO graph; its compile uses TBB's arena"),
    ]
    if lm_batch_rows:
        pools.append(
            Pool(
                "lm-scheduler",
                1,
                f"decodes up to {lm_batch_rows} requests' LM steps as one call, "
                "while the callers run the flow and vocoder",
            )
        )
    if max_active:
        pools.append(Pool("server", max_active, "synthesis threads, one per request in flight"))
    if split_rows and splits_rows(threads, GUIDED_ROWS):
        pools.append(
            Pool(
                "flow-rows",
                1,
                "per flow-estimator call on ONNX Runtime, started for it: the second CFG row while the caller "
                "runs the first, each a call on one thread",
            )
        )
    import numpy  # noqa: F401  # loads its BLAS (the engine's process always has NumPy)

    blas = blas_pool()
    if blas is not None:
        name, n = blas
        pools.append(Pool("numpy-blas", n, f"OpenBLAS ({name}) workers: unused, the runtime makes no BLAS call"))
    return pools


def pool_lines(
    threads: int, lm_batch_rows: int, cores: int, max_active: int | None = None, split_rows: bool = True
) -> list[str]:
    """:func:`thread_pools` as ``doctor`` prints them, and the most threads that compute at once."""
    pools = thread_pools(threads, lm_batch_rows, max_active, split_rows)
    lines = [f"{p.name}: {p.threads} thread{'s' if p.threads != 1 else ''}, {p.what}" for p in pools]
    stages = 2 if lm_batch_rows else 1  # with the scheduler, a stream's LM decodes ahead while its flow runs
    busy = stages * threads
    if busy <= cores:
        lines.append(f"at most {busy} threads compute at once for one request, within the {cores} usable core(s)")
    else:  # the pipeline: measured faster than LM-then-flow (docs/benchmarks-log.md, "First audio")
        lines.append(
            f"a streamed request's LM and flow overlap: up to {busy} computing threads on {cores} usable "
            f"core(s) while both run (lm_batch_rows=0 runs them one after the other)"
        )
    return lines
