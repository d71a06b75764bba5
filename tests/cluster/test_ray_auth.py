"""The Ray auth token: made for a Ray head pdserve starts, owner-only; never made for a cluster it joins."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cluster.ray_auth import RayAuthError, ensure_ray_token, token_path


@pytest.fixture
def no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path / ".ray" / "auth_token"


def test_a_head_pdserve_starts_gets_a_random_owner_only_token(no_token: Path) -> None:
    assert token_path() == no_token
    assert ensure_ray_token(create=True) == no_token
    token = no_token.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
    assert stat.S_IMODE(no_token.stat().st_mode) == 0o600
    assert stat.S_IMODE(no_token.parent.stat().st_mode) == 0o700


def test_an_existing_token_is_kept(no_token: Path) -> None:
    no_token.parent.mkdir()
    no_token.write_text("the-operators-token")
    assert ensure_ray_token(create=True) is None
    assert no_token.read_text() == "the-operators-token"


def test_an_empty_token_file_is_replaced_and_made_private(no_token: Path) -> None:
    no_token.parent.mkdir()
    no_token.write_text("")
    no_token.chmod(0o644)
    assert ensure_ray_token(create=True) == no_token
    assert len(no_token.read_text()) == 64 and stat.S_IMODE(no_token.stat().st_mode) == 0o600


def test_a_token_in_the_environment_is_used_as_it_is(no_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-environment")
    assert ensure_ray_token(create=False) is None
    assert not no_token.exists()


def test_the_token_path_variable_names_where_to_make_it(
    no_token: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "secrets" / "ray-token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(elsewhere))
    assert ensure_ray_token(create=True) == elsewhere
    assert not no_token.exists()


def test_joining_without_a_token_is_refused_with_what_to_do(no_token: Path) -> None:
    with pytest.raises(RayAuthError) as info:
        ensure_ray_token(create=False)
    message = str(info.value)
    assert "\n" not in message
    assert str(no_token) in message and "RAY_AUTH_TOKEN" in message and "ray get-auth-token" in message
    assert not no_token.exists()
