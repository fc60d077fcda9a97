"""Prometheus metrics of the server, in the text exposition format (no client library needed).

Counters and histograms are updated from the request handlers and worker threads (a lock guards them);
``render`` also samples gauges (RSS, queue) and the LM scheduler's counters at scrape time.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
OUTCOMES = ("ok", "bad_request", "rejected", "cancelled", "timeout", "error")


def _escape(value: str) -> str:
    """A label value in the exposition format (backslash, double quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    """A cumulative-bucket histogram (Prometheus ``_bucket``/``_sum``/``_count``)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return [*out, f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """The server's metrics. ``gauges`` and ``counters`` are read at scrape time: name -> (help, callable)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome) -> count
        self.first_audio = Histogram(SECONDS_BUCKETS)
        self.queue_wait = Histogram(SECONDS_BUCKETS)
        self.duration = Histogram(SECONDS_BUCKETS)
        self.rtf = Histogram(RTF_BUCKETS)
        self.audio_seconds = 0.0
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.counters: dict[str, tuple[str, Callable[[], float]]] = {}  # read at scrape time like the gauges
        self.batch_sizes: Callable[[], dict[int, int]] | None = None
        self.lm_counters: Callable[[], dict[str, float]] | None = None

    def count(self, endpoint: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def speech_done(self, queue_wait: float, first_audio: float | None, seconds: float, audio: float) -> None:
        """Record one finished synthesis: its queue wait, time to first audio, wall time and audio seconds."""
        with self._lock:
            self.queue_wait.observe(queue_wait)
            if first_audio is not None:
                self.first_audio.observe(first_audio)
            self.duration.observe(seconds)
            self.audio_seconds += audio
            if audio > 0:
                self.rtf.observe(seconds / audio)

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``)."""
        lines: list[str] = []

        def block(name: str, kind: str, help_: str, body: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *body])

        with self._lock:
            body = [
                f'cosyvoice_requests_total{{endpoint="{_escape(e)}",outcome="{o}"}} {n}'
                for (e, o), n in sorted(self.requests.items())
            ]
            block("cosyvoice_requests_total", "counter", "HTTP requests by endpoint and outcome.", body)
            for name, hist, help_ in (
                ("cosyvoice_time_to_first_audio_seconds", self.first_audio, "Request start to its first audio."),
                ("cosyvoice_queue_wait_seconds", self.queue_wait, "Time a synthesis waited for a worker."),
                ("cosyvoice_synthesis_seconds", self.duration, "Wall time of a synthesis."),
                ("cosyvoice_rtf", self.rtf, "Real-time factor of a synthesis (wall time / audio time)."),
            ):
                block(name, "histogram", help_, hist.lines(name))
            block(
                "cosyvoice_audio_seconds_total",
                "counter",
                "Seconds of audio synthesized.",
                [f"cosyvoice_audio_seconds_total {self.audio_seconds:.3f}"],
            )
        if self.lm_counters is not None:
            for key, value in self.lm_counters().items():
                name = f"cosyvoice_lm_{key}"
                kind = "gauge" if key.endswith("per_second") else "counter"
                block(name, kind, f"LM scheduler: {key.replace('_', ' ')}.", [f"{name} {value:.6g}"])
        if self.batch_sizes is not None:
            sizes = self.batch_sizes()
            body = [f'cosyvoice_lm_batch_steps_total{{rows="{k}"}} {v}' for k, v in sorted(sizes.items())]
            block("cosyvoice_lm_batch_steps_total", "counter", "LM decode steps by rows decoded together.", body)
        for kind, read_at_scrape in (("counter", self.counters), ("gauge", self.gauges)):
            for name, (help_, read) in read_at_scrape.items():
                try:
                    value = float(read())
                except Exception as e:  # a gauge never breaks the scrape
                    logger.debug("%s %s failed: %s", kind, name, e)
                    continue
                block(name, kind, help_, [f"{name} {value:.6g}"])
        return "\n".join(lines) + "\n"
