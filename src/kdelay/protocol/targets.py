"""Which topics a request may target: never kdelay's own, and only allowed ones if listed.

kdelay writes with its own credentials, which may reach topics a producer
cannot: a policy refuses a target before a request is indexed and again when
it comes due, so no request can make kdelay write where it must not.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from kdelay.protocol.envelope import DETAIL_LIMIT, ErrorCode, Rejection

_POLICY_CACHE = 1_024
_REGEX_PREFIX = "re:"


class TargetPolicy:
    """Which topics requests may target: never kdelay's own, and only allowed ones if listed.

    ``reserved`` are kdelay's own topics (requests, changelog, DLQ, the
    worker's): a request targeting one is refused as ``forbidden-target``, as
    is any Kafka-internal topic (a name starting with ``__``). Otherwise, when
    ``allowed`` is not empty, the target must match one of its patterns or is
    refused as ``target-not-allowed``. A pattern is a topic name, an
    ``fnmatch`` glob (``orders.*``, case-sensitive) or, prefixed with ``re:``,
    a regular expression the whole name must match. Raises ValueError for a
    regular expression that does not compile. Answers are cached per target
    (a deployment has few), so the check costs a dict lookup per request.
    """

    def __init__(self, reserved: Iterable[str], allowed: Iterable[str]) -> None:
        self._reserved = frozenset(reserved)
        self._allowed = tuple(allowed)
        globs = [p for p in self._allowed if not p.startswith(_REGEX_PREFIX)]
        regexes = [p[len(_REGEX_PREFIX):] for p in self._allowed if p.startswith(_REGEX_PREFIX)]
        parts = [fnmatch.translate(glob) for glob in globs]
        for regex in regexes:
            try:
                re.compile(regex)
            except re.error as exc:
                raise ValueError(f"{_REGEX_PREFIX}{regex} is not a regular expression: {exc}"
                                 ) from None
            parts.append(f"(?:{regex})\\Z")
        self._pattern = re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None
        self._known: dict[str, Rejection | None] = {}

    def refusal(self, target: str) -> Rejection | None:
        """Return why ``target`` is refused, or None when requests may go there."""
        try:
            return self._known[target]
        except KeyError:
            pass
        refused = self._decide(target)
        if len(self._known) < _POLICY_CACHE:
            self._known[target] = refused
        return refused

    def _decide(self, target: str) -> Rejection | None:
        if target in self._reserved or target.startswith("__"):
            return Rejection(ErrorCode.FORBIDDEN_TARGET,
                             f"target {target} is one of kdelay's own or Kafka's internal "
                             "topics; kdelay never delivers there")
        if self._pattern is not None and self._pattern.match(target) is None:
            return Rejection(ErrorCode.TARGET_NOT_ALLOWED,
                             f"target {target} matches none of --allowed-targets "
                             f"{','.join(self._allowed)}"[:DETAIL_LIMIT])
        return None
