"""A redis URL of any shape never shows a part of its password: ``kvsdk config
check`` refuses one that does not parse into ``scheme://[user:password@]host[:port]``
in one sentence, and the options' errors and ``repr`` hold no fragment of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvsdk.backends.redis import RedisOptions
from kvsdk.cli import main

SECRET = "QvZkXjWmHg"
"""Letters no message of kvsdk's has three of in a row."""


def fragments(password: str) -> set[str]:
    """Every three characters in a row of ``password``."""
    return {password[i : i + 3] for i in range(len(password) - 2)}


MALFORMED = {
    "no-colon-slashes": f"redis//user:{SECRET}@host:6379",
    "colon-only": f"redis:user:{SECRET}@host",
    "one-slash": f"rediss:/user:{SECRET}@host:6379",
    "hash-in-password": f"redis://user:{SECRET[:4]}#{SECRET[4:]}@host:6379",
    "slash-in-password": f"redis://user:{SECRET[:4]}/{SECRET[4:]}@host:6379/0",
    "question-mark-in-password": f"redis://user:{SECRET[:4]}?{SECRET[4:]}@host:6379",
    "no-at-sign": f"redis://user:{SECRET}",
    "password-in-the-query": f"redis://host:6379/0?password={SECRET}",
    "no-scheme": f"user:{SECRET}@host:6379",
    "other-scheme-no-host": f"http://user:{SECRET}",
    "spaces": f"redis://user:{SECRET} @host:6379",
}


def check(tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = tmp_path / "kvsdk.yaml"
    path.write_text(
        yaml.safe_dump(
            {"tiers": [{"backend": "cpu", "capacity": "1GiB"}, {"backend": "redis", "url": url}]}
        )
    )
    rc = main(["config", "check", str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("shape", list(MALFORMED))
def test_config_check_of_a_malformed_url_is_one_sentence_without_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    rc, out, err = check(tmp_path, MALFORMED[shape], capsys)
    assert rc == 2
    assert out == "" and err.count("\n") == 1 and "tiers[1]" in err and "url" in err, err
    assert not [f for f in fragments(SECRET) if f in err], err


@pytest.mark.parametrize("shape", list(MALFORMED))
def test_options_refuse_a_malformed_url_without_the_password(shape: str) -> None:
    with pytest.raises(ValueError) as info:
        RedisOptions(url=MALFORMED[shape])
    assert not [f for f in fragments(SECRET) if f in str(info.value)], str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@host:6379/0",
        f"rediss://:{SECRET}@host",
        f"redis://user:{SECRET[:4]}%23{SECRET[4:]}@host:6379",
        f"redis://user:{SECRET[:4]}@{SECRET[4:]}@host:6379",
        f"redis://user:{SECRET}@[::1]:6379/2",
        "redis://host",
        "REDIS://host:6379",
        "redis://host:6379/0?socket_keepalive=true",
    ],
)
def test_a_well_formed_url_passes_and_its_repr_masks_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    rc, out, err = check(tmp_path, url, capsys)
    assert rc == 0 and "OK" in out, err
    shown = repr(RedisOptions(url=url))
    assert not [f for f in fragments(SECRET) if f in shown], shown
