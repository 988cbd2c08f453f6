"""The index at scale on synthetic corpora (`zaya_jax.perf.loader_scale`): 10^6 documents with
the true resume anchor (an epoch walked), 10^8 with an estimated one (the open, first batch
and resume do not grow with N), the table, and the synthetic lengths' invariants."""

import numpy as np
import pytest

from zaya_jax.data.synthetic import SyntheticCorpus
from zaya_jax.perf import loader_scale


def test_synthetic_lengths_are_seeded_and_match_the_manifest():
  corpus = SyntheticCorpus(10_000, docs_per_shard=3_000, mean_tokens=50, seed=3)
  assert corpus.num_shards == 4 and list(corpus.shard_docs) == [3000, 3000, 3000, 1000]
  lengths = corpus.shard_lengths(1)
  assert lengths.min() >= 1 and lengths.sum() == 3000 * 50 == corpus.manifest.shards[1].tokens
  np.testing.assert_array_equal(lengths, SyntheticCorpus(10_000, 3_000, 50, 3).shard_lengths(1))
  assert not np.array_equal(lengths, corpus.shard_lengths(2))
  doc = int(corpus.shard_first[2]) + 5
  assert corpus.tokens(doc).size == corpus.shard_lengths(2)[5]


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_million_documents_with_the_true_anchor(tmp_path, packing):
  r = loader_scale.measure_scale(10**6, str(tmp_path), seq_len=1024, batch_size=8, steps=3,
                                 docs_per_shard=1 << 16, mean_tokens=200, packing=packing,
                                 walk=packing == "concat")
  assert r.shards == 16 and r.rows_per_s > 0 and r.resume_row > 0
  assert (r.walk_s is not None) == (packing == "concat")
  text = loader_scale.format_scale([r], required_rows_per_s=100.0)
  assert "1,000,000" in text and f"{r.rows_per_s / 100:.1f}" in text


def test_a_hundred_million_documents_open_in_bounded_time_and_memory(tmp_path):
  r = loader_scale.measure_scale(10**8, str(tmp_path), seq_len=4096, batch_size=8, steps=3,
                                 walk=False)
  assert r.shards == -(-10**8 // (1 << 16))
  assert r.open_s + r.first_batch_s < 10 and r.resume_s < 10
  assert r.rss_end_mib - r.rss_start_mib < 1024  # the old index needed ~4 GB here
