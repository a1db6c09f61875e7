"""The deployment secret: who may write KV that loads, and who can find it.

kvsdk's frame checksums catch accidents; they do not stop a person who can
write to a shared tier (the disk directory, the Redis database). An optional
deployment secret does (see ``docs/security.md`` for the whole trust model):

- it comes from the ``KVSDK_SECRET`` environment variable or from the file
  the ``secret_file:`` config key names (owned by this user, mode 0600 or
  stricter); setting both is an error, not a precedence rule;
- :class:`DeploymentSecret` derives independent 32-byte keys from it with
  keyed BLAKE2b, one per purpose: the namespace's public name (directory,
  Redis prefix, frame header), the namespace's key-derivation key (chunk keys)
  and the namespace's frame MAC key. Without the secret nobody can compute a
  chunk key, name a namespace, or make a frame that verifies;
- the secret never appears in ``repr``, logs or error text; :func:`redact`
  scrubs it (and URL passwords) from text meant for output.

Without a secret, :func:`note_trust` logs once per process that the shared
tiers trust every writer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from collections.abc import Iterable, Mapping

from kvsdk.config import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "KVSDK_SECRET"
MIN_SECRET_BYTES = 16
MIN_DISTINCT_BYTES = 6
"""A secret of fewer distinct bytes (``aaaa...``, ``abab...``) is refused: whatever
its length, it is guessable. A random hex secret of 16 characters has fewer
in about 1 of 70,000 draws; a longer one practically never."""
MAX_SECRET_FILE_BYTES = 4096
_warned_no_secret = False


class DeploymentSecret:
    """The secret's key material (never shown). :meth:`derive` gives one key per purpose."""

    __slots__ = ("_master",)

    def __init__(self, material: bytes) -> None:
        if len(material) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"deployment secret: {len(material)} bytes; expected at least "
                f"{MIN_SECRET_BYTES} (e.g. the output of `openssl rand -hex 32`)"
            )
        if len(set(material)) < MIN_DISTINCT_BYTES:
            raise ConfigError(
                f"deployment secret: {len(set(material))} distinct bytes in {len(material)}; "
                f"expected at least {MIN_DISTINCT_BYTES} (a random secret, e.g. the output of "
                "`openssl rand -hex 32`)"
            )
        self._master = hashlib.blake2b(material, digest_size=64, person=b"kvsdk-secret").digest()

    def derive(self, purpose: bytes, data: bytes = b"") -> bytes:
        """A 32-byte key for ``purpose`` (at most 16 bytes) and ``data``: keyed
        BLAKE2b, so knowing one derived key tells nothing about another."""
        return hashlib.blake2b(data, digest_size=32, key=self._master, person=purpose).digest()

    def __repr__(self) -> str:
        return "DeploymentSecret(***)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeploymentSecret) and other._master == self._master

    def __hash__(self) -> int:
        return hash(self._master)


def load_secret(
    secret_file: str | None, environ: Mapping[str, str] | None = None
) -> DeploymentSecret | None:
    """The deployment secret from ``KVSDK_SECRET`` or ``secret_file`` (None: not set).

    Refuses (:class:`ConfigError`, one sentence, never the secret) both at once,
    a secret shorter than :data:`MIN_SECRET_BYTES`, and a file that is not a
    regular file owned by this user and unreadable by group and others."""
    env = os.environ if environ is None else environ
    from_env = env.get(ENV_VAR)
    if from_env is not None and secret_file:
        raise ConfigError(
            f"secret_file: got {secret_file!r} while {ENV_VAR} is also set; expected the "
            "deployment secret from one of them"
        )
    if from_env is not None:
        try:
            return DeploymentSecret(from_env.strip().encode())
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("deployment secret:", f"{ENV_VAR}:", 1)) from None
    if not secret_file:
        return None
    return DeploymentSecret(_read_secret_file(secret_file))


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"secret_file: cannot open {path!r} ({exc.strerror}); expected a regular file "
            "(not a symlink) readable by this user"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"secret_file: {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"secret_file: {path!r} is owned by uid {st.st_uid}; expected this user "
                f"(uid {os.geteuid()})"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"secret_file: {path!r} has mode {stat.S_IMODE(st.st_mode):04o}; expected "
                "no access for group and others (chmod 600)"
            )
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                f"secret_file: {path!r} is {st.st_size} bytes; expected at most "
                f"{MAX_SECRET_FILE_BYTES}"
            )
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    material = data.strip()
    if len(material) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"secret_file: {path!r} holds {len(material)} bytes; expected at least "
            f"{MIN_SECRET_BYTES} (e.g. the output of `openssl rand -hex 32`)"
        )
    return material


def note_trust(secret: DeploymentSecret | None, shared_tiers: Iterable[str]) -> None:
    """Log once per process that ``shared_tiers`` (names) trust their writers
    when there is no deployment secret."""
    global _warned_no_secret
    names = sorted(set(shared_tiers))
    if secret is not None or not names or _warned_no_secret:
        return
    _warned_no_secret = True
    log.warning(
        "kvsdk: no deployment secret (%s or secret_file): the shared tiers (%s) load KV "
        "that anyone able to write to them planted, and anyone able to read them can "
        "read and find it; see docs/security.md",
        ENV_VAR,
        ", ".join(names),
    )


# credentials may hold '/', '@' and ':': they run to the last '@' before whitespace
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<cred>\S*)@")


def mask_url(text: str) -> str:
    """``scheme://user:pass@host`` → ``scheme://user:***@host`` in ``text``, for any
    password (one with ``@``, ``:`` or ``/`` included): the credentials end at
    the *last* ``@`` before the host."""

    def mask(m: re.Match[str]) -> str:
        user, sep, _password = m.group("cred").partition(":")
        return f"{m.group('scheme')}{user}{sep}***@" if sep else f"{m.group('scheme')}***@"

    return _URL_CREDENTIALS.sub(mask, text)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with URL credentials masked and each of ``secrets`` (and the
    ``KVSDK_SECRET`` value) replaced by ``***``: for anything printed or logged."""
    out = mask_url(text)
    for secret in (*secrets, os.environ.get(ENV_VAR)):
        if secret:
            out = out.replace(secret, "***")
            stripped = secret.strip()
            if stripped:
                out = out.replace(stripped, "***")
    return out
