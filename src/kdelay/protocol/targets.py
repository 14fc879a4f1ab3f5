"""Which topics a request may target: never kdelay's own, only its lane's, only allowed ones.

kdelay writes with its own credentials, which may reach topics a producer
cannot: a policy refuses a target before a request is indexed and again when
it comes due, so no request can make kdelay write where it must not.

Lanes let one deployment serve several environments of one cluster (dev1,
dev2, staging): each lane owns the topics that start with its prefix, a
request names its lane in ``kdelay-lane``, and a request may target only the
topics of its own lane; a request without a lane only topics no lane owns.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from kdelay.protocol.envelope import DETAIL_LIMIT, LANE, LANE_NAME, ErrorCode, Rejection

_POLICY_CACHE = 1_024
_REGEX_PREFIX = "re:"
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]{1,248}")


@dataclass(frozen=True, slots=True)
class Lanes:
    """The configured lanes: each lane's name and the prefix of the topics it owns.

    ``prefixes`` maps a lane (see :data:`~kdelay.protocol.envelope.LANE_NAME`)
    to a topic-name prefix. No prefix may start another (``dev.`` and
    ``dev.a.`` would both own ``dev.a.orders``), so every topic has at most one
    owner. Empty: no lanes, and every request is lane-less. Raises ValueError
    for a bad lane name or prefix, or two prefixes that overlap.
    """

    prefixes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Copy the mapping (so the object stays immutable) and validate it."""
        object.__setattr__(self, "prefixes", dict(self.prefixes))
        for lane, prefix in self.prefixes.items():
            if LANE_NAME.fullmatch(lane) is None:
                raise ValueError(f"{lane!r} is not a lane name (a letter or digit, then up to "
                                 "63 of A-Z a-z 0-9 . _ -)")
            if _TOPIC_CHARS.fullmatch(prefix) is None:
                raise ValueError(f"lane {lane}: {prefix!r} is not a topic-name prefix (1-248 "
                                 "characters from A-Z a-z 0-9 . _ -)")
        ordered = sorted(self.prefixes.items(), key=lambda item: item[1])
        for (lane, prefix), (other, longer) in itertools.pairwise(ordered):
            if longer.startswith(prefix):
                raise ValueError(f"lanes {lane} ({prefix}) and {other} ({longer}) overlap: "
                                 "no lane's prefix may start another's")

    @classmethod
    def parse(cls, spec: str) -> Lanes:
        """Parse ``"dev1=dev1.,dev2=dev2."`` (``lane=prefix`` pairs, commas between).

        Spaces around names are ignored and empty parts skipped; raises
        ValueError for a part without ``=``, a lane named twice, or what the
        constructor refuses.
        """
        prefixes: dict[str, str] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            lane, separator, prefix = (s.strip() for s in part.partition("="))
            if not separator:
                raise ValueError(f"{part!r} is not lane=prefix (such as dev1=dev1.)")
            if lane in prefixes:
                raise ValueError(f"lane {lane} is given twice")
            prefixes[lane] = prefix
        return cls(prefixes)

    def __bool__(self) -> bool:
        """True when lanes are configured."""
        return bool(self.prefixes)

    def __iter__(self) -> Iterator[str]:
        """The lane names, in the order configured."""
        return iter(self.prefixes)

    def __contains__(self, lane: object) -> bool:
        return lane in self.prefixes

    def owner(self, target: str) -> str | None:
        """The lane whose prefix ``target`` starts with, or None when no lane owns it."""
        for lane, prefix in self.prefixes.items():
            if target.startswith(prefix):
                return lane
        return None

    def spec(self) -> str:
        """The ``lane=prefix,...`` form :meth:`parse` reads."""
        return ",".join(f"{lane}={prefix}" for lane, prefix in self.prefixes.items())


class TargetPolicy:
    """Which topics requests may target: never kdelay's own, only their lane's, allowed ones.

    ``reserved`` are kdelay's own topics (requests, changelog, DLQ, the
    worker's): a request targeting one is refused as ``forbidden-target``, as
    is any Kafka-internal topic (a name starting with ``__``). Then ``lanes``:
    a request naming a lane that is not configured is refused as
    ``unknown-lane``; one of a lane whose target that lane does not own as
    ``wrong-lane``; one without a lane whose target a lane owns as
    ``missing-lane``. Finally, when ``allowed`` is not empty, the target must
    match one of its patterns or is refused as ``target-not-allowed``. A pattern is a topic name, an
    ``fnmatch`` glob (``orders.*``, case-sensitive) or, prefixed with ``re:``,
    a regular expression the whole name must match. Raises ValueError for a
    regular expression that does not compile. Answers are cached per lane and
    target (a deployment has few), so the check costs two dict lookups per
    request; an unknown lane is answered without touching the cache, so lane
    names taken from requests never grow it.
    """

    def __init__(self, reserved: Iterable[str], allowed: Iterable[str],
                 lanes: Lanes | None = None) -> None:
        self._reserved = frozenset(reserved)
        self._lanes = lanes or Lanes()
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
        self._known: dict[str | None, dict[str, Rejection | None]] = {
            lane: {} for lane in (None, *self._lanes)}
        self._cached = 0

    @property
    def lanes(self) -> Lanes:
        """The configured lanes and the prefix of the topics each owns."""
        return self._lanes

    def refusal(self, target: str, lane: str | None = None) -> Rejection | None:
        """Return why a request of ``lane`` (None: no lane) may not go to ``target``, or None."""
        known = self._known.get(lane)
        if known is None:
            return self._unknown(lane)
        try:
            return known[target]
        except KeyError:
            pass
        refused = self._decide(target, lane)
        if self._cached < _POLICY_CACHE:
            known[target] = refused
            self._cached += 1
        return refused

    def _unknown(self, lane: str | None) -> Rejection:
        configured = ", ".join(self._lanes) or "none: the service runs without --lanes"
        return Rejection(ErrorCode.UNKNOWN_LANE,
                         f"lane {lane} is not configured; configured lanes: {configured}"
                         [:DETAIL_LIMIT])

    def _decide(self, target: str, lane: str | None) -> Rejection | None:
        if target in self._reserved or target.startswith("__"):
            return Rejection(ErrorCode.FORBIDDEN_TARGET,
                             f"target {target} is one of kdelay's own or Kafka's internal "
                             "topics; kdelay never delivers there")
        refused = self._lane_refusal(target, lane)
        if refused is not None:
            return refused
        if self._pattern is not None and self._pattern.match(target) is None:
            return Rejection(ErrorCode.TARGET_NOT_ALLOWED,
                             f"target {target} matches none of --allowed-targets "
                             f"{','.join(self._allowed)}"[:DETAIL_LIMIT])
        return None

    def _lane_refusal(self, target: str, lane: str | None) -> Rejection | None:
        owner = self._lanes.owner(target)
        if owner == lane:
            return None
        if lane is None:
            return Rejection(ErrorCode.MISSING_LANE,
                             f"target {target} belongs to lane {owner}; its requests must "
                             f"carry {LANE}: {owner}"[:DETAIL_LIMIT])
        prefix = self._lanes.prefixes[lane]
        where = "no lane's topic" if owner is None else f"a topic of lane {owner}"
        return Rejection(ErrorCode.WRONG_LANE,
                         f"target {target} is {where}; requests of lane {lane} may only "
                         f"target topics starting with {prefix}"[:DETAIL_LIMIT])
