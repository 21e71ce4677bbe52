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
from dataclasses import dataclass
from typing import Any

from mesh.errors import MeshError
from mesh.netaddr import is_wildcard, url_host
from mesh.package.manifest import PackageManifest
from stage.frontend.app import create_app, serve_app, stop_server
from stage.frontend.engine_types import EngineLimits
from stage.frontend.scheduler import PipelineScheduler
from stage.node import LoadedStage, StageNode

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class SwitchableApp:
    """An ASGI app that forwards to the current FastAPI app, or answers 503."""

    def __init__(self) -> None:
        self.current: Any = None
        self.package_dir = ""
        self.reason = "the pipeline is not loaded yet"

    async def __call__(self, scope, receive, send) -> None:
        app = self.current
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        body = json.dumps(
            {
                "error": {
                    "message": self.reason,
                    "type": "service_unavailable",
                    "param": None,
                    "code": "pipeline_not_ready",
                }
            }
        ).encode()
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

    def stop(self) -> None:
        stop_server(self.server, self.thread)


def _read_api_key(args: argparse.Namespace) -> str | None:
    import os

    if getattr(args, "api_key_file", None):
        return args.api_key_file.read_text().strip() or None
    return os.environ.get("MESH_API_KEY") or None


def _speculation(args: argparse.Namespace, model_id: str, loaded: LoadedStage, tokenizer):
    """Resolve the speculation config (CLI > TOML model entry > TOML defaults >
    package metadata > built-in) and build the per-request drafter factory. A draft
    that cannot be used falls back to n-gram with a warning; speculation never stops
    the frontend from serving."""
    from mesh.config import cli_speculation_args, load_toml, resolve_speculation
    from mesh.package.manifest import PackageManifest
    from mesh.speculative import build_drafter

    toml = load_toml(args.config) if getattr(args, "config", None) else {}
    manifest = PackageManifest.load(loaded.package_dir)
    try:
        config = resolve_speculation(
            cli_speculation_args(args),
            toml,
            model_id,
            manifest.generation,
            no_draft=bool(getattr(args, "no_draft", False)),
        )
    except MeshError as error:
        logger.warning("speculation is off: %s", error.message)
        return None
    for note in config.notes:
        logger.warning("speculation: %s", note)
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
    node: StageNode, args: argparse.Namespace, advertise: str = "127.0.0.1"
) -> FrontendHost:
    """Serve the OpenAI API on ``--http-host``; its announced URL uses ``advertise``
    when that host is a wildcard (so a client on another host can use it)."""
    limits = EngineLimits(
        max_sessions=args.max_sessions,
        max_queued=args.max_queued,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )
    scheduler = PipelineScheduler(node, model_id="", limits=limits)
    switch = SwitchableApp()
    api_key = _read_api_key(args)

    def on_load(loaded: LoadedStage | None) -> None:
        if loaded is None:
            switch.reason = "a stage of the pipeline was lost; the mesh is reloading"
            return
        if switch.current is not None and switch.package_dir == str(loaded.package_dir):
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(loaded.package_dir)
        scheduler.speculation = _speculation(args, scheduler.model_id, loaded, tokenizer)
        scheduler.detokenize = tokenizer.decode
        manifest = PackageManifest.load(loaded.package_dir)
        switch.current = create_app(
            scheduler,
            tokenizer,
            model_id=scheduler.model_id,
            api_key=api_key,
            fingerprint=system_fingerprint(manifest),
        )
        switch.package_dir = str(loaded.package_dir)
        logger.info("frontend serving %s", scheduler.model_id)

    node.on_load_change(on_load)
    server, thread, port = serve_app(switch, args.http_host, args.http_port, log_level="warning")
    host = advertise if is_wildcard(args.http_host) else args.http_host
    url = f"http://{url_host(host)}:{port}"
    logger.info("OpenAI frontend on %s (ready once the pipeline is loaded)", url)
    return FrontendHost(url=url, scheduler=scheduler, switch=switch, server=server, thread=thread)
