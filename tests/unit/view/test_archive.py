"""The export file: encode/decode pairs, whole files written and read back, bad input.

No broker: files are written with :class:`ArchiveWriter` and read with
:class:`ArchiveReader`; the ``import`` command is run only on files it rejects
before it connects to anything.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.view.archive import (
    Archived,
    ArchiveError,
    ArchiveReader,
    ArchiveWriter,
    Header,
    Trailer,
    decode_entry,
    decode_header,
    decode_line,
    encode_entry,
    encode_header,
    encode_trailer,
)
from kdelay.view.export import derived_id

HEADER = Header("kdelay.requests", "cluster-1", 1_700_000_000_000, 2, 1_800_000_000_000)
ENTRY = Archived(1_800_000_000_000, "orders", 3, "order-7", b"k", b"\x00\xff", [("a", b"1"),
              ("n", None), ("a", b"2")], "kdelay.requests/0/42", 1_700_000_000_000)
BARE = Archived(5, "t", None, None, None, None, [], "r/1/0", 4)

entries = st.builds(
    Archived,
    due_ms=st.integers(0, 2**63 - 1),
    target=st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True),
    partition=st.none() | st.integers(0, 2**31 - 1),
    schedule_id=st.none() | st.text(min_size=1),
    key=st.none() | st.binary(),
    value=st.none() | st.binary(max_size=2_000),
    headers=st.lists(st.tuples(st.text(), st.none() | st.binary())),
    origin=st.text(min_size=1),
    timestamp_ms=st.integers(0, 2**63 - 1),
    lane=st.none() | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True),
)


def write(path: Path, items: list[Archived], header: Header = HEADER) -> None:
    writer = ArchiveWriter(path, header)
    for item in items:
        writer.write(item)
    writer.finish({"expired": 1})
    writer.close()


def read(path: Path) -> tuple[Header, list[Archived], Trailer | None]:
    with ArchiveReader(path) as reader:
        found = list(reader.entries())
        return reader.header, found, reader.trailer


@given(entries)
def test_an_entry_survives_its_line(entry: Archived) -> None:
    line = encode_entry(entry)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1  # one line whatever the bytes inside
    assert decode_line(line, 2) == entry


def test_header_and_trailer_survive_their_lines() -> None:
    assert decode_header(encode_header(HEADER)) == HEADER
    assert decode_line(encode_trailer(Trailer(3, {"expired": 2})), 9) == Trailer(3, {"expired": 2})


@pytest.mark.parametrize("name", ["pending.jsonl", "pending.jsonl.gz"])
def test_a_file_reads_back_as_written(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    write(path, [ENTRY, BARE])
    assert read(path) == (HEADER, [ENTRY, BARE], Trailer(2, {"expired": 1}))
    assert path.read_bytes().startswith(b"\x1f\x8b") == name.endswith(".gz")
    assert not (tmp_path / f"{name}.partial").exists()


def test_a_compressed_file_is_recognised_whatever_its_name(tmp_path: Path) -> None:
    plain = tmp_path / "p.jsonl"
    write(plain, [ENTRY])
    renamed = tmp_path / "p.data"
    renamed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read(renamed)[1] == [ENTRY]


def test_an_unfinished_writer_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    writer = ArchiveWriter(path, HEADER)
    writer.write(ENTRY)
    writer.close()
    assert list(tmp_path.iterdir()) == []


def lines(*objects: object) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objects)


GOOD_HEADER = orjson.loads(encode_header(HEADER))
GOOD_ENTRY = orjson.loads(encode_entry(ENTRY))
END = {"end": True, "entries": 1, "unexported": {}}


@pytest.mark.parametrize(("content", "code", "detail"), [
    (b"", "bad-export-file", "line 1: not JSON"),
    (b"PK\x03\x04 zip", "bad-export-file", "line 1: not JSON"),
    (lines([1, 2]), "bad-export-file", "not a JSON object"),
    (lines({"format": "other", "version": 1}), "bad-export-file", "not a kdelay export file"),
    (lines(GOOD_HEADER | {"version": 2}), "export-version-unknown", "version 2"),
    (lines(GOOD_HEADER | {"version": "1"}), "bad-export-file", "'version' must be int"),
    (lines(GOOD_HEADER | {"pending": None}), "bad-export-file", "'pending' must be int"),
])
def test_a_bad_first_line_is_refused_with_its_code(
        tmp_path: Path, content: bytes, code: str, detail: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ArchiveError, match=detail) as caught:
        ArchiveReader(path)
    assert caught.value.code == code


@pytest.mark.parametrize(("body", "code", "detail"), [
    (lines(GOOD_ENTRY), "export-truncated", "without its end line"),
    (lines(GOOD_ENTRY, END | {"entries": 2}), "export-truncated", "its end line counts 2"),
    (lines(GOOD_ENTRY, END, GOOD_ENTRY), "bad-export-file", "line 4: a line after the end"),
    (lines(GOOD_ENTRY | {"value": "%%%"}, END), "bad-export-file", "line 2: field 'value'"),
    (lines(GOOD_ENTRY | {"due_ms": True}, END), "bad-export-file", "'due_ms' must be int"),
    (lines({k: v for k, v in GOOD_ENTRY.items() if k != "target"}, END), "bad-export-file",
     "'target' must be str"),
    (lines(GOOD_ENTRY | {"headers": [["a"]]}, END), "bad-export-file", "a header must be"),
    (lines(GOOD_ENTRY) + b"{\"due_ms\": 1", "bad-export-file", "line 3: not JSON"),
])
def test_a_bad_body_is_refused_at_its_line(
        tmp_path: Path, body: bytes, code: str, detail: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(lines(GOOD_HEADER) + body)
    with ArchiveReader(path) as reader, pytest.raises(ArchiveError, match=detail) as caught:
        list(reader.entries())
    assert caught.value.code == code


def test_a_cut_gzip_stream_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl.gz"
    write(path, [ENTRY] * 50)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])
    with ArchiveReader(path) as reader, pytest.raises(ArchiveError) as caught:
        list(reader.entries())
    assert caught.value.code == "export-truncated"


def test_an_entry_names_its_lane_only_when_it_has_one() -> None:
    laned = Archived(5, "dev1.t", None, None, None, None, [], "r/1/0", 4, "dev1")
    assert orjson.loads(encode_entry(laned))["lane"] == "dev1"
    assert "lane" not in orjson.loads(encode_entry(BARE))
    assert decode_entry(orjson.loads(encode_entry(BARE)), 2).lane is None
    with pytest.raises(ArchiveError, match="line 4: field 'lane' is not a lane name"):
        decode_entry(orjson.loads(encode_entry(laned)) | {"lane": "dev 1"}, 4)
    with pytest.raises(ArchiveError, match="field 'lane' must be str"):
        decode_entry(orjson.loads(encode_entry(laned)) | {"lane": 7}, 4)


def test_an_entry_without_a_field_names_it() -> None:
    with pytest.raises(ArchiveError, match="line 7: field 'origin'"):
        decode_entry({k: v for k, v in GOOD_ENTRY.items() if k != "origin"}, 7)


def test_a_derived_id_is_stable_and_reads_as_an_id() -> None:
    made = derived_id("AbC-_1", "kdelay.requests/3/42")
    assert made == "kdelay-export:AbC-_1:kdelay.requests:3:42"
    assert "/" not in made  # `kdelay show` would take it for coordinates
    assert derived_id(None, "r/0/1") == "kdelay-export:-:r:0:1"
    assert derived_id("c", "r/0/1") != derived_id("c", "r/0/10")


runner = CliRunner()


@pytest.fixture
def _no_kdelay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KDELAY_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("_no_kdelay_env")
@pytest.mark.parametrize(("content", "code"), [
    (None, "export-file-missing"),
    (b"not json\n", "bad-export-file"),
    (lines(GOOD_HEADER | {"version": 9}), "export-version-unknown"),
    (lines(GOOD_HEADER, GOOD_ENTRY), "export-truncated"),
])
def test_import_refuses_a_bad_file_with_one_line(
        tmp_path: Path, content: bytes | None, code: str) -> None:
    path = tmp_path / "in.jsonl"
    if content is not None:
        path.write_bytes(content)
    # --check reads the whole file; without it the file's first line is read before Kafka.
    args = ["import", str(path), "--check"] if code == "export-truncated" else ["import",
                                                                                str(path)]
    result = runner.invoke(app, [*args, "--bootstrap-servers", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error[{code}]: "), result.output
    assert result.output.count("\n") == 1


@pytest.mark.usefixtures("_no_kdelay_env")
def test_import_check_reads_a_good_file_without_kafka(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl.gz"
    write(path, [ENTRY, BARE])
    result = runner.invoke(app, ["import", str(path), "--check"])
    assert result.exit_code == 0, result.output
    assert "2 entries from kdelay.requests (cluster cluster-1), complete" in result.output
