"""Prometheus metrics of the server, in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms with optional labels; `Registry.render()` is the body of GET /metrics.
Counters are updated from the event loop only (request handlers), gauges are read from the engine's snapshot at
render time; a histogram may also be fed from another thread (the engine's step times), so it takes a lock.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable, Sequence

__all__ = ["Registry", "Counter", "CounterFn", "Gauge", "Histogram", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 2 ** 53 else repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        super().__init__(name, help, labels)
        self.values: dict[tuple, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def lines(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}"
                                for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    """A value read at render time from `read()`."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]):
        super().__init__(name, help)
        self.read = read

    def lines(self) -> list[str]:
        return self.header() + [f"{self.name} {_num(self.read())}"]


class CounterFn(Gauge):
    """A counter whose value is read at render time from `read()` (one another component advances)."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, help)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)     # the last one: above every bound
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, x: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, x)] += 1
            self.sum += x
            self.count += 1

    def lines(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        out, cum = self.header(), 0
        for b, c in zip(self.bounds + (math.inf,), counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_num(b)}"}} {cum}')
        return out + [f"{self.name}_sum {_num(total)}", f"{self.name}_count {n}"]


class Registry:
    def __init__(self):
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.lines()) + "\n"
