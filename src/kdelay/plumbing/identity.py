"""Who an instance is to Kafka: its static group member id and its transactional id.

Both must be stable across an instance's restarts and distinct from every
other instance's, without anybody configuring them:

- stable, so that a restarted instance is the *same* static group member
  (``group.instance.id``) and gets its partitions back at once instead of
  after the session timeout of its dead incarnation, and so that its
  transactional producer fences its dead incarnation and aborts the
  transaction it left open;
- distinct, so that two instances never fence each other or take each
  other's place in the group.

Both are derived from the host name together with the state directory's
absolute path. One host cannot run two instances on one state directory (the
RocksDB stores are locked), and containers started from one image share the
path (``/state``) but not the host name, so the pair is unique per instance
and survives restarts. ``--instance-id`` overrides the derivation (both ids
then come from it); ``--transactional-id`` overrides the transactional id
alone. The workers of ``kdelay run --workers N`` present the instance's
member id suffixed ``-w<i>`` (see :mod:`kdelay.engine.workers`).
"""

from __future__ import annotations

import hashlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from kdelay.plumbing.settings import Settings

_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")
_HOST_CHARS = 40


@dataclass(frozen=True, slots=True)
class Identity:
    """The ids one instance presents to Kafka."""

    member_id: str
    transactional_id: str


def derive(settings: Settings, hostname: str) -> Identity:
    """Return the identity of the instance running with ``settings`` on ``hostname``.

    Pure: the same settings and host name give the same identity. The member
    id reads ``<host>-<hash>`` (the host kept readable for operators, the hash
    of host and absolute state dir making it unique); the transactional id
    adds the group id, since transactional ids are cluster-wide.
    """
    member = settings.instance_id or _derived_member(settings.state_dir, hostname)
    transactional = settings.transactional_id or f"kdelay-{settings.group_id}-{member}"
    return Identity(member, transactional)


def _derived_member(state_dir: Path, hostname: str) -> str:
    """``<host>-<12 hex digits of sha256(host NUL absolute state dir)>``."""
    where = f"{hostname}\0{state_dir.resolve()}".encode()
    digest = hashlib.sha256(where).hexdigest()[:12]
    host = _UNSAFE.sub("-", hostname)[:_HOST_CHARS].strip("-") or "host"
    return f"{host}-{digest}"


def of(settings: Settings) -> Identity:
    """Return the identity of this process: :func:`derive` with this machine's host name."""
    return derive(settings, socket.gethostname())
