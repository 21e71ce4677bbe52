"""Speculation config: precedence, package strategies, --no-draft, validation."""

from __future__ import annotations

import argparse
import itertools

import pytest

from mesh.config import (
    DraftRef,
    SpeculationConfig,
    WindowPolicySpec,
    add_speculation_arguments,
    check_toml,
    cli_speculation_args,
    load_toml,
    parse_draft_ref,
    parse_package_speculation,
    resolve_speculation,
)
from mesh.errors import InvalidRequest, PackageError

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = {
    "speculative_decoding": {
        "default": "with-draft",
        "strategies": {
            "smol-ngram": {
                "type": "ngram",
                "ngram_min": 3,
                "ngram_max": 5,
                "window_policy": {"default": "adaptive", "initial_window": 4, "max_window": 12},
            },
            "with-draft": {
                "type": "draft-model",
                "draft_model": "org/Draft-Repo:Q4_K_M",
                "window_policy": {
                    "default": "adaptive",
                    "initial_window": 16,
                    "min_window": 2,
                    "max_window": 16,
                },
            },
        },
    }
}


def toml_with(defaults: dict | None = None, model: dict | None = None) -> dict:
    body: dict = {}
    if defaults is not None:
        body["defaults"] = {"speculative": defaults}
    if model is not None:
        body["models"] = {MODEL: {"speculative": model}, "other/model": {"speculative": {}}}
    return body


def test_builtin_default() -> None:
    config = resolve_speculation({}, {}, MODEL, None)
    assert config == SpeculationConfig()
    assert config.type == "suffix" and config.auto and config.window_policy.default == "cost"
    assert config.origin("type") == "built-in default"
    assert "speculation type=suffix" in config.describe()


LEVELS = ("cli", "model", "defaults", "package")


@pytest.mark.parametrize("present", list(itertools.product([False, True], repeat=4)))
def test_precedence_table(present: tuple[bool, ...]) -> None:
    """Every combination of sources setting max_window (and ngram_max): the highest
    one present wins; with none present, the built-in default."""
    given = dict(zip(LEVELS, present, strict=True))
    value = {"cli": 9, "model": 8, "defaults": 7, "package": 6}
    layer = {
        lvl: {"window_policy": {"max_window": value[lvl]}, "ngram_max": value[lvl]}
        for lvl in LEVELS
    }
    cli = {"max_window": 9, "ngram_max": 9} if given["cli"] else {}
    toml = toml_with(
        layer["defaults"] if given["defaults"] else None,
        layer["model"] if given["model"] else None,
    )
    package = {"speculative_decoding": {"strategies": {"only": layer["package"]}}}
    config = resolve_speculation(cli, toml, MODEL, package if given["package"] else None)
    winner = next((lvl for lvl in LEVELS if given[lvl]), None)
    expected = value[winner] if winner else 16
    assert config.window_policy.max_window == expected
    assert config.ngram_max == (value[winner] if winner else 6)
    origin = config.origin("window_policy.max_window")
    labels = {
        "cli": "CLI",
        "model": f'[models."{MODEL}".speculative]',
        "defaults": "[defaults.speculative]",
        "package": "package strategy 'only'",
        None: "built-in default",
    }
    assert origin == labels[winner]


def test_keys_merge_independently() -> None:
    toml = toml_with(defaults={"ngram_min": 3, "window_policy": "fixed"})
    config = resolve_speculation({"initial_window": 6, "max_window": 6}, toml, MODEL, PACKAGE)
    assert config.type == "draft-model"
    assert config.draft_model == DraftRef("org/Draft-Repo", "Q4_K_M", False)
    assert config.ngram_min == 3
    assert config.window_policy == WindowPolicySpec("fixed", 6, 2, 6)
    assert config.strategy == "with-draft"
    assert config.origin("window_policy.min_window") == "package strategy 'with-draft'"


def test_strategy_selection_by_name() -> None:
    config = resolve_speculation({}, toml_with(model={"strategy": "smol-ngram"}), MODEL, PACKAGE)
    assert (config.strategy, config.type, config.ngram_min) == ("smol-ngram", "ngram", 3)
    config = resolve_speculation({"spec_strategy": "with-draft"}, toml_with(), MODEL, PACKAGE)
    assert config.type == "draft-model"
    with pytest.raises(InvalidRequest, match="declares: smol-ngram, with-draft"):
        resolve_speculation({"spec_strategy": "nope"}, {}, MODEL, PACKAGE)
    with pytest.raises(InvalidRequest, match="declares: none"):
        resolve_speculation({"spec_strategy": "nope"}, {}, MODEL, None)


def test_other_models_do_not_apply_but_are_validated() -> None:
    toml = {"models": {"other/model": {"speculative": {"type": "none"}}}}
    assert resolve_speculation({}, toml, MODEL, None).enabled
    bad = {"models": {"other/model": {"speculative": {"max_windw": 3}}}}
    with pytest.raises(InvalidRequest, match=r'models."other/model".speculative.*max_windw'):
        resolve_speculation({}, bad, MODEL, None)


def test_no_draft_uses_package_ngram_strategy() -> None:
    config = resolve_speculation({}, {}, MODEL, PACKAGE, no_draft=True)
    assert (config.type, config.strategy, config.draft_model) == ("ngram", "smol-ngram", None)
    assert config.window_policy.max_window == 12
    assert any("--no-draft" in note for note in config.notes)


def test_no_draft_without_package_ngram_falls_back_to_builtin() -> None:
    package = {
        "speculative_decoding": {
            "strategies": {"d": PACKAGE["speculative_decoding"]["strategies"]["with-draft"]}
        }
    }
    config = resolve_speculation({}, {}, MODEL, package, no_draft=True)
    assert config.type == "suffix" and config.strategy is None
    assert config.window_policy == WindowPolicySpec()


def test_no_draft_overrides_toml_drafts_and_conflicts_with_cli_drafts() -> None:
    toml = toml_with(defaults={"type": "composite", "draft_model": "./draft"})
    config = resolve_speculation({}, toml, MODEL, None, no_draft=True)
    assert config.type == "ngram" and config.draft_model is None
    assert resolve_speculation({}, toml, MODEL, None).draft_model == DraftRef("./draft", None, True)
    with pytest.raises(InvalidRequest, match="--no-draft conflicts"):
        resolve_speculation({"draft_model": "org/d"}, {}, MODEL, None, no_draft=True)


def test_cli_none_disables_everything() -> None:
    config = resolve_speculation(
        {"spec_type": "none"}, toml_with(defaults={"type": "ngram"}), MODEL, PACKAGE
    )
    assert not config.enabled and config.draft_model is None
    assert "speculation off" in config.describe()


def test_type_ngram_drops_an_inherited_draft_model() -> None:
    config = resolve_speculation({"spec_type": "ngram"}, {}, MODEL, PACKAGE)
    assert config.type == "ngram" and config.draft_model is None


@pytest.mark.parametrize(
    ("cli", "toml", "message"),
    [
        (
            {},
            toml_with(defaults={"ngram_mx": 3}),
            r"\[defaults.speculative\]: unknown key 'ngram_mx'",
        ),
        ({}, toml_with(defaults={"window_policy": {"max": 3}}), "unknown key window_policy.max"),
        (
            {},
            toml_with(defaults={"window_policy": "greedy"}),
            "window_policy.default must be one of",
        ),
        ({}, toml_with(model={"type": "eagle"}), "type must be one of"),
        ({}, toml_with(defaults={"ngram_min": True}), "ngram_min must be an integer"),
        ({}, toml_with(defaults={"p_min": 1.5}), r"p_min must be a number in \[0, 1\)"),
        ({}, toml_with(defaults={"auto": "yes"}), "auto must be true or false"),
        ({"max_window": 100}, {}, r"CLI --max-window: window_policy.max_window must be an integer"),
        ({"max_window": 0}, {}, r"max_window must be an integer in \[1, 64\], got 0"),
        ({"ngram_min": 5}, {}, "ngram_min=5 from CLI exceeds ngram_max=4 from package"),
        ({"max_window": 2, "initial_window": 3}, {}, "min_window <= initial_window <= max_window"),
        ({"min_window": 0, "initial_window": 0}, {}, "min_window=0 from CLI must be >= 1"),
        ({"spec_type": "draft-model"}, {}, "needs draft_model"),
        ({"draft_model": "not a repo"}, {}, "draft_model 'not a repo' is neither"),
        ({"window_size": 3}, {}, "unknown speculation flag 'window_size'"),
    ],
)
def test_validation_errors_name_the_key(cli, toml, message) -> None:
    package = {"speculative_decoding": {"strategies": {"s": {"ngram_max": 4}}}}
    with pytest.raises(InvalidRequest, match=message):
        resolve_speculation(cli, toml, MODEL, package)


@pytest.mark.parametrize(
    "block",
    [
        {"strategies": []},
        {"strategies": {"a": {"type": "ngram"}}, "default": "b"},
        {"strategies": {"a": {"window": 3}}},
        {"strategies": {"a": {}}, "extra": 1},
    ],
)
def test_malformed_package_blocks(block) -> None:
    with pytest.raises(PackageError):
        parse_package_speculation({"speculative_decoding": block})


def test_package_block_parsing() -> None:
    default, strategies = parse_package_speculation(PACKAGE)
    assert default == "with-draft"
    assert strategies["smol-ngram"]["window_policy.default"] == "adaptive"
    assert parse_package_speculation(None) == (None, {})
    assert parse_package_speculation({"other": 1}) == (None, {})
    lone = {"speculative_decoding": {"strategies": {"x": {"type": "ngram"}}}}
    assert parse_package_speculation(lone)[0] == "x"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("org/Repo", DraftRef("org/Repo", None, False)),
        ("org/Repo-1.5B:Q4_K_M", DraftRef("org/Repo-1.5B", "Q4_K_M", False)),
        ("gpt2", DraftRef("gpt2", None, False)),
        ("/models/draft", DraftRef("/models/draft", None, True)),
        ("./draft.gguf", DraftRef("./draft.gguf", None, True)),
        ("~/draft", DraftRef("~/draft", None, True)),
    ],
)
def test_parse_draft_ref(text, expected) -> None:
    ref = parse_draft_ref(text)
    assert ref == expected
    assert str(ref) == text


@pytest.mark.parametrize("text", ["", "org/repo:", "a/b/c", "org/re po", ":Q4", "org/repo:Q4:x"])
def test_bad_draft_refs(text) -> None:
    with pytest.raises(InvalidRequest, match="draft_model"):
        parse_draft_ref(text)


def test_toml_file_round_trip(tmp_path) -> None:
    path = tmp_path / "mesh.toml"
    path.write_text(
        '[defaults.speculative]\nngram_max = 8\nwindow_policy = { default = "adaptive" }\n\n'
        f'[models."{MODEL}".speculative]\ntype = "composite"\ndraft_model = "./draft"\n'
        '[models."' + MODEL + '".speculative.window_policy]\nmax_window = 10\n'
    )
    config = resolve_speculation({}, load_toml(path), MODEL, None)
    assert (config.type, config.ngram_max, config.window_policy.default) == (
        "composite",
        8,
        "adaptive",
    )
    assert config.window_policy.max_window == 10
    with pytest.raises(InvalidRequest, match="not found"):
        load_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[defaults\n")
    with pytest.raises(InvalidRequest, match="not valid TOML"):
        load_toml(tmp_path / "bad.toml")


def test_argparse_flags_map_to_cli_keys() -> None:
    parser = argparse.ArgumentParser()
    add_speculation_arguments(parser)
    args = parser.parse_args(
        ["--spec-type", "composite", "--draft-model", "org/d:Q8_0", "--max-window", "8",
         "--no-spec-auto", "--window-policy", "adaptive", "--no-draft"]
    )  # fmt: skip
    cli = cli_speculation_args(args)
    assert cli == {
        "spec_type": "composite",
        "draft_model": "org/d:Q8_0",
        "max_window": 8,
        "spec_auto": False,
        "window_policy": "adaptive",
    }
    assert args.no_draft
    config = resolve_speculation(cli, {}, MODEL, None)
    assert (config.type, config.auto, config.window_policy.max_window) == ("composite", False, 8)
    assert cli_speculation_args(parser.parse_args([])) == {}


def test_window_flags_clamp_the_windows_of_lower_sources() -> None:
    """``--max-window 8`` under a package strategy whose windows are 2..16 (initial
    16): the package's initial window comes down to 8, with a note; a flag below the
    package's minimum takes the minimum down with it."""
    strategy = {"strategy": "with-draft"}
    config = resolve_speculation({"max_window": 8}, toml_with(defaults=strategy), MODEL, PACKAGE)
    assert config.window_policy.max_window == 8
    assert config.window_policy.initial_window == 8 and config.window_policy.min_window == 2
    assert any("initial_window=16" in note and "clamped to 8" in note for note in config.notes)
    config = resolve_speculation({"max_window": 1}, toml_with(defaults=strategy), MODEL, PACKAGE)
    assert (config.window_policy.min_window, config.window_policy.initial_window) == (1, 1)
    # The built-in windows (1..16, initial 4) give way to a TOML or CLI minimum too.
    config = resolve_speculation({"min_window": 6}, {}, MODEL, None)
    assert config.window_policy.initial_window == 6 and config.window_policy.max_window == 16


@pytest.mark.parametrize(
    "block",
    [
        {"strategies": []},
        {"strategies": {"a": {"window": 3}}},
        {"strategies": {"a": {}}, "newer_key": 1},
    ],
)
def test_an_unusable_package_block_is_left_out_with_a_note(block) -> None:
    config = resolve_speculation({}, {}, MODEL, {"speculative_decoding": block})
    assert config.type == "suffix" and config.strategy is None
    assert config.window_policy == WindowPolicySpec()
    assert any("package's speculation block is left out" in note for note in config.notes)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ({"server": {"http_port": 8000}}, r"unknown table\(s\) or key\(s\) server"),
        ({"models": {"speculative": {"type": "ngram"}}}, r"\[models.speculative\] names a model"),
        (
            {"defaults": {"speculation": {"type": "ngram"}}},
            r"unknown key\(s\) speculation in \[defaults\]",
        ),
        ({"models": {"m": {"window": 3}}}, r'unknown key\(s\) window in \[models."m"\]'),
        ({"defaults": {"speculative": {"type": "eagle"}}}, "type must be one of"),
    ],
)
def test_a_config_table_that_is_not_known_is_refused(toml, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_toml(toml)
    check_toml(toml_with(defaults={"type": "ngram"}, model={"window_policy": {"max_window": 8}}))
