"""`write_prepared`: a prepared directory (zaya_jax/data/manifest.py format) made directly in a
test with ArrayRecordWriter, np.save and write_manifest, independent of launch.prepare_data."""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig

from array_record.python.array_record_module import ArrayRecordWriter
import numpy as np

from zaya_jax.data import ByteTokenizer
from zaya_jax.data.manifest import (Manifest, ShardInfo, SourceInfo, TokenizerInfo,
                                    write_manifest)

BYTE = ByteTokenizer()


def stdlib_texts(count: int, max_chars: int = 400) -> list[str]:
  """The first `count` non-empty stdlib .py files (sorted paths), each cut to `max_chars`."""
  paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  texts = []
  for path in paths:
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read(max_chars)
    if text:
      texts.append(text)
    if len(texts) == count:
      break
  return texts


def byte_ids(text: str) -> np.ndarray:
  """int32 [n]: [bos] + bytes + [eos] with the byte tokenizer."""
  return np.asarray([BYTE.bos_id, *BYTE.encode(text), BYTE.eos_id], dtype=np.int32)


def write_prepared(directory, texts: list[str], shards: int = 2,
                   tokenizer: TokenizerInfo | None = None) -> list[np.ndarray]:
  """Writes `directory` holding `texts` (byte tokenizer, bos+eos) in `shards` shards.

  Returns the documents' token ids (int32 arrays) in global id order.
  """
  directory = str(directory)
  os.makedirs(os.path.join(directory, "shards"), exist_ok=True)
  docs = [byte_ids(t) for t in texts]
  infos = []
  for part, chunk in enumerate(np.array_split(np.arange(len(docs)), shards)):
    rel = f"shards/test-{part:05d}.array_record"
    writer = ArrayRecordWriter(os.path.join(directory, rel), "group_size:1")
    for i in chunk:
      writer.write(docs[i].astype("<i4").tobytes())
    writer.close()
    lengths = np.asarray([docs[i].size for i in chunk], dtype=np.int32)
    lrel = f"shards/test-{part:05d}.lengths.npy"
    np.save(os.path.join(directory, lrel), lengths)
    with open(os.path.join(directory, rel), "rb") as f:
      data = f.read()
    infos.append(ShardInfo(path=rel, lengths=lrel, documents=int(lengths.size),
                           tokens=int(lengths.sum()), bytes=len(data),
                           sha256=hashlib.sha256(data).hexdigest()))
  tok = tokenizer or TokenizerInfo(name="byte", sha256="byte", vocab_size=BYTE.vocab_size,
                                   bos_id=BYTE.bos_id, eos_id=BYTE.eos_id, pad_id=BYTE.pad_id)
  write_manifest(directory, Manifest(
      tokenizer=tok, add_bos=True, add_eos=True, text_field="text",
      sources=(SourceInfo(path="stdlib", bytes=sum(len(t) for t in texts),
                          documents=len(texts)),),
      shards=tuple(infos)))
  return docs
