"""launch.prepare_data / zaya_jax.data.prepare: a corpus of .jsonl, .jsonl.gz, .txt and parquet
tokenized into ArrayRecord shards: counts and records equal tokenizing the documents
directly, worker count and kills do not change a byte, bad input gives one line."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from zaya_jax.data import DataConfig, make_train_iterator
from zaya_jax.data import manifest as manifest_lib
from zaya_jax.data import prepare as prepare_lib
from zaya_jax.data import readers
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
WORDS = ("the", "expert", "router", "token", "moe", "zaya", "café", "über", "jax", "shard",
         "grain", "loss", "step", "a", "of", "to", "naïve", "data")


def _text(rng, lo=3, hi=40) -> str:
  return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def make_corpus(root: pathlib.Path, scale: int = 1) -> dict[str, list[str]]:
  """Writes the mixed corpus under root; returns {path: its documents' texts in order}."""
  rng = np.random.default_rng(0)
  root.mkdir(parents=True, exist_ok=True)
  docs: dict[str, list[str]] = {}
  for name in ("a.jsonl", "c.jsonl"):
    texts = [_text(rng) for _ in range(25 * scale)] + [""]  # "" = bos+eos (or nothing)
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    lines.insert(3, "")  # a blank line is not a document
    (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs[str(root / name)] = texts
  texts = [_text(rng) for _ in range(30 * scale)]
  with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  docs[str(root / "b.jsonl.gz")] = texts
  for i in range(3):
    text = "\n".join(_text(rng) for _ in range(5))
    (root / f"d{i}.txt").write_text(text, encoding="utf-8")
    docs[str(root / f"d{i}.txt")] = [text]
  (root / "empty.txt").write_text("")
  docs[str(root / "empty.txt")] = []
  texts = [_text(rng) for _ in range(40 * scale)]
  pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}),
                 root / "e.parquet", row_group_size=7)
  assert pq.ParquetFile(root / "e.parquet").num_row_groups > 1
  docs[str(root / "e.parquet")] = texts
  return dict(sorted(docs.items()))


def expected_records(docs, encode, bos=None, eos=None) -> list[np.ndarray]:
  """Each document's ids in global order (sources sorted, file order); empty ones dropped."""
  records = []
  for texts in docs.values():
    for text in texts:
      ids = ([bos] if bos is not None else []) + list(encode(text)) + (
          [eos] if eos is not None else [])
      if ids:
        records.append(np.asarray(ids, np.int32))
  return records


def read_records(out: str) -> list[np.ndarray]:
  manifest = manifest_lib.read_manifest(out)
  source = grain.sources.ArrayRecordDataSource([os.path.join(out, s.path)
                                                for s in manifest.shards])
  return [np.frombuffer(source[i], manifest_lib.TOKEN_DTYPE) for i in range(len(source))]


def tree_bytes(out: str) -> dict[str, bytes]:
  return {str(p.relative_to(out)): p.read_bytes() for p in sorted(pathlib.Path(out).rglob("*"))
          if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  return str(root), make_corpus(root)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
  """The byte-tokenized corpus, in-process, small shards (several per source)."""
  out = str(tmp_path_factory.mktemp("prepared") / "out")
  result = prepare_lib.prepare([os.path.join(corpus[0], "*")], out,
                               prepare_lib.PrepareOptions("byte", shard_tokens=600),
                               num_workers=0, progress=False)
  return out, result


def test_byte_counts_and_records_equal_direct_tokenization(corpus, prepared):
  _, docs = corpus
  out, result = prepared
  tok = ByteTokenizer()
  want = expected_records(docs, tok.encode, tok.bos_id, tok.eos_id)
  manifest = manifest_lib.read_manifest(out)
  assert manifest.documents == len(want) == result.documents
  assert manifest.tokens == sum(len(r) for r in want) == result.tokens
  assert [s.path for s in manifest.sources] == list(docs)
  assert [s.documents for s in manifest.sources] == [len(t) for t in docs.values()]
  assert manifest.tokenizer == manifest_lib.TokenizerInfo("byte", "byte", 259, 1, 2, 0)
  got = read_records(out)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  manifest_lib.check_shards(out, manifest, checksums=True)
  lengths = np.concatenate([np.load(os.path.join(out, s.lengths)) for s in manifest.shards])
  np.testing.assert_array_equal(lengths, [len(w) for w in want])
  for shard in manifest.shards:  # cut at the first document boundary at or after 600 tokens
    assert shard.path.startswith("shards/") and os.path.isfile(os.path.join(out, shard.path))
  for shard in manifest.shards:
    shard_lengths = np.load(os.path.join(out, shard.lengths))
    assert shard_lengths.sum() - shard_lengths[-1] < 600
  by_source = [s.path.split("/")[1][:5] for s in manifest.shards]
  assert by_source.count("00006") > 2  # e.parquet (40 rows) spans several shards
  assert not [p for p in tree_bytes(out) if p.endswith(".tmp")]


def test_hf_tokenizer_counts_and_records(corpus, tmp_path):
  root, docs = corpus
  vocab = {w: i for i, w in enumerate(("<unk>", "<pad>", "<bos>", "<eos>") + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  hf = HFTokenizer(path)
  out = str(tmp_path / "out")
  prepare_lib.prepare([os.path.join(root, "*")], out,
                      prepare_lib.PrepareOptions(path, add_bos=False, add_eos=True),
                      progress=False)
  want = expected_records(docs, hf.encode, None, hf.eos_id)
  manifest = manifest_lib.read_manifest(out)
  assert manifest.documents == len(want) and manifest.tokens == sum(len(w) for w in want)
  assert (manifest.add_bos, manifest.add_eos) == (False, True)
  assert manifest.tokenizer.vocab_size == len(vocab) and manifest.tokenizer.eos_id == 3
  assert manifest.tokenizer.sha256 == hashlib.sha256(
      pathlib.Path(path).read_bytes()).hexdigest()
  for g, w in zip(read_records(out), want, strict=True):
    np.testing.assert_array_equal(g, w)


def test_rerun_skips_done_sources_and_refuses_other_arguments(corpus, prepared):
  root, _ = corpus
  out, _ = prepared
  before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in tree_bytes(out)
            if p.startswith("shards/")}
  again = prepare_lib.prepare([os.path.join(root, "*")], out,
                              prepare_lib.PrepareOptions("byte", shard_tokens=600),
                              progress=False)
  assert again.documents == 0 and again.sources_done_before == len(again.manifest.sources)
  assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before} == before
  args = pathlib.Path(out, prepare_lib.ARGS_FILE).read_bytes()
  # A finished corpus is refused other arguments; the message names each difference.
  with pytest.raises(prepare_lib.PrepareError, match=r"holds a finished corpus prepared with "
                     r"other arguments: --add_eos True -> False; --shard_tokens 600 -> 700 "):
    prepare_lib.prepare([os.path.join(root, "*")], out, prepare_lib.PrepareOptions(
        "byte", shard_tokens=700, add_eos=False), progress=False)
  with pytest.raises(prepare_lib.PrepareError) as refused:
    prepare_lib.prepare([os.path.join(root, "*.jsonl")], out,
                        prepare_lib.PrepareOptions("byte", shard_tokens=600), progress=False)
  removed = sorted(p for p in os.listdir(root) if not p.endswith(".jsonl"))
  assert f"{os.path.join(root, removed[0])} removed" in str(refused.value)
  assert pathlib.Path(out, prepare_lib.ARGS_FILE).read_bytes() == args


@pytest.mark.slow
def test_two_workers_write_identical_bytes(corpus, prepared, tmp_path):
  root, _ = corpus
  out, _ = prepared
  result = prepare_lib.prepare([os.path.join(root, "*")], str(tmp_path / "w2"),
                               prepare_lib.PrepareOptions("byte", shard_tokens=600),
                               num_workers=2, progress=False)
  assert result.workers == 2
  assert tree_bytes(str(tmp_path / "w2")) == tree_bytes(out)


def _cli(*args, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.prepare_data", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_killed_run_resumes_to_identical_bytes(tmp_path):
  root = tmp_path / "corpus"
  make_corpus(root, scale=3)
  flags = [f"--source={root}/*", "--tokenizer=byte", "--shard_tokens=500", "--noprogress"]
  reference = str(tmp_path / "reference")
  prepare_lib.prepare([f"{root}/*"], reference,
                      prepare_lib.PrepareOptions("byte", shard_tokens=500), progress=False)
  first = sum(s.path.startswith("shards/00000-")
              for s in manifest_lib.read_manifest(reference).shards)
  out = str(tmp_path / "out")  # dies inside source 1's third shard:
  killed = _cli(*flags, f"--out={out}",
                env={prepare_lib.EXIT_AFTER_SHARDS_ENV: str(first + 2)})
  assert killed.returncode == 17, killed.stderr
  files = tree_bytes(out)
  assert manifest_lib.MANIFEST_FILE not in files  # nothing listed
  assert [p for p in files if p.endswith(".tmp")]  # it died inside a shard
  done = sorted(p for p in files if p.endswith(".done.json"))
  assert done == ["shards/00000.done.json"]
  kept = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in files
          if p.split("/")[-1][:5] in {d.split("/")[-1][:5] for d in done}}
  resumed = _cli(*flags, f"--out={out}", "--num_workers=2")
  assert resumed.returncode == 0, resumed.stderr
  assert f"{len(done)} of 8 files were done before" in resumed.stdout
  assert tree_bytes(out) == tree_bytes(reference)
  assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in kept} == kept


# ----------------------------------------------------------------------------- bad input

def _prepare(patterns, out, **options):
  return prepare_lib.prepare(patterns, str(out), prepare_lib.PrepareOptions("byte", **options),
                             progress=False)


def _one_line_error(patterns, out, match, **options):
  with pytest.raises(prepare_lib.PrepareError, match=match) as e:
    _prepare(patterns, out, **options)
  assert "\n" not in str(e.value)
  assert not os.path.exists(os.path.join(out, manifest_lib.MANIFEST_FILE))
  return str(e.value)


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"text": "ok", oops\n{"body": "x"}\n{"text": 3}\n')
  _one_line_error([str(bad)], tmp_path / "o1", rf"{bad}:2 is not valid JSON .*"
                  "--bad_records=skip")
  bad.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
  _one_line_error([str(bad)], tmp_path / "o2",
                  rf"{bad}:3: --text_field='text' not found \(found keys \['body'\]\)")
  bad.write_text('{"text": "ok"}\n{"text": 3}\n')
  _one_line_error([str(bad)], tmp_path / "o3", rf"{bad}:2: .* holds a int, not a string")
  bad.write_text('{"text": "ok"}\nnope\n{"body": "x"}\n{"text": "fine"}\n')
  result = _prepare([str(bad)], tmp_path / "o4", bad_records="skip")
  assert result.manifest.documents == 2 and result.skipped_records == 2
  assert result.skipped_first == (f"{bad}:2", f"{bad}:3")


def test_bad_files_give_one_line_errors(tmp_path):
  _one_line_error([str(tmp_path / "nothing*.jsonl")], tmp_path / "o1", "matched no files")
  (tmp_path / "x.json").write_text("[]")
  _one_line_error([str(tmp_path / "x.json")], tmp_path / "o2", r"is not one of \('.txt'")
  pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
  _one_line_error([str(tmp_path / "empty.parquet")], tmp_path / "o3",
                  r"empty.parquet: empty parquet \(0 rows\)")
  pq.write_table(pa.table({"body": ["a"], "id": [1]}), tmp_path / "cols.parquet")
  _one_line_error([str(tmp_path / "cols.parquet")], tmp_path / "o4",
                  r"no column --text_field='text'; it has columns \['body', 'id'\]")
  pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
  _one_line_error([str(tmp_path / "null.parquet")], tmp_path / "o5", r"null.parquet:row 1: ")
  (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
  _one_line_error([str(tmp_path / "junk.parquet")], tmp_path / "o6", "not a readable parquet")
  (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip")
  _one_line_error([str(tmp_path / "junk.jsonl.gz")], tmp_path / "o7", "corrupt or truncated gzip")
  whole = gzip.compress(b"".join(b'{"text": "%d"}\n' % i for i in range(5000)))
  (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
  _one_line_error([str(tmp_path / "cut.jsonl.gz")], tmp_path / "o8",
                  r"cut.jsonl.gz: corrupt or truncated gzip after \d+ documents")
  (tmp_path / "blank.txt").write_text("")
  _one_line_error([str(tmp_path / "blank.txt")], tmp_path / "o9", "holds no documents")
  with pytest.raises(readers.ReadError, match="missing.txt: cannot be read"):
    list(readers.read_documents(str(tmp_path / "missing.txt"), "text"))


def _write_bad_then_fixed(tmp_path):
  """good.jsonl, then bad.jsonl whose line 2 is not JSON; returns (patterns, fix)."""
  (tmp_path / "good.jsonl").write_text("".join('{"text": "doc %d"}\n' % i for i in range(30)))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "one"}\n{"text": "two", oops\n{"text": "three"}\n')
  return [str(tmp_path / "good.jsonl"), str(bad)], lambda: bad.write_text(
      '{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n')


def test_fixed_input_resumes_a_failed_run(tmp_path):
  """Issue 23: after bad input the --out kept prepare_args.json, a done-file and a .tmp
  shard, and once the file was fixed (its size changed) the rerun was refused."""
  patterns, fix = _write_bad_then_fixed(tmp_path)
  out = tmp_path / "out"
  _one_line_error(patterns, out, r"bad.jsonl:2 is not valid JSON")
  kept = {p: os.stat(out / p).st_mtime_ns for p in tree_bytes(str(out))
          if p.startswith("shards/00000")}
  assert "shards/00000.done.json" in kept  # good.jsonl was finished before bad.jsonl failed
  fix()
  result = _prepare(patterns, out)
  assert result.sources_done_before == 1 and result.documents == 3
  assert {p: os.stat(out / p).st_mtime_ns for p in kept} == kept  # not redone
  assert tree_bytes(str(out)) == tree_bytes(str(_prepare(patterns, tmp_path / "fresh")
                                                 .manifest_path).rsplit("/", 1)[0])


def test_unfinished_run_with_other_options_redoes_its_sources(tmp_path):
  patterns, fix = _write_bad_then_fixed(tmp_path)
  out = tmp_path / "out"
  _one_line_error(patterns, out, r"bad.jsonl:2 is not valid JSON", add_eos=False)
  fix()
  result = _prepare(patterns, out)  # add_eos back to True: good.jsonl's done-file is stale
  assert result.sources_done_before == 0 and result.documents == 33
  assert tree_bytes(str(out)) == tree_bytes(str(_prepare(patterns, tmp_path / "fresh")
                                                 .manifest_path).rsplit("/", 1)[0])


def test_finished_corpus_with_a_changed_input_is_refused_naming_it(tmp_path):
  patterns, fix = _write_bad_then_fixed(tmp_path)
  fix()
  out = tmp_path / "out"
  _prepare(patterns, out)
  before = tree_bytes(str(out))
  (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n')
  with pytest.raises(prepare_lib.PrepareError) as refused:
    _prepare(patterns, out)
  assert str(refused.value) == (
      f"--out={str(out)!r} holds a finished corpus prepared with other arguments: "
      f"{tmp_path}/bad.jsonl: 50 -> 16 bytes (see {out}/prepare_args.json); rerun with the "
      "same arguments, or use a new --out")
  assert tree_bytes(str(out)) == before


def test_out_that_is_not_ours_is_left_alone(tmp_path):
  (tmp_path / "doc.txt").write_text("hello")
  out = tmp_path / "out"
  out.mkdir()
  (out / "precious").write_text("keep")
  _one_line_error([str(tmp_path / "doc.txt")], out, "is not empty and has no prepare_args.json")
  assert os.listdir(out) == ["precious"]


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n[1, 2]\n')
  for source, match in ((str(bad), f"{bad}:2: --text_field='text' not found"),
                        (str(tmp_path / "none*.txt"), "matched no files")):
    run = _cli(f"--source={source}", f"--out={tmp_path / 'out'}", "--noprogress")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("launch.prepare_data: ") and match in last, run.stderr


@pytest.mark.slow
def test_cli_rerun_after_fixing_the_input_continues(tmp_path):
  patterns, fix = _write_bad_then_fixed(tmp_path)
  flags = [f"--source={','.join(patterns)}", f"--out={tmp_path / 'out'}", "--noprogress"]
  failed = _cli(*flags)
  assert failed.returncode == 1 and "bad.jsonl:2 is not valid JSON" in failed.stderr
  fix()
  rerun = _cli(*flags)
  assert rerun.returncode == 0, rerun.stderr
  assert "prepare_data: 33 documents" in rerun.stdout
  assert "1 of 2 files were done before" in rerun.stdout
  assert "tokens/s, in-process);" in rerun.stdout, rerun.stdout  # was "1 workers"
  assert (f"continuing an unfinished run with other arguments ({tmp_path}/bad.jsonl: 55 -> 50 "
          "bytes)") in rerun.stderr


@pytest.mark.slow
def test_bad_record_in_a_worker_stops_the_pool_with_its_line(tmp_path):
  (tmp_path / "a.jsonl").write_text("".join('{"text": "doc %d"}\n' % i for i in range(50)))
  (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
  with pytest.raises(prepare_lib.PrepareError, match=rf"{tmp_path}/b.jsonl:2: --text_field"):
    prepare_lib.prepare([f"{tmp_path}/*.jsonl"], str(tmp_path / "out"),
                        prepare_lib.PrepareOptions("byte"), num_workers=2, progress=False)
  assert not os.path.exists(tmp_path / "out" / manifest_lib.MANIFEST_FILE)


def test_training_batches_of_the_prepared_corpus_hold_every_document_once_per_epoch(corpus,
                                                                                   prepared):
  """prepare -> train: the 2-process global batches of `make_train_iterator` over the prepared
  jsonl/gz/txt/parquet corpus, joined back into documents (a document ends at the pair whose
  target is eos), give every document's ids exactly once in the first epoch."""
  out, _ = prepared
  byte = ByteTokenizer()
  want = sorted(tuple(r) for r in expected_records(corpus[1], byte.encode, byte.bos_id,
                                                    byte.eos_id))
  cfg = DataConfig(source=out, tokenizer="byte", eval_fraction=0.0,
                   shuffle_rows=False)  # documents are re-joined across consecutive rows
  iters = [make_train_iterator(cfg, seq_len=16, batch_size=4, seed=0, process_index=p,
                               process_count=2) for p in range(2)]
  got, current = [], []
  while len(got) < len(want):
    for batch in [next(it) for it in iters]:  # process 0's rows, then process 1's
      for r in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in range(1, seg.max() + 1):
          where = np.flatnonzero(seg == s)
          current += list(batch["inputs"][r, where])
          if batch["targets"][r, where[-1]] == byte.eos_id:  # the document's last pair
            got.append(tuple(current + [byte.eos_id]))
            current = []
  assert sorted(got[:len(want)]) == want
