"""Tokenize a corpus once into ArrayRecord shards (`launch.prepare_data`).

`prepare(patterns, out, options, num_workers)` writes the directory `zaya_jax.data.manifest`
describes. The unit of work is one input file (a *source*): source i (in `expand_sources`
order) becomes shards `shards/<i:05d>-<part:05d>.array_record` (+ `.lengths.npy`), a new
shard started after `options.shard_tokens` tokens, always at a document boundary. So the
shards depend only on the input and the options, never on the number of workers, and two
runs write byte-identical files.

Resumability:
  - `DIR/prepare_args.json` (written first) records the tokenizer (and its sha256), options
    and every source with its size. A rerun into a *finished* DIR (manifest.json written) with
    anything different is refused, the message naming each difference. A rerun into an
    unfinished one (a killed run, or one stopped by bad input that has since been fixed)
    continues with the new arguments: prepare_args.json is rewritten and every source whose
    file, size or recipe changed is redone.
  - a shard is written as `NAME.tmp` and renamed when complete; when all shards of source i
    are, `shards/<i:05d>.done.json` (its SourceInfo, ShardInfos and the digest of the recipe,
    i.e. the arguments other than the sources) is written atomically.
  - a rerun skips sources with a valid done-file (same path, size and recipe; their files are
    not touched), removes whatever an earlier run left of the others and redoes them; the
    manifest is written last, from the done-files only, so a half-written shard is never
    listed.

Documents with no tokens (an empty text without bos/eos) are left out; empty .txt files and
blank .jsonl lines are not documents. Worker processes and the progress bar: `prepare_pool`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging
from array_record.python import array_record_module

from zaya_jax.data import manifest as manifest_lib
from zaya_jax.data import prepare_pool
from zaya_jax.data import readers
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer

ARGS_FILE = "prepare_args.json"
SHARDS_DIR = "shards"
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access per document
# Test hook: a process exits (os._exit, no cleanup, like kill -9) at the first document it
# writes after completing this many shards.
EXIT_AFTER_SHARDS_ENV = "ZAYA_PREPARE_EXIT_AFTER_SHARDS"
_GLOB_CHARS = frozenset("*?[")
_SKIPPED_SHOWN = 5  # where of the first few skipped records kept in a done-file
_REPORT_SECONDS = 0.25  # how often a worker sends its document/token counts to the bar


class PrepareError(ValueError):
  """Preparation cannot go on; the message is one line naming the file and the fix."""


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  """What the shards' contents depend on (all of it goes into prepare_args.json).

  Attributes:
    tokenizer: "byte" or the path of a tokenizer.json.
    text_field: JSON key / parquet column of the text.
    shard_tokens: a shard is closed once it holds at least this many tokens (> 0).
    add_bos, add_eos: put the tokenizer's bos / eos id around every document.
    bad_records: "error" or "skip" (see `readers.read_documents`).
  """

  tokenizer: str
  text_field: str = "text"
  shard_tokens: int = 1 << 26  # 64 Mi tokens = 256 MiB of int32 per shard
  add_bos: bool = True
  add_eos: bool = True
  bad_records: str = "error"

  def __post_init__(self):
    if self.shard_tokens < 1:
      raise PrepareError(f"--shard_tokens={self.shard_tokens} must be >= 1")
    if not self.text_field:
      raise PrepareError("--text_field is empty; give the JSON key / parquet column of the text")
    if self.bad_records not in ("error", "skip"):
      raise PrepareError(f"--bad_records={self.bad_records!r} must be 'error' or 'skip'")


@dataclasses.dataclass(frozen=True)
class PrepareResult:
  """What `prepare` did: the manifest, and this run's own work (skipped sources excluded).

  Attributes:
    seconds: wall time of the run; documents, tokens: read and written by this run.
    sources_done_before: sources skipped because an earlier run finished them.
    skipped_records: bad records left out (bad_records="skip"), all sources;
      skipped_first: the file:line / file:row of the first few.
  """

  manifest: manifest_lib.Manifest
  manifest_path: str
  seconds: float
  documents: int
  tokens: int
  sources_done_before: int
  skipped_records: int
  skipped_first: tuple[str, ...]
  workers: int


def expand_sources(patterns: Sequence[str]) -> list[str]:
  """The input files: each pattern's matches in sorted order, patterns in the given order,
  duplicates dropped. Plain paths are taken as they are; `**` recurses.

  Raises:
    PrepareError: a pattern matches no file, names a directory, or matches a file that is
      not one of `readers.SUFFIXES`.
  """
  paths, seen = [], set()
  for pattern in (p.strip() for p in patterns):
    if not pattern:
      continue
    if _GLOB_CHARS.isdisjoint(pattern):
      if os.path.isdir(pattern):
        raise PrepareError(f"--source: {pattern!r} is a directory; give a glob such as "
                           f"'{os.path.join(pattern, '*.jsonl')}'")
      matched = [pattern] if os.path.isfile(pattern) else []
    else:
      matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matched:
      raise PrepareError(f"--source: {pattern!r} matched no files (relative paths are from "
                         f"{os.getcwd()!r}); check the path")
    for path in matched:
      try:
        readers.check_suffix(path, pattern)
      except readers.ReadError as e:
        raise PrepareError(str(e)) from e
      if path not in seen:
        seen.add(path)
        paths.append(path)
  if not paths:
    raise PrepareError("--source is empty; give comma-separated paths or globs")
  return paths


def load_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
  """"byte" or a tokenizer.json path; PrepareError (one line) if it cannot be loaded."""
  if name == "byte":
    return ByteTokenizer()
  try:
    return HFTokenizer(name)
  except ValueError as e:
    raise PrepareError(str(e).replace("data.tokenizer", "--tokenizer")) from e


def tokenizer_info(name: str, tokenizer) -> manifest_lib.TokenizerInfo:
  """The manifest's TokenizerInfo; sha256 of the tokenizer.json bytes ("byte" for bytes)."""
  if name == "byte":
    digest = "byte"
  else:
    with open(name, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
  return manifest_lib.TokenizerInfo(name=name, sha256=digest, vocab_size=tokenizer.vocab_size,
                                    bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                    pad_id=tokenizer.pad_id)


def shard_name(source: int, part: int) -> str:
  """`shards/<source:05d>-<part:05d>.array_record`, relative to the prepared directory."""
  return f"{SHARDS_DIR}/{source:05d}-{part:05d}.array_record"


def done_file(out: str, source: int) -> str:
  return os.path.join(out, SHARDS_DIR, f"{source:05d}.done.json")


def recipe_digest(args: dict[str, Any]) -> str:
  """sha256 of the arguments other than the sources: what a source's shards depend on
  besides the source file itself (format, tokenizer, options)."""
  recipe = {k: v for k, v in args.items() if k != "sources"}
  return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:18] + "..." + text[-18:]


def describe_differences(before: dict[str, Any], after: dict[str, Any], limit: int = 4) -> str:
  """What changed between two prepare_args.json contents, e.g. `--add_eos True -> False;
  a.jsonl: 120 -> 131 bytes`; at most `limit` items per kind, then `and N more`."""
  items: list[str] = []
  for key in sorted(set(before) | set(after)):
    old, new = before.get(key), after.get(key)
    if old == new or key == "sources":
      continue
    if key == "tokenizer" and isinstance(old, dict) and isinstance(new, dict):
      items += [f"--tokenizer {k}: {_short(old.get(k))} -> {_short(new.get(k))}"
                for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    elif key in ("format", "format_version"):
      items.append(f"{key} {_short(old)} -> {_short(new)} (written by another version)")
    else:
      items.append(f"--{key} {_short(old)} -> {_short(new)}")
  old_sources = {s["path"]: s["bytes"] for s in before.get("sources", [])}
  new_sources = {s["path"]: s["bytes"] for s in after.get("sources", [])}
  changes = [f"{p}: {old_sources[p]} -> {new_sources[p]} bytes" for p in new_sources
             if p in old_sources and old_sources[p] != new_sources[p]]
  changes += [f"{p} added" for p in new_sources if p not in old_sources]
  changes += [f"{p} removed" for p in old_sources if p not in new_sources]
  if not changes and list(old_sources) != list(new_sources):
    changes.append("the source files' order")
  if len(changes) > limit:
    changes = changes[:limit] + [f"and {len(changes) - limit} more source change(s)"]
  return "; ".join(items + changes) or "nothing"


def _claim_out(out: str, args: dict[str, Any]) -> bool:
  """Creates `out` and writes prepare_args.json, or takes over an existing one.

  Returns:
    True if `out` held these very arguments (its done-files without a recipe digest, written
    before the digest existed, are then trusted).

  Raises:
    PrepareError: `out` is a file, a non-empty directory that is not a prepare_data output,
      or a finished output (manifest.json) of other arguments (naming each difference).
  """
  path = os.path.join(out, ARGS_FILE)
  if os.path.exists(out) and not os.path.isdir(out):
    raise PrepareError(f"--out={out!r} is a file; give a directory")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      before = json.load(f)
    if before == args:
      return True
    differences = describe_differences(before, args)
    if os.path.exists(os.path.join(out, manifest_lib.MANIFEST_FILE)):
      raise PrepareError(
          f"--out={out!r} holds a finished corpus prepared with other arguments: "
          f"{differences} (see {path}); rerun with the same arguments, or use a new --out")
    logging.warning("--out=%r: continuing an unfinished run with other arguments (%s); input "
                    "files whose size or arguments changed are tokenized again", out,
                    differences)
    _write_json(path, args)
    return False
  if os.path.isdir(out) and os.listdir(out):
    raise PrepareError(f"--out={out!r} is not empty and has no {ARGS_FILE} (not a "
                       "prepare_data output); nothing was written; use a new or empty --out")
  os.makedirs(os.path.join(out, SHARDS_DIR), exist_ok=True)
  _write_json(path, args)
  return True


def _write_json(path: str, value: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def _load_done(out: str, source: int, path: str, size: int, recipe: str,
               trust_legacy: bool) -> dict[str, Any] | None:
  """Source `source`'s done-file if it is for `path` of `size` bytes made with `recipe` (a
  done-file without a recipe only when `trust_legacy`) and its shards are all there with
  their sizes, else None."""
  try:
    with open(done_file(out, source), encoding="utf-8") as f:
      done = json.load(f)
    if done["source"]["path"] != path or done["source"]["bytes"] != size:
      return None
    made_with = done.get("recipe")  # None: written before done-files recorded it
    if made_with != recipe and not (made_with is None and trust_legacy):
      return None
    for shard in done["shards"]:
      if os.path.getsize(os.path.join(out, shard["path"])) != shard["bytes"]:
        return None
      if not os.path.isfile(os.path.join(out, shard["lengths"])):
        return None
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return done


def _remove_unfinished(out: str, sources: set[int]) -> None:
  """Deletes every file an earlier (killed) run left in shards/ for `sources`: complete or
  temporary shards, lengths, a stale done-file. One listing of the directory."""
  shards_dir = os.path.join(out, SHARDS_DIR)
  for name in os.listdir(shards_dir):
    match = re.match(r"(\d+)[-.]", name)
    if match and int(match.group(1)) in sources:
      os.remove(os.path.join(shards_dir, name))


# ----------------------------------------------------------------------------- one source

_TOKENIZERS: dict[str, Any] = {}  # per process: name -> tokenizer
_SHARDS_WRITTEN = [0]  # per process, for EXIT_AFTER_SHARDS_ENV


def _token_ids(tokenizer, text: str, options: PrepareOptions) -> np.ndarray:
  """int32 [n] ids of one document, bos/eos per options (numpy fast path for bytes)."""
  if isinstance(tokenizer, ByteTokenizer):
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids += tokenizer.num_special
  else:
    ids = np.asarray(tokenizer.encode(text), np.int32)
  if options.add_bos or options.add_eos:
    parts = ([np.array([tokenizer.bos_id], np.int32)] if options.add_bos else []) + [ids]
    parts += [np.array([tokenizer.eos_id], np.int32)] if options.add_eos else []
    ids = np.concatenate(parts)
  return ids


class _Shard:
  """One shard being written under its temporary names."""

  def __init__(self, out: str, source: int, part: int):
    self.out, self.path = out, shard_name(source, part)
    self.lengths_path = self.path.removesuffix(".array_record") + ".lengths.npy"
    self._tmp = os.path.join(out, self.path) + ".tmp"
    self._writer = array_record_module.ArrayRecordWriter(self._tmp, WRITER_OPTIONS)
    self.lengths: list[int] = []

  def add(self, ids: np.ndarray) -> None:
    self._writer.write(ids.astype(manifest_lib.TOKEN_DTYPE, copy=False).tobytes())
    self.lengths.append(len(ids))

  def close(self) -> manifest_lib.ShardInfo:
    """Finishes the files, renames them to their final names; returns the ShardInfo."""
    self._writer.close()
    lengths_file = os.path.join(self.out, self.lengths_path)
    with open(lengths_file + ".tmp", "wb") as f:
      np.save(f, np.asarray(self.lengths, np.int32))
    os.replace(lengths_file + ".tmp", lengths_file)
    digest = hashlib.sha256()
    with open(self._tmp, "rb") as f:
      for block in iter(lambda: f.read(1 << 22), b""):
        digest.update(block)
    size = os.path.getsize(self._tmp)
    os.replace(self._tmp, os.path.join(self.out, self.path))
    return manifest_lib.ShardInfo(path=self.path, lengths=self.lengths_path,
                                  documents=len(self.lengths), tokens=int(sum(self.lengths)),
                                  bytes=size, sha256=digest.hexdigest())


class _Aborted(Exception):
  """Another worker failed; this one stops (its source stays undone)."""


def prepare_source(source: int, out: str, path: str, options: PrepareOptions, recipe: str,
                   report: Callable[[int, int], None],
                   stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
  """Writes source `source`'s shards and done-file; returns the done-file's contents.

  `recipe`: `recipe_digest` of the run's arguments, recorded in the done-file (a rerun with
  another recipe redoes the source).

  The caller has removed whatever an earlier run left of this source (`_remove_unfinished`);
  names written here replace any that remain. `report(documents, tokens)`
  is called with increments as it goes; `stop()` true makes it give up (raises _Aborted).

  Raises:
    readers.ReadError: a bad file or record (see `readers.read_documents`).
  """
  if options.tokenizer not in _TOKENIZERS:
    _TOKENIZERS[options.tokenizer] = load_tokenizer(options.tokenizer)
  tokenizer = _TOKENIZERS[options.tokenizer]
  exit_after = int(os.environ.get(EXIT_AFTER_SHARDS_ENV, "0") or 0)
  shards, skipped = [], []
  shard, documents, pending = None, 0, [0, 0, time.monotonic()]
  for text, _ in readers.read_documents(path, options.text_field, options.bad_records,
                                        skipped):
    ids = _token_ids(tokenizer, text, options)
    if not len(ids):
      continue
    if shard is None:
      shard = _Shard(out, source, len(shards))
    shard.add(ids)
    if exit_after and _SHARDS_WRITTEN[0] >= exit_after:
      os._exit(17)  # the test hook: die inside a shard, without cleanup
    documents += 1
    pending[0] += 1
    pending[1] += len(ids)
    if sum(shard.lengths) >= options.shard_tokens:
      shards.append(shard.close())
      _SHARDS_WRITTEN[0] += 1
      shard = None
    if time.monotonic() - pending[2] > _REPORT_SECONDS:
      if stop():
        raise _Aborted()
      report(pending[0], pending[1])
      pending[:] = [0, 0, time.monotonic()]
  if shard is not None:
    shards.append(shard.close())
    _SHARDS_WRITTEN[0] += 1
  report(pending[0], pending[1])
  done = {"source": dataclasses.asdict(manifest_lib.SourceInfo(
              path=path, bytes=os.path.getsize(path), documents=documents)),
          "shards": [dataclasses.asdict(s) for s in shards],
          "skipped_records": len(skipped), "skipped_first": skipped[:_SKIPPED_SHOWN],
          "recipe": recipe}
  _write_json(done_file(out, source), done)
  return done


# ----------------------------------------------------------------------------- driver

def prepare(patterns: Sequence[str], out: str, options: PrepareOptions, num_workers: int = 0,
            progress: bool = True) -> PrepareResult:
  """Prepares (or finishes preparing) `out` from the files matched by `patterns`.

  Args:
    patterns: paths / globs (see `expand_sources`).
    out: the prepared directory (created; or an earlier run's, to resume).
    options: see PrepareOptions.
    num_workers: processes tokenizing sources in parallel (spawned); 0 or 1 = in-process.
    progress: show the tqdm bar on stderr.

  Raises:
    PrepareError: one line naming the file (and line/row) and the fix: bad patterns, bad
      tokenizer, other arguments in an existing --out, a bad input file or record, a worker
      that died, or a corpus with no documents. No manifest is written then.
  """
  start = time.monotonic()
  if num_workers < 0:
    raise PrepareError(f"--num_workers={num_workers} must be >= 0 (0 = in-process)")
  paths = expand_sources(patterns)
  tokenizer = load_tokenizer(options.tokenizer)
  info = tokenizer_info(options.tokenizer, tokenizer)
  args = {"format": manifest_lib.FORMAT, "format_version": manifest_lib.FORMAT_VERSION,
          "tokenizer": dataclasses.asdict(info), **dataclasses.asdict(options),
          "sources": [{"path": p, "bytes": os.path.getsize(p)} for p in paths]}
  same_args = _claim_out(out, args)
  _TOKENIZERS[options.tokenizer] = tokenizer
  recipe = recipe_digest(args)
  done = {i: d for i, (p, s) in enumerate(zip(paths, args["sources"]))
          if (d := _load_done(out, i, p, s["bytes"], recipe, same_args)) is not None}
  tasks = [(i, p) for i, p in enumerate(paths) if i not in done]
  _remove_unfinished(out, {i for i, _ in tasks})
  bar = prepare_pool.Bar(progress, len(paths))
  workers = num_workers if num_workers > 1 and len(tasks) > 1 else 1
  try:
    if workers == 1:
      for source, path in tasks:
        done[source] = prepare_source(source, out, path, options, recipe, report=bar.add)
    else:
      done.update(prepare_pool.run_pool(
          prepare_source, [(i, out, p, options, recipe) for i, p in tasks],
          min(workers, len(tasks)), bar))
  except (readers.ReadError, prepare_pool.WorkerDied) as e:
    raise PrepareError(str(e)) from e
  finally:
    bar.close()
  manifest = manifest_lib.Manifest(
      tokenizer=info, add_bos=options.add_bos, add_eos=options.add_eos,
      text_field=options.text_field,
      sources=tuple(manifest_lib.SourceInfo(**done[i]["source"]) for i in range(len(paths))),
      shards=tuple(manifest_lib.ShardInfo(**s) for i in range(len(paths))
                   for s in done[i]["shards"]))
  if manifest.documents == 0:
    raise PrepareError(f"--source={','.join(patterns)!r} holds no documents (all files empty "
                       "or all records skipped); point it at a non-empty corpus")
  path = manifest_lib.write_manifest(out, manifest)
  return PrepareResult(
      manifest=manifest, manifest_path=path, seconds=time.monotonic() - start,
      documents=sum(done[i]["source"]["documents"] for i, _ in tasks),
      tokens=sum(s["tokens"] for i, _ in tasks for s in done[i]["shards"]),
      sources_done_before=len(paths) - len(tasks),
      skipped_records=sum(d["skipped_records"] for d in done.values()),
      skipped_first=tuple(w for i in sorted(done) for w in done[i]["skipped_first"])[:_SKIPPED_SHOWN],
      workers=workers)
