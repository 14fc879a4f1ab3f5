"""Kafka's murmur2 partitioner as a Spark SQL expression: the request partition of an id.

Every schedule id has one home partition of the requests topic,
:func:`kdelay.protocol.forward.id_partition`: ``toPositive(murmur2(utf8(id))) % n``,
as the Java client's default partitioner places a key. A job that writes
requests through Spark's Kafka sink must put each on that partition, so that a
re-run's duplicate meets the first request where the id lives.

The hash is computed in Spark SQL, with no Python on the executors: the
id's UTF-8 bytes as hex, read four bytes at a time with ``conv``, folded with
``aggregate``. The 32-bit arithmetic runs on non-negative ``bigint`` values
masked to 32 bits: a masked hash times the constant ``0x5bd1e995`` (below
2**31) stays below 2**63, so nothing overflows, ANSI mode or not.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF


def _let(value: str, var: str, body: str) -> str:
    """``body`` with lambda variable ``var`` bound to ``value``, evaluated once."""
    return f"element_at(transform(array({value}), {var} -> {body}), 1)"


def _times_m(value: str) -> str:
    """``value * m`` modulo 2**32, for a value already in ``[0, 2**32)``."""
    return f"((({value}) * {_M}) & {_MASK})"


def _little_endian(hex8: str, var: str) -> str:
    """The unsigned 32-bit little-endian word whose bytes are the 8 hex digits ``hex8``."""
    swapped = (f"(shiftleft({var} & 255, 24) | shiftleft(shiftright({var}, 8) & 255, 16)"
               f" | shiftleft(shiftright({var}, 16) & 255, 8) | shiftright({var}, 24))")
    return _let(f"cast(conv({hex8}, 16, 10) as bigint)", var, swapped)


def _scrambled(word: str) -> str:
    """A whole word ``k`` as murmur2 mixes it in: ``k *= m; k ^= k >>> 24; k *= m``."""
    return _let(_times_m(word), "k1", _times_m("k1 ^ shiftright(k1, 24)"))


def _finished(hashed: str) -> str:
    """murmur2's last avalanche: ``h ^= h >>> 13; h *= m; h ^= h >>> 15``."""
    return _let(hashed, "f1", _let(_times_m("f1 ^ shiftright(f1, 13)"), "f2",
                                   "f2 ^ shiftright(f2, 15)"))


def murmur2_sql(name: str) -> str:
    """The SQL of ``Utils.murmur2(utf8(name))`` as an unsigned 32-bit ``bigint``.

    ``name`` is a string column's name (back-quoted here). A null id gives null.
    Every intermediate value is bound once (:func:`_let`), so the expression
    grows linearly, not by doubling at each step that reads a value twice.
    """
    indices = "IF(nw > 0, sequence(0, nw - 1), cast(array() as array<int>))"
    word = _scrambled(_little_endian("substr(hx, i * 8 + 1, 8)", "w"))
    words = f"transform({indices}, i -> {word})"
    body = f"aggregate({words}, cast(({_SEED} ^ nb) as bigint), (h, k) -> {_times_m('h')} ^ k)"
    tail = _little_endian("rpad(substr(hx, nw * 8 + 1), 8, '0')", "t")
    hashed = _let(body, "h0", f"IF(nb % 4 = 0, h0, {_times_m(f'h0 ^ {tail}')})")
    sized = _let("length(hx) div 2", "nb", _let("nb div 4", "nw", _finished(hashed)))
    return _let(f"hex(encode(`{name}`, 'UTF-8'))", "hx", sized)


def murmur2(name: str) -> Column:
    """``Utils.murmur2`` of the UTF-8 string column ``name``, unsigned 32-bit (a ``bigint``)."""
    return F.expr(murmur2_sql(name))


def id_partition(name: str, partitions: int) -> Column:
    """The requests-topic partition (an ``int``) of the id in string column ``name``.

    ``toPositive(murmur2) % partitions``, exactly
    :func:`kdelay.protocol.forward.id_partition`. Raises ValueError for fewer
    than one partition.
    """
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return F.expr(f"cast(({murmur2_sql(name)} & 2147483647) % {partitions} as int)")
