"""The Prometheus registry in mesh/metrics.py: values, labels, escaping, format."""

from __future__ import annotations

import threading

import pytest

from mesh.metrics import Registry, format_value


def test_counter_gauge_and_labels_render() -> None:
    registry = Registry()
    requests = registry.counter("app_requests_total", "Requests.", ("endpoint", "status"))
    active = registry.gauge("app_active", "In flight.")
    requests.labels(endpoint="/a", status="200").inc()
    requests.labels("/a", "200").inc(2)
    requests.labels(endpoint="/b", status="404").inc()
    active.inc(3)
    active.dec()
    text = registry.render()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert "# HELP app_requests_total Requests." in lines
    assert "# TYPE app_requests_total counter" in lines
    assert 'app_requests_total{endpoint="/a",status="200"} 3' in lines
    assert 'app_requests_total{endpoint="/b",status="404"} 1' in lines
    assert "# TYPE app_active gauge" in lines
    assert "app_active 2" in lines


def test_unlabelled_counter_renders_zero_before_use() -> None:
    registry = Registry()
    registry.counter("app_errors_total", "Errors.")
    assert "app_errors_total 0" in registry.render().splitlines()


def test_histogram_buckets_are_cumulative_with_sum_and_count() -> None:
    registry = Registry()
    latency = registry.histogram("app_seconds", "Latency.", ("endpoint",), (0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 7.0):
        latency.labels(endpoint="/x").observe(value)
    lines = registry.render().splitlines()
    assert 'app_seconds_bucket{endpoint="/x",le="0.1"} 1' in lines
    assert 'app_seconds_bucket{endpoint="/x",le="1"} 3' in lines
    assert 'app_seconds_bucket{endpoint="/x",le="+Inf"} 4' in lines
    assert 'app_seconds_sum{endpoint="/x"} 8.05' in lines
    assert 'app_seconds_count{endpoint="/x"} 4' in lines


def test_label_values_and_help_are_escaped() -> None:
    registry = Registry()
    counter = registry.counter("app_total", "Help with \\ and\nnewline.", ("path",))
    counter.labels(path='a"b\\c\nd').inc()
    text = registry.render()
    assert "# HELP app_total Help with \\\\ and\\nnewline." in text
    assert 'app_total{path="a\\"b\\\\c\\nd"} 1' in text


def test_misuse_is_refused() -> None:
    registry = Registry()
    counter = registry.counter("app_total", "x", ("a",))
    with pytest.raises(ValueError):
        registry.counter("app_total", "again")
    with pytest.raises(ValueError):
        counter.inc()  # labelled metric needs .labels()
    with pytest.raises(ValueError):
        counter.labels(b="1")
    with pytest.raises(ValueError):
        counter.labels(a="1").inc(-1)
    with pytest.raises(ValueError):
        registry.histogram("app_h", "x", ("le",))
    with pytest.raises(ValueError):
        registry.histogram("app_h2", "x", buckets=(1.0, 0.5))
    with pytest.raises(ValueError):
        registry.gauge("bad-name", "x")


def test_format_value() -> None:
    assert format_value(3.0) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(float("inf")) == "+Inf"
    assert format_value(float("nan")) == "NaN"


def test_concurrent_increments_are_not_lost() -> None:
    registry = Registry()
    counter = registry.counter("app_total", "x", ("k",))

    def work() -> None:
        for _ in range(2000):
            counter.labels(k="v").inc()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.labels(k="v").get() == 8000
