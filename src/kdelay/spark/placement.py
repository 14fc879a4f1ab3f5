"""Kafka's murmur2 partitioner as a Spark SQL expression: the request partition of an id.

Every schedule id has one home partition of the requests topic,
:func:`kdelay.protocol.forward.id_partition`: ``toPositive(murmur2(utf8(id))) % n``,
as the Java client's default partitioner places a key. A job that writes
requests through Spark's Kafka sink must put each on that partition, so that a
re-run's duplicate meets the first request where the id lives.

The hash is computed in Spark SQL, with no Python on the executors: an
ASCII id's bytes are its characters, read with ``ascii``; any other id's UTF-8
bytes go through hex, four bytes at a time with ``conv``; either way the words
are folded with ``aggregate`` (see :func:`murmur2_sql`). The 32-bit arithmetic runs on
non-negative ``bigint`` values masked to 32 bits: a masked hash times the
constant ``0x5bd1e995`` (below 2**31) stays below 2**63, so nothing
overflows, ANSI mode or not.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF


def _times_m(value: str) -> str:
    """``value * m`` modulo 2**32, for a value already in ``[0, 2**32)``."""
    return f"((({value}) * {_M}) & {_MASK})"


def _swapped(word: str) -> str:
    """The little-endian reading of ``word``, four bytes read big-endian (a lambda variable
    or a cheap expression: it is read four times)."""
    return (f"(shiftleft({word} & 255, 24) | shiftleft(shiftright({word}, 8) & 255, 16)"
            f" | shiftleft(shiftright({word}, 16) & 255, 8) | shiftright({word}, 24))")


def _avalanche(h: str) -> str:
    """murmur2's last steps on ``h`` (the tail already mixed in):
    ``h ^= h >>> 13; h *= m; h ^= h >>> 15``."""
    mixed = _times_m(f"{h} ^ shiftright({h}, 13)")
    return f"({mixed} ^ shiftright({mixed}, 15))"


def murmur2_sql(name: str) -> str:
    """The SQL of ``Utils.murmur2(utf8(name))`` as an unsigned 32-bit ``bigint``.

    ``name`` is a string column's name (back-quoted here). A null id gives
    null. An id whose characters are all ASCII (its byte count equals its
    character count: nearly every id) takes :func:`_ascii_murmur2_sql`, about
    a third cheaper; any other takes :func:`_utf8_murmur2_sql`.
    """
    column = f"`{name}`"
    return _avalanche(f"(CASE WHEN octet_length({column}) = char_length({column}) "
                      f"THEN {_ascii_mixed_sql(column)} ELSE {_utf8_mixed_sql(column)} END)")


def _ascii_mixed_sql(column: str) -> str:
    """murmur2 of an ASCII string: byte ``j`` is ``ascii(substr(column, j, 1))``.

    Each word is read little-endian straight from its four characters (no hex,
    no ``conv``, no byte swap); the tail's bytes beyond the end read as 0
    (``ascii('')``), which is what murmur2's switch over the tail length does.
    The last steps run in the fold's finish lambda, on its variable, so that
    the fold is evaluated once (Spark does not share common subexpressions
    inside higher-order functions).
    """
    size = f"octet_length({column})"

    def byte(position: str) -> str:
        return f"cast(ascii(substr({column}, {position}, 1)) as bigint)"

    word = " | ".join(f"shiftleft({byte(f'4 * i + {j + 1}')}, {8 * j})" for j in range(4))
    indices = f"IF({size} >= 4, sequence(0, cast({size} / 4 as int) - 1), array())"
    firsts = f"transform({indices}, i -> {_times_m(word)})"
    scrambled = f"transform({firsts}, k -> {_times_m('k ^ shiftright(k, 24)')})"
    start = f"cast(({_SEED} ^ {size}) as bigint)"
    whole = f"({size} - {size} % 4)"
    tail = " | ".join(f"shiftleft({byte(f'{whole} + {j + 1}')}, {8 * j})" for j in range(3))
    folded = f"aggregate({scrambled}, {start}, (h, k) -> {_times_m('h')} ^ k)"
    return f"(((({folded}) ^ ({tail})) * IF({size} % 4 > 0, {_M}, 1)) & {_MASK})"


def _utf8_mixed_sql(column: str) -> str:
    """murmur2 of any string, through its UTF-8 bytes as hex.

    The hex is cut into whole words with ``regexp_extract_all``; three
    ``transform`` passes read and scramble them, one ``aggregate`` folds them
    into the hash. Its accumulator carries the tail (the last 0 to 3 bytes,
    as a word) and whether there is one, so that they are computed once per
    row, not once per use inside the lambdas, which Spark evaluates without
    common-subexpression elimination.
    """
    data = f"encode({column}, 'UTF-8')"
    hexed = f"hex({data})"
    words = f"transform(regexp_extract_all({hexed}, '.{{8}}', 0), c -> cast(conv(c, 16, 10) " \
            f"as bigint))"
    firsts = f"transform({words}, w -> {_times_m(_swapped('w'))})"
    scrambled = f"transform({firsts}, k -> {_times_m('k ^ shiftright(k, 24)')})"
    tail_hex = f"rpad(regexp_extract({hexed}, '^(?:.{{8}})*(.*)$', 1), 8, '0')"
    tail = _swapped(f"cast(conv({tail_hex}, 16, 10) as bigint)")
    start = (f"named_struct('h', cast(({_SEED} ^ octet_length({data})) as bigint), "
             f"'t', {tail}, 'r', octet_length({data}) % 4 > 0)")
    step = f"named_struct('h', {_times_m('a.h')} ^ k, 't', a.t, 'r', a.r)"
    tailed = f"IF(a.r, {_times_m('a.h ^ a.t')}, a.h)"
    return f"aggregate({scrambled}, {start}, (a, k) -> {step}, a -> {tailed})"


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
