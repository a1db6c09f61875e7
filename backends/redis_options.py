"""The redis tier's options and how they become connections: the URL to dial,
the keyword arguments every connection gets (timeouts, AUTH, TLS), and the
password kept out of any text."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kvsdk import trust

mask_url = trust.mask_url
"""``redis://user:secret@host`` → ``redis://user:***@host`` (any password)."""


@dataclass(frozen=True, repr=False)
class RedisOptions:
    url: str = "redis://127.0.0.1:6379/0"
    """``redis://`` or ``rediss://`` (TLS); in Cluster mode, any one node."""
    cluster: bool = False
    """Redis Cluster: keys spread over the nodes by slot."""
    urls: tuple[str, ...] = ()
    """Cluster mode: more seed nodes (``redis://host:port``, no credentials), so
    the tier starts while ``url``'s node is down."""
    sentinels: tuple[str, ...] = ()
    """Redis Sentinel (``redis://host:port`` each): the tier asks them for the
    master of ``sentinel_master`` and follows it across failovers (``url`` then
    names only the database)."""
    sentinel_master: str | None = None
    """The service name the sentinels monitor (with ``sentinels``)."""
    ttl_seconds: int | None = None
    """Expire entries this long after they are stored (None: never; rely on maxmemory)."""
    ttl_refresh_on_hit: bool = False
    """Each hit restarts its entry's ``ttl_seconds`` (an EXPIRE in the read's own round
    trip), so entries in use do not expire."""
    username: str | None = None
    """AUTH (ACL) user; overrides one in the URL."""
    password: str | None = None
    """AUTH password (never logged); overrides one in the URL."""
    password_file: str | None = None
    """Read the AUTH password from this file (e.g. a mounted secret; one trailing
    newline dropped); instead of ``password``."""
    password_env: str | None = None
    """Read the AUTH password from this environment variable; instead of ``password``."""
    tls: bool = False
    """Use TLS even with a ``redis://`` URL."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    """Verify the server certificate and host name."""
    socket_timeout: float = 1.0
    """Seconds a command may wait for the server before it counts as a failure."""
    connect_timeout: float = 1.0
    max_batch: int = 64
    """Keys per pipelined round trip."""
    max_connections: int = 16
    """Connections per server (per node in Cluster mode)."""
    backoff_initial: float = 0.5
    """Seconds the server is skipped after a failure; doubles per failure."""
    backoff_max: float = 30.0
    local_index: bool = True
    """Keep an index of the tier's keys in this process's memory (seeded by a SCAN
    of the namespace, kept current across processes by what each publishes of its
    puts), so a lookup of a chunk stored nowhere misses without asking Redis."""
    local_index_max_entries: int = 1_000_000
    """The most keys the local index holds (about 170 bytes each); beyond it the
    least recently stored or seen are forgotten: their lookups miss (counted
    ``index_dropped``)."""

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            raise ValueError(f"url: {problem}")
        for i, seed in enumerate(self.urls):
            problem = seed_problem(seed, self.url)
            if problem is not None:
                raise ValueError(f"urls[{i}]: {problem}")
        for i, sentinel in enumerate(self.sentinels):
            problem = seed_problem(sentinel, "redis://")
            if problem is not None:
                raise ValueError(f"sentinels[{i}]: {problem}")
        if bool(self.sentinels) != bool(self.sentinel_master):
            raise ValueError(
                "sentinels and sentinel_master: one set without the other; expected both "
                "(the sentinels and the service name they monitor) or neither"
            )
        if self.sentinels and (self.cluster or self.tls or self.url.startswith("rediss://")):
            raise ValueError(
                "sentinels: Sentinel with "
                f"{'cluster: true' if self.cluster else 'TLS'} is not supported; expected a "
                "standalone master reached over redis://"
            )
        if self.urls and not self.cluster:
            raise ValueError("urls: set without cluster: true; expected seed nodes of a Cluster")
        given = [n for n in PASSWORD_SOURCES if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]}: set together with {given[0]}; expected the password from one "
                f"of {', '.join(PASSWORD_SOURCES)}"
            )
        if self.password_file is not None:
            object.__setattr__(self, "password", read_password_file(self.password_file))
        elif self.password_env is not None:
            object.__setattr__(self, "password", read_password_env(self.password_env))
        if self.ttl_refresh_on_hit and self.ttl_seconds is None:
            raise ValueError("ttl_refresh_on_hit: set without ttl_seconds; expected both")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds: got {self.ttl_seconds}; expected a positive integer")
        for name in ("socket_timeout", "connect_timeout", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected a positive number")
        for name in ("max_batch", "max_connections", "local_index_max_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected at least 1")

    def __repr__(self) -> str:
        shown = {k: getattr(self, k) for k in self.__dataclass_fields__}
        shown["url"] = mask_url(self.url)
        if self.password is not None:
            shown["password"] = "***"
        return "RedisOptions(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def seed_problem(seed: str, url: str) -> str | None:
    """Why ``seed`` is no Cluster seed node beside ``url`` (None: it is one)."""
    problem = url_problem(seed)
    if problem is not None:
        return problem
    parts = urlsplit(seed)
    if "@" in parts.netloc:
        return "a seed node carries no credentials; expected redis://host:port (AUTH: password)"
    if not parts.port:
        return "expected redis://host:port with a port"
    if parts.scheme != urlsplit(url).scheme:
        return (
            f"got scheme {parts.scheme}://; expected the scheme of url ({urlsplit(url).scheme}://)"
        )
    return None


PASSWORD_SOURCES = ("password", "password_file", "password_env")
MAX_PASSWORD_FILE_BYTES = 64 << 10


def read_password_file(path: str) -> str:
    """The password in file ``path`` (one trailing newline dropped); a ValueError
    naming the file, never its content, when it cannot be used."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"password_file: {path!r} is not a regular file")
            data = f.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(
            f"password_file: cannot read {path!r} ({exc.strerror}); expected a file "
            "holding the Redis password"
        ) from None
    if len(data) > MAX_PASSWORD_FILE_BYTES:
        raise ValueError(f"password_file: {path!r} is over {MAX_PASSWORD_FILE_BYTES} bytes")
    text = _utf8(data, path).removesuffix("\n").removesuffix("\r")
    if not text:
        raise ValueError(f"password_file: {path!r} is empty; expected the Redis password")
    return text


def _utf8(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"password_file: {path!r} is not UTF-8 text") from None


def read_password_env(name: str) -> str:
    """The password in environment variable ``name``; a ValueError naming the
    variable when it is unset or empty."""
    value = os.environ.get(name)
    if not value:
        raise ValueError(
            f"password_env: the environment variable {name!r} is "
            f"{'empty' if value == '' else 'not set'}; expected it to hold the Redis password"
        )
    return value


_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^:\[\]@/?#]*)(?::(?P<port>[0-9]{1,5}))?")
"""``host[:port]`` (an IPv6 host in brackets) after the user info, if any."""
NOT_SHOWN = "not shown: it may hold a password"


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a ``redis://`` or ``rediss://`` URL the tier takes,
    in words that quote nothing of it but its scheme (a part that does not
    parse may hold a password); None when it is one."""
    scheme, colon, rest = url.partition(":")
    scheme = scheme.lower()
    if not colon or scheme not in ("redis", "rediss"):
        return f"not a redis:// or rediss:// URL ({NOT_SHOWN})"
    if not rest.startswith("//"):
        return (
            f"{scheme}: is not followed by // (the rest {NOT_SHOWN}); expected "
            f"{scheme}://[user:password@]host[:port][/db]"
        )
    if any(c.isspace() or not c.isprintable() for c in rest):
        return (
            f"the part after {scheme}:// holds a space or a control character ({NOT_SHOWN}); "
            "percent-encode it"
        )
    parts = urlsplit(url)
    if "@" in rest[2 + len(parts.netloc) :]:
        return (
            f"the user name or password after {scheme}:// holds a '/', '?' or '#' "
            f"({NOT_SHOWN}); percent-encode them: %2F, %3F, %23"
        )
    host = _HOST_PORT.fullmatch(parts.netloc.rpartition("@")[2])
    if host is None or int(host.group("port") or 0) > 65535:
        return (
            f"what follows {scheme}:// is not [user:password@]host[:port] with a port number "
            f"({NOT_SHOWN})"
        )
    if "password" in parse_qs(parts.query, keep_blank_values=True):
        return (
            "a password in the query string is not taken: put it in the user info "
            f"({scheme}://user:password@host) or in the password option"
        )
    return None


def effective_url(o: RedisOptions) -> str:
    """The URL to connect to: ``rediss://`` when ``tls`` is set on a ``redis://``
    URL, and without the user or password that ``username`` / ``password``
    override (redis-py lets a URL's credentials win over keyword arguments)."""
    url = o.url
    if o.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or (o.username is None and o.password is None):
        return url
    user, colon, password = userinfo.partition(":")
    user = "" if o.username is not None else user
    password = "" if o.password is not None else password
    userinfo = user + (":" + password if colon and password else "")
    netloc = (userinfo + "@" if userinfo else "") + host
    return parts._replace(netloc=netloc).geturl()


def connection_kwargs(o: RedisOptions, url: str) -> dict[str, Any]:
    """Timeouts, AUTH and TLS for every connection the tier (or ``inventory``) opens."""
    kw: dict[str, Any] = {
        "socket_timeout": o.socket_timeout,
        "socket_connect_timeout": o.connect_timeout,
        "max_connections": o.max_connections,
    }
    if o.username is not None:
        kw["username"] = o.username
    if o.password is not None:
        kw["password"] = o.password
    if url.startswith("rediss://"):
        kw["ssl_cert_reqs"] = "required" if o.tls_verify else "none"
        kw["ssl_check_hostname"] = o.tls_verify
        for opt, name in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"),
                          ("tls_key_file", "ssl_keyfile")):  # fmt: skip
            if getattr(o, opt) is not None:
                kw[name] = getattr(o, opt)
    return kw


def redact(o: RedisOptions, text: str) -> str:
    """``text`` without the options' password (option or URL, raw or decoded)."""
    url = urlsplit(o.url)
    return trust.redact(text, (o.password, url.password, unquote(url.password or "")))
