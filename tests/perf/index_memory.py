"""Before/after measurement of the prepared-data index (issue 27): open time and memory.

Not a test (pytest collects test_*.py only): a script that runs against whichever zaya_jax is
on PYTHONPATH, the per-document index of main or the bounded-memory one, on the same
directory:

  PYTHONPATH=. python -m tests.perf.index_memory --write --documents=100000000 --dir=/tmp/c8
  PYTHONPATH=/path/to/main python -m tests.perf.index_memory --documents=100000000 --dir=/tmp/c8
  PYTHONPATH=. python -m tests.perf.index_memory --documents=100000000 --dir=/tmp/c8

--write makes a prepared directory from lengths alone: a `.lengths.npy` per shard (seeded
lengths, mean 1400 tokens), an empty ArrayRecord file per shard (its manifest size is 0) and
manifest.json. Measuring prints one JSON line: open_s (manifest + lengths + split), first_s
(the row index and the pieces of the first 32 rows, no record read), resume_s (a fresh index
and the pieces of 32 rows at 0.95 of epoch 0; the new index from a saved anchor, after
walk_s to find it), rss_mib after each phase and the peak (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from zaya_jax.data import manifest as manifest_lib
from zaya_jax.data import prepared

T, B, EVAL = 4096, 32, 0.02


def memory_mib() -> tuple[float, float]:
  out = {}
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.split(":")[0] in ("VmRSS", "VmHWM"):
        out[line.split(":")[0]] = int(line.split()[1]) / 1024
  return out["VmRSS"], out["VmHWM"]


def write(directory: str, documents: int, per_shard: int) -> None:
  os.makedirs(os.path.join(directory, "shards"), exist_ok=True)
  shards = []
  for s, first in enumerate(range(0, documents, per_shard)):
    n = min(per_shard, documents - first)
    lengths = np.random.default_rng([0, s]).geometric(1 / 1400, size=n).astype(np.int32)
    rel = f"shards/s-{s:06d}"
    np.save(os.path.join(directory, rel + ".lengths.npy"), lengths)
    open(os.path.join(directory, rel + ".array_record"), "wb").close()
    shards.append(manifest_lib.ShardInfo(path=rel + ".array_record", lengths=rel + ".lengths.npy",
                                         documents=n, tokens=int(lengths.sum(dtype=np.int64)),
                                         bytes=0, sha256=""))
  manifest_lib.write_manifest(directory, manifest_lib.Manifest(
      tokenizer=manifest_lib.TokenizerInfo("byte", "byte", 259, 1, 2, 0), add_bos=True,
      add_eos=True, text_field="text",
      sources=(manifest_lib.SourceInfo("lengths-only", 0, documents),), shards=tuple(shards)))


def measure(directory: str) -> dict:
  out = {"rss_start_mib": memory_mib()[0]}
  t = time.perf_counter()
  corpus = prepared.PreparedCorpus(directory, EVAL)
  out["open_s"], out["rss_open_mib"] = time.perf_counter() - t, memory_mib()[0]
  new = hasattr(corpus, "shard_split")
  out["index"] = "bounded-memory" if new else "per-document"
  from zaya_jax.data import global_index  # pylint: disable=import-outside-toplevel

  def index():
    if new:
      return global_index.ConcatRows(corpus, T, 0, 0)
    return global_index.ConcatRows(corpus.pairs, corpus.train_ids, T, 0, 0)

  t = time.perf_counter()
  rows = index()
  first = [rows.row(r) for r in range(B)]
  out["first_s"], out["rss_first_mib"] = time.perf_counter() - t, memory_mib()[0]
  pairs = (corpus.tokens_total - len(corpus)) if new else int(corpus.pairs.sum())
  resume = int(0.95 * pairs * (1 - EVAL)) // T
  if new:
    t = time.perf_counter()
    anchor = rows.anchor(resume)
    out["walk_s"] = time.perf_counter() - t
  t = time.perf_counter()
  fresh = index()
  if new:
    fresh.add_anchor(anchor)
  late = [fresh.row(r) for r in range(resume, resume + B)]
  out["resume_s"] = time.perf_counter() - t
  out["rss_end_mib"], out["peak_mib"] = memory_mib()
  out["documents"], out["resume_row"] = len(corpus), resume
  out["pieces"] = sum(len(p) for p in first + late)
  return out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--documents", type=int, required=True)
  parser.add_argument("--per_shard", type=int, default=1 << 16)
  parser.add_argument("--write", action="store_true")
  args = parser.parse_args()
  if args.write:
    write(args.dir, args.documents, args.per_shard)
  else:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in measure(args.dir).items()}))


if __name__ == "__main__":
  main()
