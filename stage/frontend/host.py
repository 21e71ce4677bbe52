"""Hosting the OpenAI frontend inside a stage-0 process.

The HTTP server starts with the process, so clients and health checks get a clear
503 while the pipeline loads. Each successful Load builds the app for the loaded
package (its tokenizer, model id and context) and swaps it in.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from mesh.api_keys import KeySource
from mesh.config import SpeculationConfig, cli_speculation_args, resolve_speculation
from mesh.errors import InvalidRequest, MeshError
from mesh.netaddr import is_wildcard, url_host
from mesh.package.end_tokens import end_tokens
from mesh.package.manifest import PackageManifest
from mesh.settings.commands import (
    JoinConfig,
    merge_serving,
    sent_speculation,
    sent_stall_timeout,
)
from stage.frontend.app import create_app
from stage.frontend.engine_types import EngineLimits
from stage.frontend.http_server import serve_app, stop_server
from stage.frontend.model_defaults import SamplingDefaults
from stage.frontend.prepare import FrontendLimits
from stage.frontend.scheduler import PipelineScheduler
from stage.frontend.status_page import STATUS_PATHS, StatusPage
from stage.frontend.telemetry import FrontendMetrics
from stage.frontend.token_bytes import byte_table
from stage.node import LoadedStage, StageNode

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
DRAINING = (
    "this server is shutting down and takes no new requests; retry (another replica, or "
    "this one once it is back)"
)
# Requests that start generations, refused while draining (with /health, so that a
# load balancer stops sending).
WORK_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/embeddings",
        "/completion",
        "/infill",
    }
)
DRAIN_POLL_S = 0.1
# A request still running when the drain ends fails with this (503), and the drain
# waits up to END_WAIT_S for the clients to be told.
STOPPING = (
    "this server stopped before the request finished; send it again (another replica, "
    "or this one once it is back)"
)
END_WAIT_S = 5.0


def _starts_work(scope: dict[str, Any]) -> bool:
    path = scope.get("path", "")
    return path == "/health" or (scope.get("method") == "POST" and path in WORK_PATHS)


class SwitchableApp:
    """An ASGI app that forwards to the current FastAPI app, or answers 503. The
    status page (stage/frontend/status_page.py) answers its own paths, loaded or not.
    While the process drains (``draining``), new generations and ``/health`` get 503
    and everything else, the running streams included, goes on."""

    def __init__(self) -> None:
        self.current: Any = None
        self.package_dir = ""
        self.reason = "the pipeline is not loaded yet"
        self.status: StatusPage | None = None
        self.draining = False

    async def __call__(self, scope, receive, send) -> None:
        if self.status is not None and scope.get("path") in STATUS_PATHS:
            await self.status(scope, receive, send)
            return
        app = self.current
        refused = self.draining and scope["type"] == "http" and _starts_work(scope)
        if app is not None and not refused:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if refused:
            message, code = DRAINING, "draining"
        else:
            message, code = self.reason, "pipeline_not_ready"
        error = {"message": message, "type": "service_unavailable", "param": None, "code": code}
        payload: dict[str, Any] = {"error": error}
        if scope.get("path") == "/health":  # the shape the loaded app's /health answers
            payload = {"status": "draining" if refused else "unavailable", "reason": message}
        body = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


@dataclass
class FrontendHost:
    url: str
    scheduler: PipelineScheduler
    switch: SwitchableApp
    server: Any
    thread: threading.Thread

    def drain(self, timeout_s: float, cut: threading.Event | None = None) -> int:
        """Refuse new generations and wait up to ``timeout_s`` for the running ones to
        finish, or until ``cut`` is set; returns how many were still running when it
        stopped waiting."""
        self.switch.draining = True
        cut = threading.Event() if cut is None else cut
        started = time.monotonic()
        deadline = started + timeout_s
        while self.scheduler.active_requests and time.monotonic() < deadline:
            if cut.wait(DRAIN_POLL_S):
                break
        left = self.scheduler.active_requests
        if left:
            logger.warning(
                "drain: %s request(s) still running after %.1f s; ending them",
                left,
                time.monotonic() - started,
            )
            # Their clients get the API's error (a stream's error event) rather than
            # a connection that just closes; then the HTTP server can stop at once.
            self.scheduler.end_all(STOPPING)
            ended = time.monotonic() + END_WAIT_S
            while self.scheduler.active_requests and time.monotonic() < ended:
                time.sleep(DRAIN_POLL_S)
        return left

    def stop(self) -> None:
        stop_server(self.server, self.thread)
        if self.switch.status is not None:
            self.switch.status.close()


def _speculation_config(
    args: argparse.Namespace,
    toml: dict[str, Any],
    model_id: str,
    loaded: LoadedStage,
    sent: tuple[tuple[str, str, str], ...],
) -> tuple[SpeculationConfig | None, tuple[str, ...]]:
    """Resolve the speculation config: this process's CLI > its TOML model entry >
    its TOML defaults > the coordinator's sources (sent with the Load) > package
    metadata > built-in, and what the operator should know about it. None
    (speculation off, with a warning) when it cannot be resolved: speculation never
    stops the frontend from serving."""
    layers = sent_speculation(sent)
    no_draft = bool(getattr(args, "no_draft", False))
    for _, layer in layers:
        no_draft = bool(layer.pop("no_draft", False)) or no_draft
    manifest = PackageManifest.load(loaded.package_dir)
    try:
        config = resolve_speculation(
            cli_speculation_args(args),
            toml,
            model_id,
            manifest.generation,
            no_draft=no_draft,
            lower=[layer for layer in layers if layer[1]],
        )
    except MeshError as error:
        logger.warning("speculation is off: %s", error.message)
        return None, (f"speculation is off: {error.message}",)
    for note in config.notes:
        logger.warning("speculation: %s", note)
    return config, config.notes


def _drafter(config: SpeculationConfig | None, loaded: LoadedStage, tokenizer):
    """The per-request drafter factory; a draft that cannot be used falls back to
    n-gram with a warning."""
    from mesh.speculative import build_drafter

    if config is None:
        return None
    runtime = loaded.engine.runtime
    factory = build_drafter(config, tokenizer, device=runtime.device, dtype=runtime.torch_dtype)
    if factory is None:
        logger.info("speculation is off")
    else:
        logger.info(
            "speculation: %s (policy %s, window %s..%s)%s",
            factory.name,
            config.window_policy.default,
            config.window_policy.min_window,
            config.window_policy.max_window,
            f"; {factory.fallback_reason}" if factory.fallback_reason else "",
        )
    return factory


def system_fingerprint(manifest: PackageManifest) -> str:
    """OpenAI's ``system_fingerprint``: it changes exactly when the served package
    (weights, tokenizer, config) does."""
    return "fp_" + manifest.sha256()[:12]


def start_frontend(
    node: StageNode, config: JoinConfig, args: argparse.Namespace, advertise: str = "127.0.0.1"
) -> FrontendHost:
    """Serve the OpenAI API on ``http_host``; its announced URL uses ``advertise``
    when that host is a wildcard (so a client on another host can use it). Each Load
    brings the coordinator's serving and speculation settings; what this process
    was given itself wins over them."""
    own = config.frontend
    scheduler = PipelineScheduler(node, model_id="", limits=EngineLimits.of(own.value))
    http_metrics = FrontendMetrics(node.metrics.registry)  # one per process, every app
    switch = SwitchableApp()
    api_keys = KeySource.configured(own.value.api_key_file)
    current: dict[str, Any] = {"speculation": None, "tokenizer": None}

    def on_load(loaded: LoadedStage | None) -> None:
        if loaded is None:
            switch.reason = "a stage of the pipeline was lost; the mesh is reloading"
            return
        sent = loaded.request.serving
        try:
            serving = merge_serving(own, sent)
        except MeshError as error:
            logger.warning("%s; keeping this process's own settings", error.message)
            serving = own
        scheduler.set_limits(EngineLimits.of(serving.value))
        scheduler.stall_timeout_s = sent_stall_timeout(sent)
        speculation, notes = _speculation_config(
            args, dict(config.toml), scheduler.model_id, loaded, sent
        )
        package_dir = str(loaded.package_dir)
        same_package = switch.current is not None and switch.package_dir == package_dir
        if same_package and speculation == current["speculation"]:
            return
        if not same_package:
            from transformers import AutoTokenizer

            try:
                current["tokenizer"] = AutoTokenizer.from_pretrained(loaded.package_dir)
            except (OSError, ValueError, TypeError) as error:
                raise InvalidRequest(
                    f"the package at {loaded.package_dir} has no tokenizer stage 0 can load "
                    f"({error}); rebuild it from a source with the model's tokenizer files"
                ) from None
            # Each token's bytes (log-probabilities, /tokenize pieces), read once here
            # rather than on the event loop by the first request that needs them.
            byte_table(current["tokenizer"])
        tokenizer = current["tokenizer"]
        scheduler.speculation = _drafter(speculation, loaded, tokenizer)
        scheduler.speculation_notes = notes
        current["speculation"] = speculation
        if same_package:
            return
        scheduler.detokenize = tokenizer.decode
        manifest = PackageManifest.load(loaded.package_dir)
        switch.current = create_app(
            scheduler,
            tokenizer,
            model_id=scheduler.model_id,
            api_key=api_keys,
            limits=FrontendLimits(
                reasoning_format=own.value.reasoning_format,
                stored_responses=own.value.stored_responses,
                embedding_pooling=own.value.embedding_pooling,
                sampling_defaults=(
                    SamplingDefaults.of_package(loaded.package_dir)
                    if own.value.sampling_defaults == "model"
                    else SamplingDefaults()
                ),
            ),
            fingerprint=system_fingerprint(manifest),
            embedding_size=manifest.hidden_size,
            metrics=http_metrics,
            stop_token_ids=end_tokens(tokenizer, loaded.package_dir),
        )
        switch.package_dir = package_dir
        logger.info("frontend serving %s", scheduler.model_id)

    node.on_load_change(on_load)
    switch.status = StatusPage(node, scheduler, config.stage.value.coordinator, api_keys)
    http_host, http_port = own.value.http_host, own.value.http_port
    server, thread, port = serve_app(switch, http_host, http_port, log_level="warning")
    host = advertise if is_wildcard(http_host) else http_host
    url = f"http://{url_host(host)}:{port}"
    logger.info("OpenAI frontend on %s (ready once the pipeline is loaded)", url)
    return FrontendHost(url=url, scheduler=scheduler, switch=switch, server=server, thread=thread)
