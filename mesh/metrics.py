"""A small Prometheus registry: counters, gauges and histograms with labels.

Renders the Prometheus text exposition format (version 0.0.4). Every metric is
thread-safe, so the HTTP frontend, the engine's threads and gRPC servicers may
update the same registry.

    registry = Registry()
    served = registry.counter("mesh_served_total", "Requests served.", ("endpoint", "status"))
    served.labels(endpoint="/v1/completions", status="200").inc()
    registry.render()
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it (``+Inf``, ``NaN``, integers without ``.0``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    """Shared label handling and rendering; subclasses define ``kind`` and ``_new_child``."""

    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str]) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}: use [a-zA-Z_:][a-zA-Z0-9_:]*")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names {tuple(labelnames)} for metric {name}")
        self.name = name
        self.help_text = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()

    def _key(self, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[str, ...]:
        if args and kwargs:
            raise ValueError(f"{self.name}: pass label values by position or by name, not both")
        if kwargs:
            if set(kwargs) != set(self.labelnames):
                raise ValueError(
                    f"{self.name} takes labels {self.labelnames}, got {tuple(sorted(kwargs))}"
                )
            return tuple(str(kwargs[n]) for n in self.labelnames)
        if len(args) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {len(args)} values")
        return tuple(str(a) for a in args)

    def _child(self, args: tuple[object, ...], kwargs: dict[str, object]):
        key = self._key(args, kwargs)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._new_child()
                self._children[key] = child
            return child

    def _unlabelled(self):
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}: call .labels(...) first")
        return self._children[()]

    def _items(self) -> list[tuple[tuple[str, ...], object]]:
        with self._lock:
            return sorted(self._children.items())

    def render(self) -> list[str]:
        lines = [
            f"# HELP {self.name} {_escape_help(self.help_text)}",
            f"# TYPE {self.name} {self.kind}",
        ]
        for key, child in self._items():
            lines.extend(self._sample_lines(key, child))
        return lines

    def _sample_lines(self, key: tuple[str, ...], child) -> Iterable[str]:
        yield f"{self.name}{_label_text(self.labelnames, key)} {format_value(child.get())}"


class _Value:
    """One counter or gauge series."""

    def __init__(self, monotonic: bool) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._monotonic = monotonic

    def inc(self, amount: float = 1.0) -> None:
        if self._monotonic and amount < 0:
            raise ValueError(f"a counter only goes up; got inc({amount})")
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        if self._monotonic:
            raise ValueError("a counter cannot be decremented")
        with self._lock:
            self._value -= amount

    def set(self, value: float) -> None:
        if self._monotonic:
            raise ValueError("a counter cannot be set")
        with self._lock:
            self._value = float(value)

    def get(self) -> float:
        with self._lock:
            return self._value


class Counter(_Metric):
    kind = "counter"

    def _new_child(self) -> _Value:
        return _Value(monotonic=True)

    def labels(self, *values: object, **named: object) -> _Value:
        return self._child(values, named)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def get(self) -> float:
        return self._unlabelled().get()


class Gauge(_Metric):
    kind = "gauge"

    def _new_child(self) -> _Value:
        return _Value(monotonic=False)

    def labels(self, *values: object, **named: object) -> _Value:
        return self._child(values, named)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def get(self) -> float:
        return self._unlabelled().get()


class _HistogramSeries:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            self._count += 1
            for i, bound in enumerate(self._bounds):
                if value <= bound:
                    self._counts[i] += 1
                    break

    def snapshot(self) -> tuple[list[int], float, int]:
        """Cumulative bucket counts (one per bound, +Inf last), the sum and the count."""
        with self._lock:
            cumulative, running = [], 0
            for count in self._counts:
                running += count
                cumulative.append(running)
            cumulative[-1] = self._count
            return cumulative, self._sum, self._count


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        if "le" in labelnames:
            raise ValueError(f"histogram {name} cannot use the reserved label 'le'")
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if not bounds or any(nxt <= prev for prev, nxt in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"histogram {name} needs strictly increasing buckets, got {buckets}")
        self._bounds = (*bounds, math.inf)
        super().__init__(name, help_text, labelnames)

    def _new_child(self) -> _HistogramSeries:
        return _HistogramSeries(self._bounds)

    def labels(self, *values: object, **named: object) -> _HistogramSeries:
        return self._child(values, named)

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def _sample_lines(self, key: tuple[str, ...], child) -> Iterable[str]:
        cumulative, total, count = child.snapshot()
        for bound, running in zip(self._bounds, cumulative, strict=True):
            le = f'le="{format_value(bound)}"'
            labels = _label_text(self.labelnames, key, le)
            yield f"{self.name}_bucket{labels} {running}"
        plain = _label_text(self.labelnames, key)
        yield f"{self.name}_sum{plain} {format_value(total)}"
        yield f"{self.name}_count{plain} {count}"


class Registry:
    """A named set of metrics rendered together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> None:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help_text, labelnames)
        self._add(metric)
        return metric

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, help_text, labelnames)
        self._add(metric)
        return metric

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        metric = Histogram(name, help_text, labelnames, buckets)
        self._add(metric)
        return metric

    def render(self) -> str:
        """The whole registry in the Prometheus text format, ending with a newline."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for metric in metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n" if lines else ""
