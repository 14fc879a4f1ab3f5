"""A Java ``client.properties`` as a librdkafka configuration, and the secrets in it.

Kafka's documentation, and every platform team's wiki, hands out client
settings as a Java ``client.properties``. librdkafka (under confluent-kafka)
shares most key names with the Java client, but not the Java-only ones: a JAAS
login (``sasl.jaas.config``), Java key and trust stores, class names.
:func:`translate` turns the common Java-only keys into their librdkafka
equivalents and rejects the rest, naming what to use instead, so that a file
that works for ``kafka-console-producer`` works for kdelay or says why not.

Keys librdkafka knows pass through untouched; keys neither side knows reach
librdkafka, which rejects them when a client is created.

Secrets never leave this module in a message: errors name keys and JAAS option
names, never values, and :class:`ClientProperties` (the mapping
:class:`~kdelay.plumbing.settings.Settings` keeps) shows ``***`` for every secret in its
``repr``. :func:`is_secret` is the one definition of a secret key.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from kdelay.errors import KdelayError

UNSUPPORTED = "kafka-config-unsupported"
REDACTED = "***"
_SECRET_WORDS = ("password", "secret", "jaas", "key.pem", "keystore.key", "oauthbearer.config")


class ClientConfigError(KdelayError, ValueError):
    """A client.properties kdelay cannot use; ``code`` is stable, the message names no secret."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def is_secret(key: str) -> bool:
    """Whether the value of ``key`` (Java or librdkafka name) must never be shown."""
    lowered = key.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def secret_values(config: Mapping[str, object]) -> tuple[str, ...]:
    """The non-empty string values of the secret keys of ``config``, for scrubbing text."""
    return tuple(v for k, v in config.items() if is_secret(k) and isinstance(v, str) and v)


class ClientProperties(Mapping[str, str]):
    """An immutable librdkafka configuration whose ``repr`` hides every secret value."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        """Copy ``items``; later changes to the source do not show here."""
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> str:
        """The value of ``key``, secrets included: clients need them."""
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        """The keys, in insertion order."""
        return iter(self._items)

    def __len__(self) -> int:
        """How many keys are set."""
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        """Equal to any mapping with the same items."""
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __hash__(self) -> int:
        """Hash of the items, so a frozen Settings holding one stays hashable."""
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        """Like a dict's, with ``***`` for the value of every secret key."""
        shown = {k: REDACTED if is_secret(k) else v for k, v in self._items.items()}
        return f"ClientProperties({shown!r})"


# --- the translation -------------------------------------------------------------------


def translate(java: Mapping[str, str]) -> dict[str, str]:
    """Return the librdkafka configuration for the Java client properties ``java``.

    Translated: ``sasl.jaas.config`` with the PLAIN, SCRAM or Kerberos login
    module (to ``sasl.username``/``sasl.password`` or ``sasl.kerberos.*``), PEM
    trust and key stores, files or inline (to ``ssl.ca.*``,
    ``ssl.certificate.*``, ``ssl.key.*``), PKCS#12 key stores, and the keys
    :data:`RENAMED` lists. Rejected: JKS stores, PKCS#12 trust stores, other
    login modules and every key of :data:`JAVA_ONLY`. Raises
    :class:`ClientConfigError` (``kafka-config-unsupported``) naming every rejected
    key and its librdkafka equivalent; the message never holds a value.
    """
    config = dict(java)
    _translate_renamed(config)
    problems = [*_translate_jaas(config), *_translate_truststore(config),
                *_translate_keystore(config)]
    problems += [f"{key}: {JAVA_ONLY[key]}" for key in config if key in JAVA_ONLY]
    if problems:
        raise ClientConfigError(UNSUPPORTED, "client.properties: " + "; ".join(problems))
    return config


#: Java-only keys whose librdkafka twin means the same, and how values map.
RENAMED: Mapping[str, str] = {
    "send.buffer.bytes": "socket.send.buffer.bytes",
    "receive.buffer.bytes": "socket.receive.buffer.bytes",
    "max.request.size": "message.max.bytes",
}

_NO_EQUIVALENT = "a Java client setting librdkafka has no equivalent for; remove it"

#: Java-only keys kdelay rejects, with what to use instead.
JAVA_ONLY: Mapping[str, str] = {
    "buffer.memory": "use queue.buffering.max.kbytes (in KiB) instead",
    "max.block.ms": "librdkafka does not block a full producer; remove it",
    "default.api.timeout.ms": _NO_EQUIVALENT,
    "max.poll.records": "librdkafka hands out one record per poll; remove it",
    "key.serializer": "kdelay moves bytes, serializers are Java classes; remove it",
    "value.serializer": "kdelay moves bytes, serializers are Java classes; remove it",
    "key.deserializer": "kdelay moves bytes, deserializers are Java classes; remove it",
    "value.deserializer": "kdelay moves bytes, deserializers are Java classes; remove it",
    "partitioner.class": "kdelay chooses the partitioner itself; remove it",
    "interceptor.classes": "Java classes; librdkafka loads C plugins with plugin.library.paths",
    "metric.reporters": "Java classes; librdkafka reports with statistics.interval.ms",
    "auto.include.jmx.reporter": _NO_EQUIVALENT,
    "security.providers": _NO_EQUIVALENT,
    "ssl.protocol": "librdkafka negotiates the TLS version through OpenSSL; remove it",
    "ssl.enabled.protocols": "librdkafka negotiates the TLS version through OpenSSL; remove it",
    "ssl.provider": _NO_EQUIVALENT,
    "ssl.keymanager.algorithm": _NO_EQUIVALENT,
    "ssl.trustmanager.algorithm": _NO_EQUIVALENT,
    "ssl.secure.random.implementation": _NO_EQUIVALENT,
    "ssl.engine.factory.class": _NO_EQUIVALENT,
    "sasl.login.class": "Java class; for OAUTHBEARER use sasl.oauthbearer.method=oidc",
    "sasl.login.callback.handler.class":
        "Java class; for OAUTHBEARER use sasl.oauthbearer.method=oidc",
    "sasl.client.callback.handler.class": "Java class; librdkafka takes sasl.username and "
                                          "sasl.password, or sasl.oauthbearer.* settings",
    "sasl.login.refresh.window.factor": _NO_EQUIVALENT,
    "sasl.login.refresh.window.jitter": _NO_EQUIVALENT,
    "sasl.login.refresh.min.period.seconds": _NO_EQUIVALENT,
    "sasl.login.refresh.buffer.seconds": _NO_EQUIVALENT,
    "sasl.kerberos.ticket.renew.window.factor":
        "use sasl.kerberos.min.time.before.relogin (ms) instead",
    "sasl.kerberos.ticket.renew.jitter": _NO_EQUIVALENT,
}


def _translate_renamed(config: dict[str, str]) -> None:
    """Rename :data:`RENAMED` keys; map Java's "no TLS host check" spelling."""
    for java_key, rd_key in RENAMED.items():
        if java_key in config:
            value = config.pop(java_key)
            # Java's -1 ("the OS default") is librdkafka's 0 for the socket buffers.
            config[rd_key] = "0" if value == "-1" and rd_key.startswith("socket.") else value
    algorithm = "ssl.endpoint.identification.algorithm"
    if config.get(algorithm, "x").strip() == "":
        config[algorithm] = "none"  # Java's empty value turns the host-name check off


# --- sasl.jaas.config ------------------------------------------------------------------

_PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
_KERBEROS = "com.sun.security.auth.module.Krb5LoginModule"
_OAUTH = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
_JAAS_HEAD = re.compile(
    r"\s*(?P<module>[\w.$]+)\s+(?P<flag>required|requisite|sufficient|optional)")
_JAAS_OPTION = re.compile(
    r"""\s*(?P<name>[\w.-]+)\s*=\s*"""
    r"""(?:"(?P<quoted>(?:[^"\\]|\\.)*)"|'(?P<single>(?:[^'\\]|\\.)*)'|(?P<word>[^\s;"'=]+))""",
    re.DOTALL)
_JAAS_END = re.compile(r"\s*;\s*")
_JAAS_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "b": "\b", "a": "\a", "v": "\v"}
#: JAAS options of the Kerberos module and the librdkafka key each becomes.
_KERBEROS_OPTIONS = {"keyTab": "sasl.kerberos.keytab", "principal": "sasl.kerberos.principal",
                     "serviceName": "sasl.kerberos.service.name"}
_KERBEROS_IGNORED = {"useKeyTab", "storeKey", "useTicketCache", "doNotPrompt", "debug"}


@dataclass(frozen=True)
class JaasLogin:
    """One parsed JAAS login: the module class and its options (values are secrets)."""

    module: str
    options: Mapping[str, str]

    def __repr__(self) -> str:
        """The module and option names only: option values hold passwords."""
        return f"JaasLogin({self.module!r}, options={sorted(self.options)!r})"


def parse_jaas(text: str) -> JaasLogin:
    """Parse a client ``sasl.jaas.config``: ``Module flag name="value" ...;``.

    Values are double- or single-quoted (backslash escapes as in Java's JAAS
    parser) or bare words. Exactly one login module is allowed, as in the Java client.
    Raises :class:`ClientConfigError` (``kafka-config-malformed``) describing the
    expected shape; the message never repeats the text, which holds a password.
    """
    head = _JAAS_HEAD.match(text)
    if head is None:
        raise _jaas_error("it must start with a login module class and a control flag")
    options: dict[str, str] = {}
    position = head.end()
    while (option := _JAAS_OPTION.match(text, position)) is not None:
        quoted = option["quoted"] if option["quoted"] is not None else option["single"]
        options[option["name"]] = option["word"] if quoted is None else _jaas_unescape(quoted)
        position = option.end()
    end = _JAAS_END.match(text, position)
    if end is None or end.end() != len(text):
        raise _jaas_error("expected name=\"value\" options ended by one ';'")
    return JaasLogin(head["module"], options)


def _jaas_error(why: str) -> ClientConfigError:
    return ClientConfigError(
        "kafka-config-malformed",
        f"sasl.jaas.config: {why}, as in "
        f"{_SCRAM} required username=\"alice\" password=\"...\";",
    )


def _jaas_unescape(quoted: str) -> str:
    """Resolve the backslash escapes of a quoted JAAS value."""
    return re.sub(r"\\(.)", lambda m: _JAAS_ESCAPES.get(m[1], m[1]), quoted, flags=re.DOTALL)


def _translate_jaas(config: dict[str, str]) -> Iterator[str]:
    """Replace ``sasl.jaas.config`` with librdkafka's SASL keys; yield problems."""
    text = config.pop("sasl.jaas.config", None)
    if text is None:
        return
    login = parse_jaas(text)
    if login.module in (_PLAIN, _SCRAM):
        yield from _translate_password_login(login, config)
    elif login.module == _KERBEROS:
        yield from _translate_kerberos(login, config)
    elif login.module == _OAUTH:
        yield ("sasl.jaas.config: OAuthBearerLoginModule has no librdkafka form; use "
               "sasl.oauthbearer.method=oidc with sasl.oauthbearer.client.id, "
               "sasl.oauthbearer.client.secret, sasl.oauthbearer.token.endpoint.url")
    else:
        yield (f"sasl.jaas.config: login module {login.module} is unknown to librdkafka; "
               "use PlainLoginModule or ScramLoginModule, or sasl.username/sasl.password")


def _translate_password_login(login: JaasLogin, config: dict[str, str]) -> Iterator[str]:
    """PLAIN or SCRAM: ``username``/``password`` become ``sasl.username``/``sasl.password``."""
    plain = login.module == _PLAIN
    extra = sorted(set(login.options) - {"username", "password"})
    if extra:
        yield f"sasl.jaas.config: option(s) {', '.join(extra)} have no librdkafka equivalent"
    if "username" not in login.options or "password" not in login.options:
        yield "sasl.jaas.config: the login module needs both username and password"
        return
    config["sasl.username"] = login.options["username"]
    config["sasl.password"] = login.options["password"]
    mechanism = config.get("sasl.mechanism", config.get("sasl.mechanisms"))
    if mechanism is None:
        if not plain:
            yield "sasl.mechanism: ScramLoginModule needs SCRAM-SHA-256 or SCRAM-SHA-512 set"
        config["sasl.mechanism"] = "PLAIN"
        return
    name = mechanism.strip().upper()
    if not (name == "PLAIN" if plain else name.startswith("SCRAM-")):
        module = "PlainLoginModule" if plain else "ScramLoginModule"
        yield f"sasl.mechanism: {mechanism} does not match the JAAS {module}"


def _translate_kerberos(login: JaasLogin, config: dict[str, str]) -> Iterator[str]:
    """Krb5LoginModule: keytab, principal and service name become ``sasl.kerberos.*``."""
    for option, value in login.options.items():
        if option in _KERBEROS_OPTIONS:
            config[_KERBEROS_OPTIONS[option]] = value
        elif option not in _KERBEROS_IGNORED:
            yield f"sasl.jaas.config: Krb5LoginModule option {option} has no librdkafka equivalent"


# --- trust and key stores --------------------------------------------------------------

_PEM = "PEM"
_PKCS12 = "PKCS12"


def _translate_truststore(config: dict[str, str]) -> Iterator[str]:
    """A PEM trust store (file or inline) becomes ``ssl.ca.location`` / ``ssl.ca.pem``."""
    kind = config.pop("ssl.truststore.type", "JKS").strip().upper()
    location = config.pop("ssl.truststore.location", None)
    inline = config.pop("ssl.truststore.certificates", None)
    config.pop("ssl.truststore.password", None)  # protects JKS integrity only
    if location is None and inline is None:
        return
    if kind != _PEM:
        where = location or "ssl.truststore.certificates"
        yield (f"ssl.truststore.location: librdkafka reads CA certificates only as PEM; "
               f"export them from {where} (keytool -exportcert -rfc -alias ALIAS -keystore "
               f"{where} -file ca.pem, or openssl pkcs12 -in {where} -nokeys -out ca.pem) "
               f"and set ssl.ca.location=ca.pem")
        return
    if location is not None:
        config["ssl.ca.location"] = location
    if inline is not None:
        config["ssl.ca.pem"] = inline


def _translate_keystore(config: dict[str, str]) -> Iterator[str]:
    """A PEM or PKCS#12 key store becomes librdkafka's certificate and key settings.

    A PEM key store file holds the private key and the certificate chain; it is
    given to librdkafka as both ``ssl.key.location`` and
    ``ssl.certificate.location`` (OpenSSL picks the right blocks of each). A
    PKCS#12 file is read by librdkafka itself (``ssl.keystore.location``).
    """
    kind = config.pop("ssl.keystore.type", "JKS").strip().upper()
    location = config.pop("ssl.keystore.location", None)
    password = config.pop("ssl.keystore.password", None)
    key = config.pop("ssl.keystore.key", None)
    chain = config.pop("ssl.keystore.certificate.chain", None)
    if key is not None or chain is not None:
        if key is None or chain is None:
            yield "ssl.keystore.key: give it together with ssl.keystore.certificate.chain"
        config.update({"ssl.key.pem": key or "", "ssl.certificate.pem": chain or ""})
    if location is None:
        return
    if kind == _PEM:
        config["ssl.key.location"] = config["ssl.certificate.location"] = location
    elif kind == _PKCS12:
        config["ssl.keystore.location"] = location
        if password is not None:
            config["ssl.keystore.password"] = password
    else:
        yield (f"ssl.keystore.location: librdkafka cannot read a {kind} key store; convert "
               f"it (keytool -importkeystore -srckeystore {location} -destkeystore "
               f"client.p12 -deststoretype PKCS12) and set ssl.keystore.type=PKCS12, "
               f"ssl.keystore.location=client.p12")


# --- librdkafka's log lines --------------------------------------------------------------

LOGGER = "kdelay.kafka"
# Most lines of one repeating kind one client logs: one per this many seconds.
FAIL_LINE_EVERY_S = 60.0
# librdkafka's lines that repeat while it retries something by itself, each passed at
# most once per FAIL_LINE_EVERY_S: connection failures, and producer id requests
# refused while a transaction coordinator finishes the transaction it took over
# (``GETPID``: over a hundred lines in a second after a cluster refused writes).
RARE_FACILITIES = frozenset({"FAIL", "GETPID"})


class RareLines:
    """When the next line of each kind in :data:`RARE_FACILITIES` may pass: one a
    :data:`FAIL_LINE_EVERY_S`. Shared by whoever should say a kind once between them."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._next_s: dict[object, float] = {}

    def passes(self, facility: object) -> bool:
        """Whether a line of ``facility`` may pass now (it then starts that kind's minute);
        a line of any other facility always passes."""
        if facility not in RARE_FACILITIES:
            return True
        now = self._monotonic()
        if now < self._next_s.get(facility, float("-inf")):
            return False
        self._next_s[facility] = now + FAIL_LINE_EVERY_S
        return True


CHOSEN = ("enable.gapless.guarantee is experimental",)
"""librdkafka's warnings about settings kdelay chooses on purpose: logged at DEBUG (the
changelog's producer is gapless, see :mod:`kdelay.engine.commit._writer`)."""
FATAL = "FATAL"
"""The facility of librdkafka's line about a fatal error: logged at DEBUG, since the same
error reaches the ``error_cb``, and kdelay says itself what it does about it (replaces
the client, or ends with a stable code); a CRITICAL line the service then survives would
mislead."""


class ClientLogger:
    """Where one librdkafka client's log lines go: the Python logger ``kdelay.kafka.<client>``.

    confluent-kafka hands every librdkafka log line to the ``logger`` client
    setting (served by the client's ``poll``), as
    ``log(level, "%s [%s] %s", facility, client name, text)`` with syslog levels
    mapped to Python's (ERR to ERROR, WARNING to WARNING, NOTICE and INFO to
    INFO, DEBUG to DEBUG). Instead of librdkafka's own writes to stderr, the
    lines follow kdelay's logging configuration. Lines below WARNING (idle
    connections closed, reconnects) are logged at DEBUG, so a service running
    at INFO shows librdkafka's warnings and errors only (but for the warnings in
    :data:`CHOSEN`, about kdelay's own choices, and the :data:`FATAL` lines). A warning
    of :data:`RARE_FACILITIES` (a failed connection, a refused producer id: librdkafka
    retries them by itself, a line each time) passes once per
    :data:`FAIL_LINE_EVERY_S` of its kind, so a client whose broker stays away logs a
    line a minute, not one a second. Every secret value of the client's configuration
    is replaced by ``***`` before a line is logged.
    """

    def __init__(self, client: str, secrets: tuple[str, ...] = (),
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """Log to ``kdelay.kafka.<client>``, scrubbing ``secrets`` out of every line."""
        self.logger = logging.getLogger(f"{LOGGER}.{client}")
        self._secrets = tuple(s for s in secrets if s)
        self._rare = RareLines(monotonic)

    def log(self, level: int, message: str, *args: object) -> None:
        """Log one line at ``level`` (a Python level; below WARNING means DEBUG), scrubbed."""
        level = level if level >= logging.WARNING and args[:1] != (FATAL,) else logging.DEBUG
        if not self.logger.isEnabledFor(level):
            return
        text = message % args if args else message
        if level >= logging.WARNING and any(chosen in text for chosen in CHOSEN):
            level = logging.DEBUG
            if not self.logger.isEnabledFor(level):
                return
        if level >= logging.WARNING and args[:1] and not self._rare.passes(args[0]):
            return
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        self.logger.log(level, "%s", text)
