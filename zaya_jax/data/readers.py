"""Document readers for `launch.prepare_data`: one input file -> its documents, streamed.

`read_documents(path, text_field, bad_records, skipped)` yields `(text, where)` per document,
in file order, without loading the file whole:
  .txt        the whole file is one document (invalid UTF-8 replaced); an empty file is none
  .jsonl      one document per non-blank line: the string under `text_field`
  .jsonl.gz   the same, gzip-compressed (decompressed as it is read)
  .parquet    one document per row of the string column `text_field`, read batch by batch
              (`pyarrow.parquet.ParquetFile.iter_batches`), never the whole table
`where` is "path" (.txt), "path:LINE" (1-based line) or "path:row N" (0-based row), for
error messages. Every failure is a `ReadError` whose one-line message names the file (and
line/row) and the fix.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
_PARQUET_BATCH_ROWS = 1024  # rows decoded at a time from a parquet row group


class ReadError(ValueError):
  """An input file (or one record of it) that cannot be read; the message is one line."""


def check_suffix(path: str, pattern: str) -> None:
  """Raises ReadError if `path` (matched by `pattern`) is not one of SUFFIXES."""
  if not path.endswith(SUFFIXES):
    raise ReadError(f"--source: {path!r} (from {pattern!r}) is not one of {SUFFIXES}; narrow "
                    "the pattern, e.g. 'corpus/*.jsonl'")


def read_documents(path: str, text_field: str, bad_records: str = "error",
                   skipped: list[str] | None = None) -> Iterator[tuple[str, str]]:
  """Yields (text, where) for each document of `path` (see the module docstring).

  Args:
    path: a file ending in one of SUFFIXES.
    text_field: the JSON key (.jsonl) or column (.parquet) holding the text.
    bad_records: "error" (raise at the first bad record) or "skip" (leave it out and append
      its `where` to `skipped`). A bad record is a .jsonl line that is not JSON or has no
      string under `text_field`, or a parquet null.
    skipped: receives the `where` of each skipped record (bad_records="skip").

  Raises:
    ReadError: the file cannot be opened; a bad record (bad_records="error"); a corrupt or
      truncated .gz; a parquet that is not parquet, has no rows, lacks the column (the
      message lists the columns it has) or whose column is not a string column.
  """
  skipped = [] if skipped is None else skipped
  try:
    if path.endswith(".txt"):
      yield from _txt(path)
    elif path.endswith(".jsonl"):
      with open(path, "rb") as f:
        yield from _jsonl(f, path, text_field, bad_records, skipped)
    elif path.endswith(".jsonl.gz"):
      yield from _jsonl_gz(path, text_field, bad_records, skipped)
    elif path.endswith(".parquet"):
      yield from _parquet(path, text_field, bad_records, skipped)
    else:
      raise ReadError(f"{path}: not one of {SUFFIXES}")
  except (PermissionError, IsADirectoryError, FileNotFoundError) as e:
    raise ReadError(f"{path}: cannot be read ({e.strerror}); fix its permissions or leave it "
                    "out of --source") from e


def _txt(path: str) -> Iterator[tuple[str, str]]:
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  if text:
    yield text, path


def _bad(message: str, where: str, bad_records: str, skipped: list[str]) -> None:
  """Raises for bad_records="error", else records `where` as skipped."""
  if bad_records != "skip":
    raise ReadError(f"{message}; fix or remove it, or pass --bad_records=skip to leave bad "
                    "records out")
  skipped.append(where)


def _jsonl(f, path: str, field: str, bad_records: str,
           skipped: list[str]) -> Iterator[tuple[str, str]]:
  line_number = 0
  for line_number, line in enumerate(f, 1):
    if not line.strip():
      continue
    where = f"{path}:{line_number}"
    try:
      record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      _bad(f"{where} is not valid JSON ({e})", where, bad_records, skipped)
      continue
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      found = (f"keys {sorted(record)}" if isinstance(record, dict)
               else f"a JSON {type(record).__name__}")
      what = (f"holds a {type(text).__name__}, not a string" if isinstance(record, dict)
              and field in record else f"not found (found {found})")
      _bad(f"{where}: --text_field={field!r} {what}", where, bad_records, skipped)
      continue
    yield text, where


def _jsonl_gz(path: str, field: str, bad_records: str,
              skipped: list[str]) -> Iterator[tuple[str, str]]:
  documents = 0
  try:
    with gzip.open(path, "rb") as f:
      for item in _jsonl(f, path, field, bad_records, skipped):
        documents += 1
        yield item
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise ReadError(f"{path}: corrupt or truncated gzip after {documents} documents ({e}); "
                    "re-download or recompress it") from e


def _parquet(path: str, field: str, bad_records: str,
             skipped: list[str]) -> Iterator[tuple[str, str]]:
  try:
    parquet = pq.ParquetFile(path)
  except (pa.ArrowInvalid, OSError) as e:
    if isinstance(e, (PermissionError, FileNotFoundError)):
      raise
    raise ReadError(f"{path}: not a readable parquet file ({e}); re-download or rewrite it") from e
  with parquet:
    schema = parquet.schema_arrow
    if field not in schema.names:
      raise ReadError(f"{path}: no column --text_field={field!r}; it has columns "
                      f"{schema.names}; pass the one holding the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
      raise ReadError(f"{path}: column {field!r} is {kind}, not a string column; pass the "
                      "column holding the text as --text_field")
    if parquet.metadata.num_rows == 0:
      raise ReadError(f"{path}: empty parquet (0 rows); leave it out of --source")
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
      for text in batch.column(0).to_pylist():
        where = f"{path}:row {row}"
        row += 1
        if text is None:
          _bad(f"{where}: column {field!r} is null", where, bad_records, skipped)
          continue
        yield text, where

