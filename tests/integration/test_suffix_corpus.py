"""The suffix drafter's shared corpus through a real 2-stage mesh: a request drafts
from an earlier request of the same tenant (``user``), never from another tenant's,
its text is the text of plain decoding, and /metrics counts the corpus."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = "seven lanterns drift over the quiet harbour while gulls argue"


def test_a_tenant_drafts_from_its_own_earlier_requests_only(tmp_path, tiny_package_factory):
    package = tiny_package_factory("llama", layers=4)
    mesh = MeshProcesses(
        package,
        tmp_path / "mesh",
        2,
        stage0_args=("--spec-type", "suffix", "--no-spec-auto", "--window-policy", "adaptive"),
    )
    try:
        mesh.start().wait_serving()
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)

        def complete(user: str, **extra) -> tuple[str, int]:
            reply = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, user=user, **extra
            )
            timings = reply.model_extra.get("timings", {})
            return reply.choices[0].text, int(timings.get("accepted", 0))

        reference, _ = complete("carol", extra_body={"speculation": False})
        first, _ = complete("alice")
        again, alice_accepted = complete("alice")
        other, bob_accepted = complete("bob")
        assert first == again == other == reference
        # Alice's second request finds her first one's whole continuation in the
        # corpus; Bob's scope holds nothing (Carol's request did not speculate).
        assert alice_accepted > bob_accepted, (alice_accepted, bob_accepted)
        metrics = httpx.get(mesh.http_url + "/metrics", timeout=30).text
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        }
        assert values["mesh_speculation_corpus_documents"] >= 3
        assert values["mesh_speculation_corpus_hits_total"] >= 1
    finally:
        mesh.close()
