"""The compiled decode path: same results as eager, and a clean fall back when
compilation fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mesh.runtime import load_stage_runtime, native, qkernels
from mesh.runtime import stage as stage_module
from mesh.types import LayerRange

PROMPT = torch.tensor([3, 88, 1500, 42, 7, 9000, 12])


FED = [17, 4, 2300, 611, 90, 5]


def decode(runtime, session: str = "s") -> list[torch.Tensor]:
    """Logits of a prefill and one decode step per token of ``FED``."""
    logits = [runtime.forward(session, 0, PROMPT)[-1]]
    for offset, token in enumerate(FED):
        pos = PROMPT.shape[0] + offset
        logits.append(runtime.forward(session, pos, torch.tensor([token]))[-1])
    return logits


@pytest.mark.parametrize("quant", ["int4", None])
def test_compiled_decode_follows_eager(
    tiny_package_factory: Callable[..., Path], quant: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int4 weights on torch's kernels, and dense ones (held packed for oneDNN until
    compiling)."""
    monkeypatch.setattr(qkernels, "MODE", "torch")
    package = tiny_package_factory("qwen2", layers=3, quant=quant)
    eager = load_stage_runtime(package, LayerRange(0, 3))
    compiled = load_stage_runtime(package, LayerRange(0, 3), compile=True)
    want = decode(eager)
    got = decode(compiled)
    assert compiled.compiled, "compilation fell back to eager"
    assert compiled.sessions() == ["s"]
    # A second session (another cache buffer, other lengths) runs through the same code.
    got_again = decode(compiled, session="t")
    scale = max(float(w.abs().max()) for w in want)
    for a, b, c in zip(want, got, got_again, strict=True):
        # The compiler fuses ops, so roundings differ slightly.
        assert float((a - b).abs().max()) <= 0.02 * scale
        assert torch.equal(b, c)


def test_failed_compilation_falls_back_to_eager(
    tiny_package_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_compile(function, **_: object):
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(stage_module.torch, "compile", broken_compile)
    package = tiny_package_factory("llama", layers=2)
    eager = load_stage_runtime(package, LayerRange(0, 2))
    with caplog.at_level(logging.WARNING, logger="mesh.runtime.stage"):
        # Compilation is tried while loading (a warm-up step), and given up there.
        runtime = load_stage_runtime(package, LayerRange(0, 2), compile=True)
    assert not runtime.compiled
    assert "no C++ compiler found" in caplog.text
    assert runtime.sessions() == []  # the warm-up session is gone
    got = decode(runtime)
    for a, b in zip(decode(eager), got, strict=True):
        assert torch.equal(a, b)


def test_a_later_stage_compiles_while_loading(
    tiny_package_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qkernels, "MODE", "torch")
    package = tiny_package_factory("llama", layers=3, quant="int4")
    runtime = load_stage_runtime(package, LayerRange(1, 3), compile=True)
    assert runtime.compiled
    assert runtime.sessions() == []
    hidden = torch.randn(4, 64)
    eager = load_stage_runtime(package, LayerRange(1, 3))
    assert torch.equal(runtime.forward("a", 0, hidden), eager.forward("a", 0, hidden))


@pytest.mark.skipif(native.library() is None, reason="no native quantised kernels here")
def test_compile_leaves_the_native_kernels_eager(
    tiny_package_factory: Callable[..., Path],
) -> None:
    """With the stage's own int4 kernels, --compile is declined (logged) and decode
    steps give exactly the eager runtime's logits."""
    package = tiny_package_factory("qwen2", layers=3, quant="int4")
    eager = load_stage_runtime(package, LayerRange(0, 3))
    compiled = load_stage_runtime(package, LayerRange(0, 3), compile=True)
    assert not compiled.compiled
    for a, b in zip(decode(eager), decode(compiled), strict=True):
        assert torch.equal(a, b)
