"""The step probe a stage runs after loading: per-layer and head time on its device."""

from __future__ import annotations

import torch

from mesh.runtime import load_stage_runtime
from mesh.runtime.probe import probe_step
from mesh.types import LayerRange


def test_probe_times_layers_everywhere_and_the_head_on_the_last_stage(tiny_package_factory):
    package = tiny_package_factory("llama", layers=4)
    first = load_stage_runtime(package, LayerRange(0, 1))
    last = load_stage_runtime(package, LayerRange(1, 4), max_sessions=2)
    head = probe_step(first)
    tail = probe_step(last)
    assert head.layer_ms > 0 and head.head_ms == 0.0 and head.rows == 4
    assert tail.layer_ms > 0 and tail.head_ms > 0
    # No more rows than the stage keeps sessions for; its sessions are gone afterwards.
    assert tail.rows == 2 and tail.steps >= 1
    assert first.sessions() == [] and last.sessions() == []
    assert last.kv_bytes() == 0
    # The head the probe times is the one the stage serves with.
    logits = last.head_logits(torch.zeros(3, last.hidden_size))
    assert logits.shape == (3, last.vocab_size) and logits.dtype == torch.float32
