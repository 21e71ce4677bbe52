"""Auto gating of the n-gram drafter: prompt detectors, observation, back-off."""

from __future__ import annotations

import pytest

from mesh.speculative import AutoNgramDrafter, NgramDrafter, prompt_signals


@pytest.mark.parametrize(
    ("text", "signal"),
    [
        ("Fix this:\n```python\nx = 1\n```", "code-fence"),
        ("@@ -12,7 +12,8 @@ def main():\n-    old\n+    new", "diff"),
        ("diff --git a/x.py b/x.py\n", "diff"),
        ('Traceback (most recent call last):\n  File "app.py", line 3, in <module>', "stack-trace"),
        ("Exception in thread main\n    at com.example.Foo.bar(Foo.java:12)", "stack-trace"),
        ('Reformat {"name": "mesh", "stages": 3}', "json"),
        ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "tool-call"),
        ("Please update src/mesh/config.py and tests/unit/test_config.py", "file-path"),
        ("def add(a, b):\n    return a + b\n", "code"),
    ],
)
def test_prompt_detectors(text: str, signal: str) -> None:
    assert signal in prompt_signals(text)


@pytest.mark.parametrize(
    "text",
    [
        "What is the capital of France?",
        "Write a short poem about the sea, please. Make it rhyme.",
        "Explain, in two sentences, why the sky is blue: keep it simple.",
    ],
)
def test_plain_chat_prompts_have_no_signals(text: str) -> None:
    assert prompt_signals(text) == []


def auto(**kwargs) -> AutoNgramDrafter:
    return AutoNgramDrafter(NgramDrafter(2, 4), **kwargs)


REPEATING_PROMPT = [1, 2, 3, 4, 5, 6, 1, 2]


def test_cold_by_default_and_warm_on_favourable_prompt_text() -> None:
    drafter = auto()
    drafter.begin(REPEATING_PROMPT, "What is the capital of France?")
    assert drafter.state == "cold"
    assert drafter.propose(4) == []  # no verify overhead while cold
    drafter.begin(REPEATING_PROMPT, "Rename x to y:\n```python\nx = 1\n```")
    assert drafter.state == "warm"
    assert drafter.propose(4) == [3, 4, 5, 6]


def test_observation_turns_warm_after_repeated_shadow_hits() -> None:
    drafter = auto(warm_hits=2, hit_tokens=2)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter.begin(prompt, None)
    # The answer copies two runs of the prompt: (10 11) -> 12 13 and (14 15) -> 16 17.
    generated = [20, 10, 11, 12, 13, 40, 14, 15, 16, 17]
    states = []
    for token in generated:
        if drafter.state == "cold":
            assert drafter.propose(4) == []
        drafter.accept(0, token)
        states.append(drafter.state)
    assert states == ["cold"] * 9 + ["warm"]
    assert drafter.transitions == 1
    assert drafter.propose(2) == [20, 10]
    assert drafter.committed == prompt + generated


def test_no_repeats_stay_cold() -> None:
    drafter = auto()
    drafter.begin(list(range(100, 140)), "Tell me a story.")
    for token in range(200, 300):
        assert drafter.propose(4) == []
        drafter.accept(0, token)
    assert drafter.state == "cold"


def test_backs_off_when_acceptance_is_poor_and_prompt_cannot_rewarm() -> None:
    drafter = auto(min_rounds=4, backoff_rate=0.3)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    drafter.begin(prompt, "```\ncode\n```")
    assert drafter.state == "warm"
    rounds = 0
    while drafter.state == "warm":
        proposal = drafter.propose(4)
        assert proposal, "the prompt always offers a match here"
        drafter.accept(0, 90 + rounds)  # every proposal rejected
        drafter.extend([1, 2])  # keep a match available
        rounds += 1
        assert rounds < 10
    assert rounds == 4
    assert drafter.transitions == 1
    assert drafter.propose(4) == []


def test_good_acceptance_stays_warm() -> None:
    drafter = auto()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    drafter.begin(prompt, "```\ncode\n```")
    for _ in range(20):
        proposal = drafter.propose(3)
        drafter.accept(len(proposal), 99)
        drafter.extend([1, 2])
    assert drafter.state == "warm"
    assert drafter.accept_rate == pytest.approx(1.0)


def test_rollback_is_forwarded() -> None:
    drafter = auto()
    drafter.begin([1, 2, 3, 1, 2], "```x```")
    drafter.accept(0, 3)
    drafter.rollback(5)
    assert drafter.committed == drafter.inner.committed == [1, 2, 3, 1, 2]
    assert drafter.propose(2) == [3, 1]
