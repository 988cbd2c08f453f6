"""The prepared-corpus format: a directory of ArrayRecord shards and its `manifest.json`.

Written by `python -m launch.prepare_data` (`zaya_jax.data.prepare`), read by training when
`data.source` is such a directory (`zaya_jax.data.prepared`). Layout:

  DIR/manifest.json                       this file's `Manifest`, written last (atomically)
  DIR/shards/<source>-<part>.array_record one record per document: its token ids as
                                          little-endian int32 bytes (bos/eos already added
                                          per `add_bos` / `add_eos`), ArrayRecord
                                          `group_size:1` (random access per record)
  DIR/shards/<source>-<part>.lengths.npy  int32 [documents]: tokens of each record, so the
                                          global sample index is built without reading
                                          any record

Documents have global ids 0..N-1: the shards in manifest order, records in file order.
A shard is listed only once complete (written under a temporary name, then renamed); the
manifest's `sha256` and `bytes` of each shard let the reader reject a truncated or altered
shard with one line naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

MANIFEST_FILE = "manifest.json"
FORMAT = "zaya-prepared"
FORMAT_VERSION = 1
TOKEN_DTYPE = "<i4"  # little-endian int32 token ids in every record


class ManifestError(ValueError):
  """A prepared directory that cannot be used; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
  """The tokenizer a corpus was prepared with.

  Attributes:
    name: "byte", or the path of the tokenizer.json given to prepare_data.
    sha256: hex digest of the tokenizer.json bytes ("byte" for the byte tokenizer).
    vocab_size: tokens in the vocabulary (added tokens included).
    bos_id, eos_id, pad_id: its special ids.
  """

  name: str
  sha256: str
  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int


@dataclasses.dataclass(frozen=True)
class ShardInfo:
  """One complete shard.

  Attributes:
    path: the .array_record file, relative to the prepared directory.
    lengths: the .lengths.npy file (int32 [documents]), relative to the directory.
    documents: records in the shard; tokens: the sum of their lengths.
    bytes: size of the .array_record file; sha256: its hex digest.
  """

  path: str
  lengths: str
  documents: int
  tokens: int
  bytes: int
  sha256: str


@dataclasses.dataclass(frozen=True)
class SourceInfo:
  """One input file: its path as given (after glob expansion), size and documents read."""

  path: str
  bytes: int
  documents: int


@dataclasses.dataclass(frozen=True)
class Manifest:
  """`DIR/manifest.json`: what a prepared corpus holds and how it was made.

  Attributes:
    tokenizer: see TokenizerInfo.
    add_bos, add_eos: whether each record starts with bos / ends with eos.
    text_field: the JSON key / parquet column the text was read from.
    sources: the input files, in the order their documents were numbered.
    shards: the shards, in global document order.
    format, format_version: FORMAT and FORMAT_VERSION.
  """

  tokenizer: TokenizerInfo
  add_bos: bool
  add_eos: bool
  text_field: str
  sources: tuple[SourceInfo, ...]
  shards: tuple[ShardInfo, ...]
  format: str = FORMAT
  format_version: int = FORMAT_VERSION

  @property
  def documents(self) -> int:
    """Documents in the corpus (all shards)."""
    return sum(s.documents for s in self.shards)

  @property
  def tokens(self) -> int:
    """Tokens in the corpus (all shards, bos/eos included)."""
    return sum(s.tokens for s in self.shards)

  def to_json(self) -> dict[str, Any]:
    """The JSON object written to manifest.json (totals included for readers' convenience)."""
    return {**dataclasses.asdict(self), "documents": self.documents, "tokens": self.tokens,
            "token_dtype": TOKEN_DTYPE}


def is_prepared_dir(path: str) -> bool:
  """True if `path` is a directory holding a manifest.json."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST_FILE))


def write_manifest(directory: str, manifest: Manifest) -> str:
  """Writes `directory/manifest.json` atomically (temporary file + rename); returns its path."""
  path = os.path.join(directory, MANIFEST_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest.to_json(), f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
  return path


def read_manifest(directory: str) -> Manifest:
  """Reads and checks `directory/manifest.json` (not the shards: see `check_shards`).

  Raises:
    ManifestError: no manifest (with the prepare_data command to make one), unreadable
      JSON, another format or version, or missing fields.
  """
  path = os.path.join(directory, MANIFEST_FILE)
  if not os.path.isfile(path):
    raise ManifestError(
        f"{directory!r} has no {MANIFEST_FILE}: it is not a prepared corpus (or its "
        "preparation did not finish). Make one with: python -m launch.prepare_data "
        f"--source=GLOBS --tokenizer=byte|PATH --out={directory}")
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise ManifestError(f"{path}: cannot be read as JSON ({e}); rerun launch.prepare_data "
                        f"--out={directory}") from e
  if not isinstance(raw, dict) or raw.get("format") != FORMAT:
    raise ManifestError(f"{path}: not a {FORMAT} manifest (format={raw.get('format')!r} "
                        "if it is an object at all)")
  if raw.get("format_version") != FORMAT_VERSION:
    raise ManifestError(f"{path}: format_version {raw.get('format_version')!r}, this code "
                        f"reads {FORMAT_VERSION}; prepare the corpus again with this version")
  try:
    return Manifest(
        tokenizer=TokenizerInfo(**raw["tokenizer"]),
        add_bos=bool(raw["add_bos"]), add_eos=bool(raw["add_eos"]),
        text_field=str(raw["text_field"]),
        sources=tuple(SourceInfo(**s) for s in raw["sources"]),
        shards=tuple(ShardInfo(**s) for s in raw["shards"]))
  except (KeyError, TypeError) as e:
    raise ManifestError(f"{path}: missing or unexpected field ({e}); prepare the corpus "
                        "again") from e


def check_shards(directory: str, manifest: Manifest, checksums: bool) -> None:
  """Checks every listed shard exists with its recorded size (and sha256 if `checksums`).

  Raises:
    ManifestError: naming the first bad shard and the fix (prepare again into a fresh --out,
      or restore the file).
  """
  for shard in manifest.shards:
    path = os.path.join(directory, shard.path)
    for f in (path, os.path.join(directory, shard.lengths)):
      if not os.path.isfile(f):
        raise ManifestError(f"{f}: listed in {MANIFEST_FILE} but missing; restore it or "
                            "prepare the corpus again")
    size = os.path.getsize(path)
    if size != shard.bytes:
      raise ManifestError(f"{path}: {size} bytes, the manifest says {shard.bytes} (truncated "
                          "or replaced); restore it or prepare the corpus again")
    if checksums:
      digest = hashlib.sha256()
      with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
          digest.update(block)
      if digest.hexdigest() != shard.sha256:
        raise ManifestError(f"{path}: sha256 differs from {MANIFEST_FILE} (the file was "
                            "altered); restore it or prepare the corpus again")
