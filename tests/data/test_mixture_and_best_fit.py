"""data.mixture and data.packing="best_fit" through `make_train_iterator` on prepared
directories: measured mixture weights, exact resume (with and without loader workers), a
mixture changed on resume continues every source, best-fit rows hold whole documents, and the
model sees a best-fit row's documents exactly as it sees each alone."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from tests.data.prepared_corpus import write_prepared
from tests.helpers import assert_close, random_model, tiny_model_config
from tests.train.inproc import tiny_run_config
from zaya_jax.data import ByteTokenizer, DataConfig, make_train_iterator
from zaya_jax.train import run
from zaya_jax.train.metrics import read_metrics

A, B = ByteTokenizer().encode("a")[0], ByteTokenizer().encode("b")[0]
T = 32  # seq_len


def _texts(letter: str, count: int, seed: int) -> list[str]:
  """`count` documents of `letter` repeated 20-200 times, each made unique by a number."""
  rng = np.random.default_rng(seed)
  return [f"{i}:" + letter * int(n) for i, n in enumerate(rng.integers(20, 200, count))]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  root = tmp_path_factory.mktemp("mix")
  write_prepared(root / "a", _texts("a", 300, 0))
  write_prepared(root / "b", _texts("b", 300, 1))
  return str(root / "a"), str(root / "b")


def _iterator(cfg: DataConfig, batch_size: int = 8, seed: int = 0):
  return make_train_iterator(cfg, seq_len=T, batch_size=batch_size, seed=seed)


def _source_of_rows(batch) -> list[str]:
  """'a' or 'b' per row: the letter that fills its tokens (rows never mix sources)."""
  out = []
  for inputs, mask in zip(batch["inputs"], batch["loss_mask"]):
    tokens = inputs[mask > 0]
    n_a, n_b = int(np.sum(tokens == A)), int(np.sum(tokens == B))
    assert n_a == 0 or n_b == 0, "a row mixes the two sources"
    out.append("a" if n_a else "b")
  return out


def _mixture(corpora, weights=(0.7, 0.3), **kw) -> DataConfig:
  a, b = corpora
  return DataConfig(mixture=f"{a}:{weights[0]},{b}:{weights[1]}", tokenizer="byte",
                    eval_fraction=0.0, **kw)


def test_mixture_weights_measured_over_batches(corpora):
  it = _iterator(_mixture(corpora))
  sources = [s for _ in range(250) for s in _source_of_rows(next(it))]  # 2000 rows
  share_a = sources.count("a") / len(sources)
  assert abs(share_a - 0.7) < 0.01, share_a
  # Many switches: the sources interleave, they do not come in long runs.
  assert sum(x != y for x, y in zip(sources, sources[1:])) > 500


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mixture_resume_equals_an_uninterrupted_run(corpora, num_workers):
  if num_workers and not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  first = _iterator(_mixture(corpora))
  for _ in range(5):
    next(first)
  state = first.get_state()
  want = [next(first) for _ in range(4)]
  resumed = _iterator(_mixture(corpora, num_workers=num_workers))
  resumed.set_state(state)
  for got, ref in zip([next(resumed) for _ in range(4)], want):
    for key in ref:
      np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


def test_changed_mixture_on_resume_continues_every_source(corpora):
  """A resume with weights 0.2/0.8 is a new phase: source a's rows before and after it are
  exactly the first rows of source a alone, none repeated or skipped."""
  a_dir, _ = corpora
  first = _iterator(_mixture(corpora))
  before = [next(first) for _ in range(6)]
  resumed = _iterator(_mixture(corpora, weights=(0.2, 0.8)))
  resumed.set_state(first.get_state())
  after = [next(resumed) for _ in range(40)]
  rows_of_a = [row for batch in before + after for row, s in
               zip(batch["inputs"], _source_of_rows(batch)) if s == "a"]
  share_after = sum(s == "a" for b in after for s in _source_of_rows(b)) / (40 * 8)
  assert abs(share_after - 0.2) < 0.02, share_after
  alone = _iterator(DataConfig(source=a_dir, tokenizer="byte", eval_fraction=0.0), batch_size=1)
  want = [next(alone)["inputs"][0] for _ in range(len(rows_of_a))]
  np.testing.assert_array_equal(np.stack(rows_of_a), np.stack(want))


@pytest.fixture(scope="module")
def best_fit_corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("bf")
  rng = np.random.default_rng(3)
  texts = [f"{i}:" + "xyz"[i % 3] * int(n) for i, n in enumerate(rng.integers(2, 40, 200))]
  texts.append("long:" + "q" * 100)  # longer than T: truncated to its first T pairs
  docs = write_prepared(root / "c", texts)
  return str(root / "c"), docs


def test_best_fit_rows_hold_whole_documents(best_fit_corpus):
  directory, docs = best_fit_corpus
  cfg = DataConfig(source=directory, tokenizer="byte", eval_fraction=0.0, packing="best_fit",
                   best_fit_window=64)
  it = _iterator(cfg)
  by_prefix = {tuple(d[:4]): d for d in docs}  # bos + the unique "N:" prefix
  seen, padding = 0, []
  for _ in range(8):
    batch = next(it)
    padding.append(1.0 - batch["loss_mask"].mean())
    for r in range(batch["inputs"].shape[0]):
      seg = batch["segment_ids"][r]
      np.testing.assert_array_equal(batch["loss_mask"][r], (seg > 0).astype(np.float32))
      for s in range(1, seg.max() + 1):
        where = np.flatnonzero(seg == s)
        inputs, targets = batch["inputs"][r, where], batch["targets"][r, where]
        np.testing.assert_array_equal(batch["positions"][r, where], np.arange(where.size))
        doc = by_prefix[tuple(inputs[:4])]
        n = min(doc.size - 1, T)  # whole document, or the first T pairs of a long one
        assert where.size == n, (where.size, doc.size)
        np.testing.assert_array_equal(inputs, doc[:n])
        np.testing.assert_array_equal(targets, doc[1:n + 1])
        seen += 1
  assert seen > 64 and 0.0 < float(np.mean(padding)) < 0.5


@pytest.mark.slow
def test_model_sees_a_best_fit_rows_documents_as_alone(best_fit_corpus):
  directory, _ = best_fit_corpus
  cfg = DataConfig(source=directory, tokenizer="byte", eval_fraction=0.0, packing="best_fit",
                   best_fit_window=64)
  it = _iterator(cfg)
  batches = [next(it) for _ in range(8)]
  batch = max(batches, key=lambda b: b["segment_ids"].max())
  r = int(np.argmax(batch["segment_ids"].max(axis=1)))  # the row with the most documents
  seg, inputs, positions = batch["segment_ids"][r], batch["inputs"][r], batch["positions"][r]
  assert seg.max() >= 2
  model = random_model(dataclasses.replace(tiny_model_config(), vocab_size=320))
  packed = np.asarray(model(jnp.asarray(inputs[None]), jnp.asarray(seg[None]),
                            jnp.asarray(positions[None])))[0]
  for s in range(1, seg.max() + 1):
    where = np.flatnonzero(seg == s)
    alone = np.asarray(model(jnp.asarray(inputs[where][None]),
                             jnp.ones((1, where.size), jnp.int32),
                             jnp.arange(where.size, dtype=jnp.int32)[None]))[0]
    assert_close(f"document {s} packed vs alone", packed[where], alone, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_training_on_a_mixture(corpora, tmp_path, caplog):
  """`run` on data.mixture: eval reported per source (the overall loss their token-weighted
  mean); stopped at step 4 and resumed with other weights, the checkpointed data state holds
  the new phase from global row 4 * B."""

  a, b = corpora

  def config(weights, **train):
    c = tiny_run_config(num_steps=6, eval_batches=1, **train)
    c.data.mixture, c.data.eval_fraction = f"{a}:{weights[0]},{b}:{weights[1]}", 0.1
    return c

  run(config((0.7, 0.3), max_steps_per_run=4), str(tmp_path))
  with caplog.at_level("WARNING"):
    run(config((0.3, 0.7)), str(tmp_path))
  assert any("data.mixture changed at global row 8" in r.getMessage() for r in caplog.records)
  with open(tmp_path / "checkpoints" / "6" / "data_iter" / "process_0-of-1.json") as f:
    state = json.load(f)
  phases = state["mixture"]["phases"]
  assert [p["start_row"] for p in phases] == [0, 4 * 2] and phases[1]["weights"] == [0.3, 0.7]
  assert sum(phases[1]["offsets"]) == 8 and phases[1]["offsets"][0] >= 5  # 0.7 of 8 rows
  final = [r for r in read_metrics(str(tmp_path)) if r["kind"] == "eval"][-1]
  parts = final["sources"]
  assert set(parts) == {"a", "b"} and all(p["tokens"] > 0 for p in parts.values())
  mean = sum(p["loss"] * p["tokens"] for p in parts.values()) / final["tokens"]
  assert final["loss"] == pytest.approx(mean, rel=1e-9)
  assert parts["a"]["loss"] != pytest.approx(parts["b"]["loss"], rel=1e-3)  # distinct corpora


def test_a_source_beside_a_mixture_is_named_as_unread(corpora, caplog):
  """data.mixture replaces data.source: a source given as well (not the default "stdlib") is
  not read, and `resolve` says so (it was silent; found by a new-user trial, 2026-12-07)."""
  from absl import logging as absl_logging

  from configs import zaya1_tiny
  from zaya_jax.config import resolve
  a, b = corpora
  config = zaya1_tiny.get_config()
  config.data.mixture = f"{a}:0.6,{b}:0.4"
  with caplog.at_level("WARNING", logger=absl_logging.get_absl_logger().name):
    resolve(config)  # the default source beside a mixture: nothing to say
    assert not [r for r in caplog.records if "data.mixture is set" in r.getMessage()]
    config.data.source = b
    resolve(config)
  assert [r.getMessage() for r in caplog.records if "data.mixture is set" in r.getMessage()] == [
      f"data.mixture is set, so data.source={b!r} is not read (the mixture replaces it); "
      "drop one of them to silence this"]
