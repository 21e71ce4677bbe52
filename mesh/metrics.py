"""What every process of the mesh shares about its Prometheus metrics.

Each process keeps its series in one ``prometheus_client.CollectorRegistry`` of its
own (never the library's global default, so tests can run several in one
interpreter) and serves it on ``--metrics-port`` with prometheus_client's HTTP
server; stage 0 also answers ``GET /metrics`` on its HTTP API. This module holds the
histogram buckets in base units and the server start; the ports are settings of the
configuration tree (``metrics_port`` in ``[coordinator]`` and ``[stage]``,
``stage_metrics_port_base`` in ``[coordinator]``). The series
themselves are defined where they are recorded: ``stage/metrics.py`` (every stage),
``stage/frontend/telemetry.py`` and ``stage/frontend/engine_metrics.py`` (stage 0),
``coordinator/metrics.py`` (the coordinator). ``docs/operations.md`` lists them all.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)

from mesh.errors import InvalidRequest
from mesh.netaddr import bind_problem, url_host

logger = logging.getLogger(__name__)

# Counters and histograms without the ``*_created`` timestamp series: a scrape holds
# what an operator graphs, and every counter family's samples end in ``_total``.
disable_created_metrics()

__all__ = [
    "CONTENT_TYPE_LATEST",
    "CollectorRegistry",
    "generate_latest",
]

# Request-level latencies (time to first token, a whole HTTP request, a load).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Per-token and per-frame times: a decode step is milliseconds to a second.
STEP_BUCKETS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
    5.0,
)
# Time a frame waits before its compute starts.
QUEUE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# Segments (sessions) in one frame.
SEGMENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Tokens (activation rows) in one frame.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def local_stage_metrics_argv(base: int | None, index: int) -> list[str]:
    """The ``--metrics-port`` of local stage ``index`` started by ``up`` (none unless
    ``stage_metrics_port_base`` is set; 0: each a free port)."""
    if base is None:
        return []
    return ["--metrics-port", str(base + index if base else 0)]


def check_local_stage_metrics_ports(host: str, base: int | None, indices: range) -> None:
    """Refuse, naming ``--stage-metrics-port-base``, when a port the local stages
    ``indices`` would serve metrics on is taken (their own error could only name their
    ``--metrics-port``, a flag ``up`` sets for them)."""
    if not base:
        return
    for index in indices:
        port = base + index
        problem = bind_problem(host, port)
        if problem is not None:
            raise InvalidRequest(
                f"local stage {index} cannot serve metrics on {url_host(host)}:{port} "
                f"({problem}); another process holds it: choose another "
                "--stage-metrics-port-base (stage i serves on base + i)"
            )


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int | None, *, who: str = "this process"
) -> int | None:
    """Serve ``registry`` over HTTP on ``host:port`` in a daemon thread and log where;
    the bound port (None when ``port`` is None: metrics are off)."""
    if port is None:
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise InvalidRequest(
            f"cannot serve metrics on {url_host(host)}:{port} ({error.strerror}); another "
            "process holds it: choose another --metrics-port"
        ) from None
    bound = int(server.server_port)
    logger.info("%s serves metrics on http://%s:%d/metrics", who, url_host(host), bound)
    return bound
