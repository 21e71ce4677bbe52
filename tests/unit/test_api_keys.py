"""API keys and their tenants (mesh/api_keys.py): the key file's lines, constant-time
lookup of every key, and a file read again when it changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh import api_keys
from mesh.api_keys import KeySource, bare_tenant, parse_keys, presented_keys, request_tenant
from mesh.errors import InvalidRequest


def test_a_key_file_names_tenants_and_bare_keys_get_a_stable_name() -> None:
    keys = parse_keys("# the team\nalice  k-alice-123\n\nbob k-bob-456\nk-bare-789\n")
    assert keys.tenants == ("alice", "bob", bare_tenant(b"k-bare-789"))
    assert bare_tenant(b"k-bare-789").startswith("key-") and len(bare_tenant(b"x")) == 12
    assert bare_tenant(b"k-bare-789") == bare_tenant(b"k-bare-789") != bare_tenant(b"k-other")
    assert keys.tenant_of(b"k-bob-456") == "bob"
    assert keys.tenant_of(b"k-bare-789") == bare_tenant(b"k-bare-789")
    assert keys.tenant_of(b"k-bob-45") is None and keys.tenant_of(b"") is None
    assert keys.tenant_of(b"alice") is None  # a name is not a key
    assert not keys.single_bare_key
    assert parse_keys("  only-one-key  \n").single_bare_key
    assert not parse_keys("carol only-one-key").single_bare_key


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "holds no key"),
        ("# nothing\n\n", "holds no key"),
        ("a b c", "line 1: expected 'KEY' or 'NAME KEY'"),
        ("k1-aaaa\nk1-aaaa", "line 2: this key is already"),
        ("al key-one\nal key-two", "line 2: tenant 'al' is named twice"),
        ("-bad key-one", "tenant name '-bad'"),
        ("x" * 65 + " key-one", "1-64 letters"),
    ],
)
def test_bad_key_files_are_refused_with_the_line(text: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_keys(text, "keys.txt")


def test_a_tenant_may_carry_a_limit() -> None:
    keys = parse_keys("alice k-alice-1 max_concurrent=2\nk-bare-2 max_concurrent=1\nbob k-bob-3\n")
    assert keys.tenants == ("alice", bare_tenant(b"k-bare-2"), "bob")
    assert keys.limit_of("alice") == 2 and keys.limit_of(bare_tenant(b"k-bare-2")) == 1
    assert keys.limit_of("bob") is None
    for bad in ("alice k max_concurrent=0", "alice k max_concurrent=x", "alice k limit=2"):
        with pytest.raises(InvalidRequest, match="max_concurrent|expected"):
            parse_keys(bad)


def test_a_tenant_may_carry_rates_in_any_order() -> None:
    keys = parse_keys("alice k-a tpm=5000 rpm=60 max_concurrent=2\nbob k-b rpm=1\ncarol k-c\n")
    alice = keys.limits_of("alice")
    assert (alice.max_concurrent, alice.rpm, alice.tpm) == (2, 60, 5000)
    assert (keys.limits_of("bob").rpm, keys.limits_of("bob").tpm) == (1, None)
    assert keys.limits_of("carol") == keys.limits_of("nobody") == api_keys.NO_LIMITS
    for bad, words in [
        ("alice k rpm=1 rpm=2", "rpm is given twice"),
        ("alice k tpm=0", "tpm=0 must be a whole number"),
        ("alice k rpm=-1", "rpm=-1 must be"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            parse_keys(bad)


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_keys, "RECHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("alice key-alice-1\n")
    source = KeySource(path=path)
    assert source.tenant_of(b"key-alice-1") == "alice"
    # Rotation: alice's key changes and bob is added, without a restart.
    path.write_text("alice key-alice-2\nbob key-bob-1\n")
    os.utime(path, ns=(1, 10**18))
    assert source.tenant_of(b"key-alice-1") is None
    assert source.tenant_of(b"key-alice-2") == "alice"
    assert source.tenant_of(b"key-bob-1") == "bob"
    # A broken edit leaves the keys in force; removing the file too.
    path.write_text("alice key-alice-3 junk\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert source.tenant_of(b"key-bob-1") == "bob"
    path.unlink()
    assert source.tenant_of(b"key-alice-2") == "alice"


def test_configured_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MESH_API_KEY", raising=False)
    assert KeySource.configured(None) is None
    monkeypatch.setenv("MESH_API_KEY", " env-key ")
    source = KeySource.configured(None)
    assert source is not None and source.tenant_of(b"env-key") == bare_tenant(b"env-key")
    path = tmp_path / "keys"
    path.write_text("team file-key\n")
    source = KeySource.configured(path)
    assert source is not None and source.tenant_of(b"file-key") == "team"
    assert source.tenant_of(b"env-key") is None  # the file wins over the variable
    path.write_text("a b c\n")
    with pytest.raises(InvalidRequest, match="expected"):
        KeySource.configured(path)


def test_the_keys_a_request_presents() -> None:
    assert presented_keys({"authorization": "Bearer abc "}) == (b"abc",)
    assert presented_keys({"authorization": "bearer abc"}) == (b"abc",)
    assert presented_keys({"authorization": "Basic abc"}) == ()
    assert presented_keys({"authorization": "abc"}) == ()
    assert presented_keys({}) == ()
    both = {"x-api-key": "xyz", "authorization": "Bearer abc"}
    assert presented_keys(both) == (b"xyz", b"abc")
    assert presented_keys({"x-api-key": "abc", "authorization": "Bearer abc"}) == (b"abc",)


def test_a_valid_key_is_taken_whichever_header_carries_it() -> None:
    source = KeySource(fixed=parse_keys("alice good-key-1\nbob other-key-2\n"))
    assert request_tenant(source, {"authorization": "Bearer good-key-1"}) == "alice"
    assert request_tenant(source, {"x-api-key": "good-key-1"}) == "alice"
    # A stale second header does not turn the valid key away, in either order.
    stale = {"authorization": "Bearer good-key-1", "x-api-key": "stale"}
    assert request_tenant(source, stale) == "alice"
    assert request_tenant(source, {"authorization": "Bearer stale", "x-api-key": "good-key-1"})
    # Two tenants' keys at once: refused, as no key at all.
    assert (
        request_tenant(source, {"authorization": "Bearer other-key-2", "x-api-key": "good-key-1"})
        is None
    )
    assert request_tenant(source, {"authorization": "Bearer nope"}) is None
    assert request_tenant(source, {}) is None
