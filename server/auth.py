"""API keys, roles and who is calling.

Keys come from `--api-keys-file` (one `NAME ROLE KEY` a line) and the shorthands `--api-key` (a `chat`
key named "api-key"), `--admin-api-key` (an `admin` key named "admin") and `--metrics-api-key` (a `metrics` key
named "metrics"). Roles, each with what the one before it may do:
  chat  — chat completions, the models, the pool's routing views, and its own files and jobs, read-only;
  train — also uploads files, creates and cancels its own jobs, creates skills and new versions of the
          skills it created;
  admin — everything: force, retire, rollback, every file and job, and the fallback clusters (request text).
Beside them, `metrics` is a scraper's: GET /metrics (skill names, the job in training, routing counts) and
nothing a caller without a key may not do; with keys, /metrics needs it or admin unless `--open-metrics`.
With no key at all the server is single-tenant and everyone may do everything. With keys but none of role
chat or train, callers without a key may chat and read the models (and nothing else).

Files and jobs belong to the name of the key that created them; another non-admin key gets 404 on them.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from .errors import APIError

if TYPE_CHECKING:
    from fastapi import Request

    from .config import ServerConfig

log = logging.getLogger(__name__)

Role = Literal["anonymous", "metrics", "chat", "train", "admin"]
ROLES: tuple[Role, ...] = ("chat", "train", "admin", "metrics")  # what a key may have; "anonymous" is no key
_RANK: dict[str, int] = {"anonymous": 0, "metrics": 0, "chat": 1, "train": 2, "admin": 3}
METRICS = "/metrics"
API_KEY_NAME, ADMIN_KEY_NAME, METRICS_KEY_NAME = "api-key", "admin", "metrics"  # the shorthand flags' keys' names
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_READS = ("GET", "HEAD", "OPTIONS")
_OWNED = ("/v1/files", "/v1/fine_tuning", "/tasks")  # records that belong to a key
# the writes a chat key (or, when open, no key) may make: generation and tokenizing
_OPEN_WRITES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize")
_IMPORTS = ("/v1/skills/import", "/v1/load_lora_adapter")  # bring an adapter in: as an upload, a train key's
# the console's reads (server.console_api): they show no request text, so they are not the admin's alone
_POOL_READS = frozenset(f"/v1/skillpool/{p}" for p in ("whoami", "routing", "routing/accuracy", "routing/confusion"))


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a key's name and role; name None for no key (or a server without keys)."""

    name: str | None
    role: Role

    def can(self, role: Role) -> bool:
        if role == "metrics":  # the scraper's role, beside the others: only it and the admin read /metrics
            return self.role in ("metrics", "admin")
        return _RANK[self.role] >= _RANK[role]

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see a file or job that `owner` created (the admin sees every one)."""
        return self.role == "admin" or (self.name is not None and owner == self.name)


SINGLE_TENANT = Principal(None, "admin")  # no keys configured: everyone may do everything, as before keys
ANONYMOUS = Principal(None, "anonymous")


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: Role
    secret: bytes


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line (never a key)."""


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    """`NAME ROLE KEY` lines; blank lines and `#` comments (whole lines, or after the three fields) are skipped."""
    keys: list[ApiKey] = []
    for n, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 3 and fields[3].startswith("#"):
            fields = fields[:3]
        where = f"{source} line {n}"
        if len(fields) != 3:
            raise KeyFileError(f"{where}: expected NAME ROLE KEY, found {len(fields)} field(s)")
        name, role, secret = fields
        if not _NAME.match(name):
            raise KeyFileError(f"{where}: name {name!r} must be 1-64 letters, digits, '.', '_', '@' or '-'")
        if role not in ROLES:
            raise KeyFileError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        keys.append(ApiKey(name, cast(Role, role), secret.encode()))
    _check_unique(keys, source)
    return keys


def _check_unique(keys: list[ApiKey], source: str) -> None:
    names = [n for n, count in Counter(k.name for k in keys).items() if count > 1]
    if names:
        raise KeyFileError(f"{source}: the name {names[0]!r} is used by more than one key")
    if len({k.secret for k in keys}) < len(keys):  # one key, two names: which owns what it creates?
        raise KeyFileError(f"{source}: the same key is listed twice (under different names)")


class KeyRing:
    """The keys in force. `reload()` re-reads the keys file (SIGHUP); a bad file keeps the keys in use."""

    def __init__(
        self,
        api_key: str | None = None,
        admin_key: str | None = None,
        path: Path | None = None,
        metrics_key: str | None = None,
        open_metrics: bool = False,
    ) -> None:
        """`open_metrics`: /metrics answers without a key even when there are keys (`--open-metrics`)."""
        self.path, self.open_metrics = path, open_metrics
        self._flags = [ApiKey(API_KEY_NAME, "chat", api_key.encode())] if api_key else []
        if admin_key:
            self._flags.append(ApiKey(ADMIN_KEY_NAME, "admin", admin_key.encode()))
        if metrics_key:
            self._flags.append(ApiKey(METRICS_KEY_NAME, "metrics", metrics_key.encode()))
        self.keys: tuple[ApiKey, ...] = self._load()

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> KeyRing:
        return cls(
            cfg.http.api_key,
            cfg.http.admin_key,
            cfg.http.api_keys_file,
            cfg.http.metrics_api_key,
            not cfg.http.metrics_need_key,
        )

    def _load(self) -> tuple[ApiKey, ...]:
        from_file: list[ApiKey] = []
        if self.path is not None:
            try:
                text = self.path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise KeyFileError(f"cannot read the keys file {self.path}: {e}") from None
            from_file = parse_keys(text, str(self.path))
            if not from_file:  # read mid-write, or emptied: no keys would open everything to everyone
                raise KeyFileError(f"the keys file {self.path} lists no keys")
        keys = self._flags + from_file
        _check_unique(keys, f"{self.path or 'keys'} with --api-key/--admin-api-key/--metrics-api-key")
        return tuple(keys)

    def reload(self) -> bool:
        """Re-read the keys file; on any error log it and keep the keys in use. True when the new keys serve."""
        try:
            keys = self._load()
        except KeyFileError as e:
            log.error("auth: keys not reloaded, the %d key(s) in use stay: %s", len(self.keys), e)
            return False
        self.keys = keys  # one assignment: a request sees the old tuple or the new one
        log.info("auth: keys reloaded from %s; %s", self.path, self.summary())
        return True

    def stamp(self) -> tuple[int, int] | None:
        """The keys file's (mtime_ns, size); None without a file or while it cannot be read."""
        try:
            st = self.path.stat() if self.path is not None else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st is not None else None

    @property
    def anonymous_chat(self) -> bool:
        """Whether callers without a key may chat: keys exist, none of them for chat or training."""
        return not any(k.role in ("chat", "train") for k in self.keys)

    def principal(self, authorization: bytes) -> Principal | None:
        """The caller an Authorization header names; None for a key that is not ours (a 401)."""
        keys = self.keys
        if not keys:
            return SINGLE_TENANT
        scheme, _, token = authorization.strip().partition(b" ")
        if not scheme:
            return ANONYMOUS
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        if not token:
            return ANONYMOUS  # "Bearer " alone: a client that must send a key but has none
        found = None
        for k in keys:  # compare with every key, no early exit: the time taken does not say which matched
            if hmac.compare_digest(k.secret, token):
                found = k
        return Principal(found.name, found.role) if found else None

    def summary(self) -> str:
        """One line on what is open and what is not, logged at start-up and after a reload."""
        if not self.keys:
            return "auth: no API keys: single-tenant, every endpoint is open to anyone who can reach the port"
        count = Counter(k.role for k in self.keys)
        have = ", ".join(f"{count[r]} {r}" for r in ROLES if count[r])
        reads = "chat and models open to anyone" if self.anonymous_chat else "every /v1 and /tasks call needs a key"
        writes = {
            (True, True): "uploads and training need a train or admin key",
            (False, True): "uploads and training need the admin key",
            (True, False): "uploads and training need a train key",
            (False, False): "no key may upload or train (add a train or admin key)",
        }[(bool(count["train"]), bool(count["admin"]))]
        admin = "need the admin key" if count["admin"] else "are closed (no admin key)"
        metrics = (
            "/metrics is open to anyone (--open-metrics)"
            if self.open_metrics
            else "/metrics needs a metrics or admin key"
        )
        return (
            f"auth: keys: {have}; {reads}; {writes}; force, retire, rollback and fallback clusters {admin}; {metrics}"
        )


def required_role(method: str, path: str) -> Role:
    """The least role a request needs, by method and path (handlers then check ownership and `force`).
    Any write not listed needs the admin: a new endpoint is closed until it is given a role here."""
    if path == METRICS:
        return "metrics"
    if path.startswith("/v1/skillpool") and not (method in _READS and path in _POOL_READS):
        return "admin"  # fallback clusters show the text of other callers' requests
    if method in _READS:
        return "chat" if path.startswith(_OWNED) else "anonymous"
    if path in _OPEN_WRITES:
        return "anonymous"
    if path.startswith(_OWNED) or path in _IMPORTS:
        return "train"
    return "admin"


def denial(principal: Principal | None, need: Role) -> tuple[int, str, str] | None:
    """(status, message, code) when `principal` may not act with role `need`; None when it may."""
    if principal is None:
        return 401, "invalid API key", "invalid_api_key"
    if principal.can(need):
        return None
    roles = "role metrics or admin" if need == "metrics" else f"role {need} or above"
    if principal.role == "anonymous":
        return 401, f"missing API key: this needs a key with {roles}", "invalid_api_key"
    msg = f"this needs a key with {roles}; the key {principal.name!r} has role {principal.role}"
    return 403, msg, "permission_denied"


def principal_of(request: Request) -> Principal:
    """The caller the middleware found (server.middleware); a route it did not guard has no key: anonymous."""
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else ANONYMOUS


def require(request: Request, need: Role, what: str, param: str | None = None) -> Principal:
    """The caller, when it has role `need` or above; else 403 permission_denied (401 without a key)."""
    p = principal_of(request)
    if (why := denial(p, need)) is not None:
        status, _, code = why
        raise APIError(status, f"{what} needs a key with role {need} or above", param, code)
    return p


class KeyFileWatch:
    """Re-reads a ring's keys file whenever it changes (mtime or size, checked every `interval_s`): how processes
    that no SIGHUP reaches, such as a cluster's ingress replicas on every node, follow the file."""

    def __init__(self, ring: KeyRing, interval_s: float = 2.0) -> None:
        self.ring, self.interval_s = ring, interval_s
        self._seen = ring.stamp()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skillpool-keys-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            stamp = self.ring.stamp()
            if stamp is not None and stamp != self._seen:  # a file being replaced is read once it is back
                self._seen = stamp
                self.ring.reload()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
