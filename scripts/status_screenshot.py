"""Take the status page's screenshot (docs/status-page.png): the default package on a
local mesh of four stages, requests streaming through it, one stage killed (the mesh
carries on with three, and the page shows the failover), the page in headless
chromium (Debian's; CHROMIUM names another executable).

    .venv/bin/python scripts/status_screenshot.py [--stages 4] [--no-kill] [--out PNG]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from openai import OpenAI

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from coordinator.localmesh import MeshProcesses  # noqa: E402
from mesh.package.default import DEFAULT_MODEL_ID, build_default_package  # noqa: E402

logger = logging.getLogger("status_screenshot")

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a pipeline-parallel model split is, in three sentences.",
)


def keep_streaming(url: str, prompt: str, stop: threading.Event) -> None:
    """Stream chat completions one after another until ``stop`` is set."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    while not stop.is_set():
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            temperature=0.7,
            stream=True,
        )
        for _ in stream:
            if stop.is_set():
                break


def screenshot(url: str, out: Path, executable: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            page.set_default_timeout(120_000)
            page.goto(url + "/status")
            expect(page.locator("#board")).to_be_visible()
            # Wait until every stage has reported step times and tokens are flowing.
            page.wait_for_function(
                "() => [...document.querySelectorAll('#stages tbody tr')].length > 1 && "
                "[...document.querySelectorAll('#stages tbody tr td:nth-child(12)')]"
                ".every(td => td.textContent !== '-') && "
                "document.getElementById('tok-s').textContent !== '0.0 tok/s'"
            )
            # A full window of tokens per second.
            page.wait_for_timeout(11_000)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--no-kill", action="store_true", help="kill no stage")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "status-page.png")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if executable is None:
        sys.stderr.write("no chromium: install Debian's chromium or set CHROMIUM\n")
        return 2
    package = build_default_package()
    with tempfile.TemporaryDirectory(prefix="status-shot-") as workdir:
        mesh = MeshProcesses(package, Path(workdir), args.stages)
        stop = threading.Event()
        workers: list[threading.Thread] = []
        try:
            mesh.start().wait_serving(deadline_s=600)
            logger.info("mesh serving at %s", mesh.http_url)
            for prompt in PROMPTS:
                workers.append(
                    threading.Thread(target=keep_streaming, args=(mesh.http_url, prompt, stop))
                )
                workers[-1].start()
            if not args.no_kill:
                stop.wait(5.0)
                victim = f"stage-{args.stages - 1}"
                logger.info("killing %s", victim)
                mesh.kill_stage(victim)
                mesh.wait_serving(term=2, deadline_s=600)
            screenshot(mesh.http_url, args.out, executable)
            logger.info("wrote %s", args.out)
        finally:
            stop.set()
            for worker in workers:
                worker.join(300)
            mesh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
