"""Who is asking, what they may do, and the CSRF token that proves a form is the console's.

Three ways in, decided by the :class:`Policy`:

- **open** (the default): no users and no proxy header, bound to a loopback
  address. Everyone who can reach the socket is on this machine and acts as
  ``local``, an operator. The ``Host`` header must name a loopback host, so a
  web page elsewhere that rebinds its DNS name to 127.0.0.1 is refused.
- **users**: ``name:role:hash`` entries, the hash made by :func:`hash_secret`
  (PBKDF2-SHA256, salted). A client authenticates with HTTP basic auth (name
  and secret) or ``Authorization: Bearer <secret>``. Secrets are never kept,
  logged or rendered; a verified secret is remembered by its SHA-256 so that
  PBKDF2 runs once per secret, not once per request.
- **proxy**: a reverse proxy that authenticates users and names them in a
  header (``X-Forwarded-User``). The header is believed only from the proxy's
  addresses; the names listed as operators act, the others view.

Binding anywhere but loopback without users or a proxy header is refused at
start (``auth-required``). Every state-changing request carries the CSRF
token of :meth:`Gate.csrf_token` (a form field or the ``X-CSRF-Token``
header): an HMAC of the principal under a key made at start, so another
site's form, which cannot read the console's pages, cannot forge it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from enum import StrEnum

from kdelay.errors import KdelayError
from kdelay.web.problems import CSRF_FAILED, FORBIDDEN, UNAUTHENTICATED, Problem

DEFAULT_ITERATIONS = 200_000
_ALGORITHM = "pbkdf2_sha256"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})
_REMEMBERED = 1024


class Role(StrEnum):
    """What a principal may do: a viewer reads, an operator also acts."""

    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: the name that goes into the audit topic, and a role."""

    name: str
    role: Role

    @property
    def can_act(self) -> bool:
        """Whether this principal may cancel, reschedule and deliver."""
        return self.role is Role.OPERATOR


class AccessError(KdelayError, ValueError):
    """A console configuration that cannot be served safely; ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class User:
    """A configured user: name, role and the encoded hash of their secret."""

    name: str
    role: Role
    secret_hash: str = field(repr=False)


def hash_secret(secret: str, *, salt: bytes | None = None,
                iterations: int = DEFAULT_ITERATIONS) -> str:
    """Encode ``secret`` as ``pbkdf2_sha256$<iterations>$<salt hex>$<hash hex>``."""
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)
    return f"{_ALGORITHM}${iterations}${salt.hex()}${digest.hex()}"


def verify_secret(secret: str, encoded: str) -> bool:
    """Whether ``secret`` hashes to ``encoded`` (:func:`hash_secret`); constant-time compare.

    Raises ValueError for an ``encoded`` that is not such a hash.
    """
    _, iterations, salt, digest = _split_hash(encoded)
    computed = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)
    return hmac.compare_digest(computed, digest)


def _split_hash(encoded: str) -> tuple[str, int, bytes, bytes]:
    parts = encoded.split("$")
    try:
        if len(parts) != 4 or parts[0] != _ALGORITHM:
            raise ValueError
        return parts[0], int(parts[1]), bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
    except ValueError:
        raise ValueError("a secret hash is pbkdf2_sha256$<iterations>$<salt hex>$<hash hex> "
                         "(made by `kdelay web --hash-secret`)") from None


def parse_users(text: str) -> tuple[User, ...]:
    """Parse ``name:role:hash`` entries separated by commas or new lines.

    Raises :class:`AccessError` ``invalid-users`` naming the entry's position
    (never its hash) for a malformed entry, an unknown role or a repeated name.
    """
    users: dict[str, User] = {}
    entries = [e.strip() for e in text.replace("\n", ",").split(",") if e.strip()]
    for number, entry in enumerate(entries, start=1):
        name, _, rest = entry.partition(":")
        role, _, encoded = rest.partition(":")
        if not name or name in users:
            raise AccessError("invalid-users", f"user entry {number} has no name or repeats one")
        try:
            _split_hash(encoded)
            users[name] = User(name, Role(role), encoded)
        except ValueError:
            raise AccessError("invalid-users", f"user entry {number} is not name:role:hash "
                              "with a role of viewer or operator") from None
    return tuple(users.values())


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, no port) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host of a ``Host`` header value, without its port."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


@dataclass(frozen=True, slots=True)
class Policy:
    """How the console authenticates, as ``kdelay web``'s options set it."""

    bind: str = "127.0.0.1"
    users: tuple[User, ...] = ()
    proxy_header: str | None = None
    proxy_addresses: frozenset[str] = frozenset({"127.0.0.1", "::1"})
    proxy_operators: frozenset[str] = frozenset()
    payloads_for_viewers: bool = False

    @property
    def open(self) -> bool:
        """Whether everyone who reaches the socket is the local operator."""
        return not self.users and self.proxy_header is None

    def check(self) -> None:
        """Raise :class:`AccessError` ``auth-required`` for an open console off loopback."""
        if self.open and not is_loopback(self.bind):
            raise AccessError("auth-required", f"binding {self.bind} (not loopback) needs "
                              "authentication: give --web-users or --web-proxy-header")


class Gate:
    """Identifies the caller of each request under a :class:`Policy`, and makes and checks
    their CSRF tokens (keyed by a secret made when the gate is)."""

    def __init__(self, policy: Policy, key: bytes | None = None) -> None:
        policy.check()
        self.policy = policy
        self._key = key if key is not None else os.urandom(32)
        self._verified: set[bytes] = set()

    def identify(self, *, client: str | None, host: str | None, authorization: str | None,
                 proxy_user: str | None) -> Principal:
        """The principal of a request from address ``client`` with these headers.

        Raises :class:`Problem` 401 ``unauthenticated`` when no way in fits,
        400 ``host-not-allowed`` for an open console asked under a name that
        is not loopback.
        """
        policy = self.policy
        if policy.open:
            if host is not None and not is_loopback(host_of(host)):
                raise Problem(400, "host-not-allowed",
                              "this console answers only under a loopback host name")
            return Principal("local", Role.OPERATOR)
        if policy.proxy_header and proxy_user and client in policy.proxy_addresses:
            role = Role.OPERATOR if proxy_user in policy.proxy_operators else Role.VIEWER
            return Principal(proxy_user, role)
        found = self._from_authorization(authorization or "")
        if found is None:
            raise Problem(401, UNAUTHENTICATED, "sign in: basic auth or a bearer token")
        return found

    def _from_authorization(self, header: str) -> Principal | None:
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() == "bearer" and credentials:
            return next((Principal(u.name, u.role) for u in self.policy.users
                         if self._matches(credentials.strip(), u)), None)
        if scheme.lower() == "basic":
            try:
                name, _, secret = base64.b64decode(credentials, validate=True).decode() \
                    .partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            user = next((u for u in self.policy.users if u.name == name), None)
            if user is not None and self._matches(secret, user):
                return Principal(user.name, user.role)
        return None

    def _matches(self, secret: str, user: User) -> bool:
        """Verify ``secret`` for ``user``, remembering successes by a digest, not the secret."""
        seen = hashlib.sha256(f"{user.name}\0{user.secret_hash}\0{secret}".encode()).digest()
        if seen in self._verified:
            return True
        if not verify_secret(secret, user.secret_hash):
            return False
        if len(self._verified) >= _REMEMBERED:
            self._verified.clear()
        self._verified.add(seen)
        return True

    def csrf_token(self, principal: Principal) -> str:
        """The token every state-changing request of ``principal`` must carry."""
        message = f"{principal.name}\0{principal.role.value}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def check_csrf(self, principal: Principal, presented: str | None) -> None:
        """Raise :class:`Problem` 403 ``csrf-failed`` unless ``presented`` is the token."""
        if not presented or not hmac.compare_digest(presented, self.csrf_token(principal)):
            raise Problem(403, CSRF_FAILED, "the request has no valid CSRF token: reload the "
                          "page, or send the token of GET /api/v1/session as X-CSRF-Token")

    @staticmethod
    def require_operator(principal: Principal) -> None:
        """Raise :class:`Problem` 403 ``forbidden`` unless ``principal`` may act."""
        if not principal.can_act:
            raise Problem(403, FORBIDDEN, f"{principal.name} is a viewer: only operators act")
