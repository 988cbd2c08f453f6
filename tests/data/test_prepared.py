"""Training data from a prepared directory: the global sample index and its iterator.

# Shapes: B global batch rows, b = B / P rows per process, T sequence length.

The corpus is written here directly (tests/data/prepared_corpus.py: ArrayRecordWriter, lengths,
write_manifest) from a few hundred stdlib documents with the byte tokenizer. The reference
for the rows is a direct numpy concat-and-cut of the documents in each epoch's permutation.
"""

from __future__ import annotations

import dataclasses
import json

import os

from absl import flags
import numpy as np
import pytest

from configs import zaya1_tiny
from tests.data.prepared_corpus import stdlib_texts, write_prepared
from zaya_jax import data
from zaya_jax.checkpoint import compat
from zaya_jax.config import ConfigError, resolve
from zaya_jax.data import global_index, global_iterator, prepared, row_shuffle
from zaya_jax.data.manifest import TokenizerInfo

T, b, P, SEED = 32, 4, 2, 3
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  directory = tmp_path_factory.mktemp("prepared")
  docs = write_prepared(directory, stdlib_texts(300, max_chars=150), shards=3)
  return str(directory), docs


def _cfg(directory, **kw):
  kw.setdefault("shuffle_seed", 5)
  return data.DataConfig(source=directory, eval_fraction=0.1, **kw)


def _iters(directory, processes=P, rows=b, **kw):
  return [data.make_train_iterator(_cfg(directory, **kw), seq_len=T, batch_size=rows, seed=SEED,
                                   process_index=p, process_count=processes)
          for p in range(processes)]


def _global(iters):
  """The next global batch: the processes' slices concatenated in process order."""
  parts = [next(it) for it in iters]
  return {k: np.concatenate([x[k] for x in parts]) for k in KEYS}


def _split_ids(opened):
  """(train ids, eval ids) int64, sorted: the split read shard by shard (O(N): tests only)."""
  train = [opened.shard_first[s] + np.flatnonzero(opened.shard_split(s)[2])
           for s in range(opened.num_shards)]
  held = [opened.shard_first[s] + np.flatnonzero(~opened.shard_split(s)[2])
          for s in range(opened.num_shards)]
  return np.concatenate(train), np.concatenate(held)


def _reference_rows(docs, order, num_rows):
  """Direct concat-and-cut of the documents in `order`: [num_rows, T] of each key."""
  inputs = np.concatenate([docs[d][:-1] for d in order])
  targets = np.concatenate([docs[d][1:] for d in order])
  which = np.concatenate([np.full(docs[d].size - 1, k) for k, d in enumerate(order)])
  n = num_rows * T
  which_RT = which[:n].reshape(num_rows, T)
  new_RT = np.ones_like(which_RT, dtype=bool)
  new_RT[:, 1:] = which_RT[:, 1:] != which_RT[:, :-1]
  segment_RT = np.cumsum(new_RT, axis=1).astype(np.int32)
  start_RT = np.maximum.accumulate(np.where(new_RT, np.arange(T), 0), axis=1)
  return {"inputs": inputs[:n].reshape(num_rows, T), "targets": targets[:n].reshape(num_rows, T),
          "segment_ids": segment_RT, "positions": (np.arange(T) - start_RT).astype(np.int32),
          "loss_mask": np.ones((num_rows, T), np.float32)}


def test_rows_are_the_epochs_concatenated_and_cut(corpus):
  directory, docs = corpus
  opened = prepared.PreparedCorpus(directory, 0.1)
  index = global_index.ConcatRows(opened, T, 5, SEED)
  pairs_per_epoch = index.pairs_per_epoch()
  steps = -(-3 * pairs_per_epoch // (2 * P * b * T))  # 1.5 epochs: a row straddles epochs
  iters = _iters(directory, shuffle_rows=False)
  got = [_global(iters) for _ in range(steps)]
  got = {k: np.concatenate([g[k] for g in got]) for k in KEYS}
  order = np.concatenate([index.epoch_documents(e) for e in range(2)])
  want = _reference_rows(docs, order, steps * P * b)
  for k in KEYS:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  train_ids, _ = _split_ids(opened)
  assert sorted(order[:train_ids.size]) == list(train_ids)
  assert not np.array_equal(order[:train_ids.size], order[train_ids.size:])


def test_every_train_document_once_per_epoch_across_processes(corpus):
  directory, docs = corpus
  opened = prepared.PreparedCorpus(directory, 0.1)
  rows = global_index.ConcatRows(opened, T, 5, SEED)
  epoch_rows, tail = divmod(rows.pairs_per_epoch(), T)  # rows wholly inside epoch 0, the rest
  seen: dict[int, list[tuple[int, int]]] = {}
  for r in range(epoch_rows + 1):
    left = T if r < epoch_rows else tail  # the straddling row: its first `tail` pairs
    for doc, start, stop in rows.row(r):
      if left <= 0:
        break
      stop = min(stop, start + left)
      left -= stop - start
      seen.setdefault(doc, []).append((start, stop))
  assert sorted(seen) == list(_split_ids(opened)[0])
  for doc, spans in seen.items():  # pieces of one document tile it exactly once, in order
    flat = [x for span in spans for x in span]
    assert flat[0] == 0 and flat[-1] == docs[doc].size - 1, (doc, spans)
    assert all(flat[i] == flat[i + 1] for i in range(1, len(flat) - 1, 2)), (doc, spans)
  # The two processes' slices of a global batch are disjoint rows of that index.
  a, c = _iters(directory, shuffle_rows=False)
  first_a, first_c = next(a), next(c)
  want = _reference_rows(docs, rows.epoch_documents(0), 2 * b)["inputs"]
  np.testing.assert_array_equal(first_a["inputs"], want[:b])
  np.testing.assert_array_equal(first_c["inputs"], want[b:])


@pytest.mark.parametrize("window", [2, 7, row_shuffle.SMALL_WINDOW - 1, row_shuffle.SMALL_WINDOW])
def test_shuffled_row_is_a_keyed_bijection_of_each_window(window):
  """Both ways of permuting a window (whole below SMALL_WINDOW, grain's index_shuffle per row
  from it): each window is a permutation of its own rows, windows and seeds differ, and the
  same arguments give the same row (the cached small permutations are not changed by use)."""
  windows = 8 if window < 100 else 2
  def perms(seeds):
    seed = row_shuffle.window_seed(seeds)
    got = [row_shuffle.shuffled_row(r, window, seed) for r in range(windows * window)]
    return [[g - w * window for g in got[w * window:(w + 1) * window]] for w in range(windows)]
  got = perms((5, 7))
  assert all(sorted(p) == list(range(window)) for p in got)
  assert any(p != list(range(window)) for p in got)
  assert any(p != got[0] for p in got[1:])
  assert perms((6, 7)) != got
  assert perms((5, 7)) == got


def test_shuffled_rows_permute_each_window_on_any_process_count(corpus):
  """data.shuffle_rows: global batches hold the unshuffled index's rows permuted within each
  window of W rows (W capped at one epoch's rows), the same on 1 and 2 processes, and fewer
  row pairs of a batch share a document than without the shuffle."""
  directory, _ = corpus
  opened = prepared.PreparedCorpus(directory, 0.1)
  plain = global_index.ConcatRows(opened, T, 5, SEED)
  window = 16
  cfg = _cfg(directory, shuffle_window=window)
  assert global_iterator.shuffle_window(cfg, opened, T) == window  # below one epoch's rows
  steps = 3 * window // (P * b)  # 3 windows
  iters2 = _iters(directory, shuffle_window=window)
  iters1 = _iters(directory, processes=1, rows=P * b, shuffle_window=window)
  got2 = [_global(iters2) for _ in range(steps)]
  got1 = [_global(iters1) for _ in range(steps)]
  for k in KEYS:
    np.testing.assert_array_equal(np.concatenate([g[k] for g in got1]),
                                  np.concatenate([g[k] for g in got2]), err_msg=k)
  rows = row_shuffle.ShuffledRows(plain, window, (5, SEED))
  physical = [rows.physical(r) for r in range(3 * window)]
  for w in range(3):
    assert sorted(physical[w * window:(w + 1) * window]) == list(range(w * window,
                                                                       (w + 1) * window))
  assert physical != list(range(3 * window))
  want = global_iterator.assemble_rows([(0, rows.row(r)) for r in range(3 * window)], [opened],
                                       T, opened.tokenizer.pad_id)
  np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got2]), want["inputs"])
  batch = P * b
  share = lambda index: row_shuffle.same_document_share(
      [[index.row(s * batch + i) for i in range(batch)] for s in range(steps)])
  assert share(rows) < share(plain)


def test_eval_split_disjoint_and_process_independent(corpus):
  directory, docs = corpus
  opened = prepared.PreparedCorpus(directory, 0.1)
  train_ids, eval_ids = _split_ids(opened)
  assert np.intersect1d(train_ids, eval_ids).size == 0
  assert np.array_equal(np.union1d(train_ids, eval_ids), np.arange(len(docs)))
  assert 0.04 < eval_ids.size / len(docs) < 0.2
  # The split is the per-document hash of the global id (unchanged from the first index).
  np.testing.assert_array_equal(eval_ids, np.flatnonzero(
      prepared.eval_scores(np.arange(len(docs))) < 0.1))
  pairs = sum(docs[d].size - 1 for d in eval_ids)
  ordered = None
  for shuffled in (False, True):
    cfg = _cfg(directory, shuffle_eval=shuffled)
    one = data.make_eval_batches(cfg, seq_len=T, batch_size=P * b, max_batches=50)
    two = [data.make_eval_batches(cfg, seq_len=T, batch_size=b, max_batches=50,
                                  process_index=p, process_count=P) for p in range(P)]
    assert len(one) == len(two[0]) == len(two[1])
    assert len(one) == -(-pairs // (P * b * T))
    for k in KEYS:
      np.testing.assert_array_equal(np.concatenate([x[k] for x in one]),
                                    np.concatenate([y[k] for pair in zip(*two) for y in pair]))
    rows = [(x["inputs"][i], x["loss_mask"][i]) for x in one for i in range(P * b)]
    assert sum(int(m.sum()) for _, m in rows) == pairs
    real = -(-pairs // T)  # rows holding tokens; the rest, at the end, are padding rows
    assert all(m.sum() > 0 for _, m in rows[:real]) and all(m.sum() == 0 for _, m in rows[real:])
    if not shuffled:  # the split's documents in id order, the last batch padded
      tokens = np.concatenate([x["inputs"][x["loss_mask"] > 0] for x in one])
      np.testing.assert_array_equal(tokens, np.concatenate([docs[d][:-1] for d in eval_ids]))
      assert one[-1]["loss_mask"].sum() == pairs - (len(one) - 1) * P * b * T
      ordered = [r.tobytes() for r, m in rows if m.sum()]
      continue
    # data.shuffle_eval: the same rows in another order, a function of data.shuffle_seed
    # alone; the window permutes within itself (window 3: the first three rows stay first).
    got = [r.tobytes() for r, m in rows if m.sum()]
    assert sorted(got) == sorted(ordered) and got != ordered
    again = data.make_eval_batches(cfg, seq_len=T, batch_size=P * b, max_batches=50)
    np.testing.assert_array_equal(again[0]["inputs"], one[0]["inputs"])
    other = data.make_eval_batches(_cfg(directory, shuffle_eval=True, shuffle_seed=6),
                                   seq_len=T, batch_size=P * b, max_batches=50)
    assert not np.array_equal(other[0]["inputs"], one[0]["inputs"])
    small = data.make_eval_batches(_cfg(directory, shuffle_window=3), seq_len=T, batch_size=1,
                                   max_batches=len(ordered))
    got3 = [x["inputs"][0].tobytes() for x in small]
    assert sorted(got3[:3]) == sorted(ordered[:3]) and sorted(got3) == sorted(ordered)
    first = data.make_eval_batches(cfg, seq_len=T, batch_size=P * b, max_batches=1)
    np.testing.assert_array_equal(first[0]["inputs"], one[0]["inputs"])  # a prefix of the sample


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_and_on_another_process_count(corpus, workers):
  directory, _ = corpus
  if workers:
    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (absl.app.run does this)
  reference = _iters(directory, processes=1, rows=P * b)[0]
  expected = [next(reference) for _ in range(8)]
  iters = _iters(directory, num_workers=workers)
  for k in range(3):
    got = _global(iters)
    for key in KEYS:
      np.testing.assert_array_equal(got[key], expected[k][key], err_msg=f"{workers} {key}")
  states = [it.get_state() for it in iters]
  assert states[0] == states[1]
  assert states[0]["global_batch"] == 3 and states[0]["next_row"] == 3 * P * b
  # Same process count, fresh iterators: the same following global batches (in-process
  # readers: each worker pipeline costs seconds of process start on a 2-core machine).
  again = _iters(directory)
  for it, state in zip(again, states):
    it.set_state(state)
  # One process (with B = P*b rows) from the two-process state.
  single = _iters(directory, processes=1, rows=P * b, num_workers=workers)[0]
  single.set_state(states[0])
  for k in range(3, 6):
    got, alone = _global(again), next(single)
    for key in KEYS:
      np.testing.assert_array_equal(got[key], expected[k][key], err_msg=f"{workers} {key}")
      np.testing.assert_array_equal(alone[key], expected[k][key], err_msg=f"{workers} {key}")
  assert single.get_state()["global_batch"] == 6
  # And back: the one-process state restored on two processes.
  two = _iters(directory)
  for it in two:
    it.set_state(single.get_state())
  for k in range(6, 8):
    got = _global(two)
    for key in KEYS:
      np.testing.assert_array_equal(got[key], expected[k][key], err_msg=f"1 -> 2 {key}")


def test_state_refuses_another_seq_len_and_compat_keeps_it_across_process_counts(corpus):
  directory, _ = corpus
  it = _iters(directory, processes=1)[0]
  next(it)
  state = it.get_state()
  other = data.make_train_iterator(_cfg(directory), seq_len=T + 1, batch_size=b, seed=SEED)
  with pytest.raises(ValueError, match="rows of 32 tokens"):
    other.set_state(state)
  cfg = resolve(zaya1_tiny.get_config())
  saved = {"runtime": {"process_count": 4}, "data": {"num_workers": 3},
           "train": {"seq_len": cfg.train.seq_len}}
  assert compat.data_restart_reason(saved, cfg, it) is None
  saved["train"]["seq_len"] += 1
  assert "train.seq_len changed" in compat.data_restart_reason(saved, cfg, it)


def test_a_position_of_the_other_kind_of_pipeline_restarts_the_data_order(corpus, tmp_path):
  """data.source changed between a prepared corpus and raw text on resume: the saved position
  is the other pipeline's (a zaya-global state against grain's), which the iterator cannot
  take. Found by a new-user trial (2026-12-07): it failed every checkpoint as unreadable
  ("TypeError: _CtsState.__init__() got an unexpected keyword argument 'format'", then
  "repair or replace the files"); it now restarts the data order, as a run-shape change."""
  directory, _ = corpus
  prepared = _iters(directory, processes=1)[0]
  next(prepared)
  cfg = resolve(zaya1_tiny.get_config())  # data.source="stdlib": raw text
  raw = data.make_train_iterator(cfg.data, seq_len=T, batch_size=b, seed=SEED)
  next(raw)
  saved = {"runtime": {"process_count": 1}, "data": dict(cfg.data.__dict__),
           "train": {"seq_len": T}}
  cfg_t = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=T))
  for name, state in (("prepared", prepared.get_state()), ("raw", raw.get_state())):
    step = tmp_path / name
    (step / "data_iter").mkdir(parents=True)
    (step / "data_iter" / "process_0-of-1.json").write_text(json.dumps(state))
  assert compat.saved_data_state_is_global(str(tmp_path / "prepared"), saved) is True
  assert compat.saved_data_state_is_global(str(tmp_path / "raw"), saved) is False
  assert compat.saved_data_state_is_global(str(tmp_path / "absent"), saved) is None
  assert compat.data_restart_reason(saved, cfg_t, raw, saved_global=True) == (
      "it holds a prepared corpus's global batch position and this run reads raw text "
      "(data.source='stdlib'), whose iterator cannot take it")
  reason = compat.data_restart_reason(saved, cfg_t, prepared, saved_global=False)
  assert reason.startswith("it holds a raw-text pipeline's position and this run reads "
                           "prepared data"), reason
  # the same kind: applied as before
  assert compat.data_restart_reason(saved, cfg_t, prepared, saved_global=True) is None
  assert compat.data_restart_reason(saved, cfg_t, raw, saved_global=False) is None
  with pytest.raises(Exception):  # what the restore did before: the other kind's state
    raw.set_state(prepared.get_state())


def _one_line_error(match, fn):
  with pytest.raises(ValueError, match=match) as info:
    fn()
  assert "\n" not in str(info.value), str(info.value)
  return str(info.value)


def test_bad_input_one_line_errors(corpus, tmp_path):
  directory, _ = corpus
  make = lambda d, **kw: data.make_train_iterator(_cfg(str(d), **kw), seq_len=T, batch_size=b,
                                                  seed=0)
  (tmp_path / "empty").mkdir()
  _one_line_error(r"data\.source=.*empty.* is a directory without manifest\.json.*"
                  r"launch\.prepare_data", lambda: make(tmp_path / "empty"))
  truncated = tmp_path / "truncated"
  write_prepared(truncated, stdlib_texts(20, 100), shards=2)
  shard = sorted((truncated / "shards").glob("*.array_record"))[1]
  shard.write_bytes(shard.read_bytes()[:-7])
  _one_line_error(r"data\.source=.*test-00001\.array_record: \d+ bytes, the manifest says",
                  lambda: make(truncated))
  altered = tmp_path / "altered"
  write_prepared(altered, stdlib_texts(20, 100), shards=2)
  shard = sorted((altered / "shards").glob("*.array_record"))[0]
  raw = bytearray(shard.read_bytes())
  raw[len(raw) // 3] ^= 0xFF
  shard.write_bytes(bytes(raw))
  held = tmp_path / "held"
  write_prepared(held, stdlib_texts(5, 100), shards=1)
  _one_line_error(r"data\.source=.*held.*holds no train token pair .*lower data\.eval_fraction",
                  lambda: data.make_train_iterator(data.DataConfig(
                      source=str(held), eval_fraction=0.9999), seq_len=T, batch_size=b, seed=0))
  make(altered)  # sizes agree: opened without data.verify_checksums
  _one_line_error(r"test-00000\.array_record: sha256 differs",
                  lambda: make(altered, verify_checksums=True))
  assert shard.read_bytes() == bytes(raw)  # nothing written over


def test_tokenizer_must_match_the_model(corpus, tmp_path):
  directory, _ = corpus
  config = zaya1_tiny.get_config()
  config.data.source = directory
  run = resolve(config)  # the byte tokenizer's sizes: accepted
  assert run.data.source == directory
  big = tmp_path / "big_vocab"
  write_prepared(big, stdlib_texts(10, 50), shards=1, tokenizer=TokenizerInfo(
      name="/x/tokenizer.json", sha256="ab", vocab_size=262_144, bos_id=2, eos_id=106,
      pad_id=0))
  config.data.source = str(big)
  with pytest.raises(ConfigError, match=r"model\.vocab_size=\d+ < the vocab 262144 .*"
                     r"data\.source=.*big_vocab.*--config\.model\.vocab_size=262144") as e:
    resolve(config)
  assert "\n" not in str(e.value)
  shifted = tmp_path / "bos"
  write_prepared(shifted, stdlib_texts(10, 50), shards=1, tokenizer=TokenizerInfo(
      name="byte", sha256="byte", vocab_size=259, bos_id=7, eos_id=2, pad_id=0))
  config.data.source = str(shifted)
  with pytest.raises(ConfigError, match=r"model\.bos_token_id=1 but the bos_id of its "
                     r"tokenizer is 7 .*--config\.model\.bos_token_id=7"):
    resolve(config)


def test_console_summary_uses_the_manifest(corpus):
  from zaya_jax.train import console  # pylint: disable=import-outside-toplevel
  directory, docs = corpus
  text = console.data_summary(_cfg(directory), 1000)
  n = len(docs)  # expected counts from the manifest: 0.9 and 0.1 of its documents
  assert text.startswith(f"{directory}: ~{console.si(0.9 * n)} train documents")
  assert text.endswith(f", ~{console.si(0.1 * n)} eval documents (of {n:,})")
  assert os.path.basename(directory) in text


def test_resume_late_walks_from_the_saved_anchor(corpus):
  """A resumed iterator locates its rows from the state's anchor (the shard boundary before
  its row-shuffle window), not by walking every shard from row 0, and gives the same batches."""
  directory, _ = corpus
  first = _iters(directory, processes=1, rows=32, shuffle_window=128)[0]
  for _ in range(15):  # 480 rows (of ~700 per epoch): past the first shard of 3
    next(first)
  state = first.get_state()
  (e, k, pair), = state["anchors"]
  assert k > 0 and 0 < pair <= state["next_row"] * T
  resumed = _iters(directory, processes=1, rows=32, shuffle_window=128)[0]
  resumed.set_state(state)
  for _ in range(3):
    want, got = next(first), next(resumed)
    for key in KEYS:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  walk = resumed.rows.rows.rows.walk  # SingleSource -> ShuffledRows -> ConcatRows
  starts = {seg.bounds[0]: seg for seg in walk._segments}  # pylint: disable=protected-access
  assert (starts[pair].epoch, starts[pair].k0) == (e, k)
  assert len(starts[0].bounds) <= 2  # from row 0: only row 0's shard (the open-time check)


def test_v1_state_is_refused_naming_the_migration_or_restarted(corpus, caplog):
  directory, _ = corpus
  v1 = {"format": "zaya-global-v1", "global_batch": 7, "next_row": 7 * b, "seq_len": T,
        "data": {}}
  it = _iters(directory, processes=1)[0]
  _one_line_error(r"zaya-global-v1 state .*--config\.data\.v1_state=restart",
                  lambda: it.set_state(v1))
  with pytest.raises(ValueError, match="must be 'refuse' or 'restart'"):
    _cfg(directory, v1_state="continue")
  restarted = _iters(directory, processes=1, v1_state="restart")[0]
  with caplog.at_level("WARNING"):
    restarted.set_state(v1)
  assert any("restarts at row 0" in r.getMessage() for r in caplog.records)
  want, got = next(_iters(directory, processes=1)[0]), next(restarted)  # row 0 again
  for key in KEYS:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  state = restarted.get_state()
  assert (state["format"], state["global_batch"], state["next_row"]) == ("zaya-global-v2", 8, b)


def test_checkpointer_reports_a_refused_data_state_as_a_config_error():
  """A refused data position is a user error (one line, `launch.train`'s "invalid config"),
  not a corrupt checkpoint: the checkpointer would try older steps and list them all."""
  from zaya_jax.checkpoint.checkpointer import Checkpointer  # pylint: disable=import-outside-toplevel

  def refuse():
    raise global_iterator.DataStateError("data.v1_state=restart")

  with pytest.raises(ConfigError, match="data.v1_state=restart"):
    Checkpointer._phase(None, refuse, "reading the data position")  # pylint: disable=protected-access
