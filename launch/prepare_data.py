"""Tokenize a corpus once into ArrayRecord shards for training.

  python -m launch.prepare_data --source='corpus/*.jsonl,web/*.parquet' \
      --tokenizer=byte|PATH/tokenizer.json --out=DIR [--num_workers=8]

Reads .txt (a document per file), .jsonl / .jsonl.gz (a document per line, text under
--text_field) and .parquet (a document per row of the --text_field column); writes
DIR/shards/*.array_record (one record per document: int32 token ids), their .lengths.npy and
DIR/manifest.json (`zaya_jax.data.manifest`). Deterministic (same input and arguments ->
byte-identical shards, whatever --num_workers) and resumable: rerun the same command after a
crash or kill and it continues, keeping the files already finished. Prints a progress bar on
stderr and one summary line; bad input stops it with one line naming the file and line/row.
"""

import sys

from absl import app, flags, logging

from zaya_jax.config import cli_paths
from zaya_jax.data import prepare as prepare_lib
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: third-party INFO lines off

_SOURCE = flags.DEFINE_list("source", None, "Comma-separated paths / globs (** recurses) of "
                            ".txt, .jsonl, .jsonl.gz and .parquet files; documents are numbered "
                            "in pattern order, each pattern's files sorted, file order inside.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte' or a local tokenizer.json path.")
_OUT = flags.DEFINE_string("out", None, "Output directory (new or empty, or an earlier run's "
                           "to resume it).")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "JSON key / parquet column of the text.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 0, "Tokenizing processes (one input file "
                                    "each at a time); 0 or 1 = in this process.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", prepare_lib.PrepareOptions.shard_tokens,
                                     "Start a new shard after this many tokens (at a document "
                                     "boundary); shards never span two input files.")
_ADD_BOS = flags.DEFINE_boolean("add_bos", True, "Prepend the tokenizer's bos id to each document.")
_ADD_EOS = flags.DEFINE_boolean("add_eos", True, "Append the tokenizer's eos id to each document.")
_BAD_RECORDS = flags.DEFINE_enum("bad_records", "error", ["error", "skip"], "A .jsonl line that "
                                 "is not JSON or lacks --text_field, or a parquet null: 'error' "
                                 "stops naming file:line, 'skip' leaves it out with a warning.")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Show the progress bar on stderr.")
flags.mark_flags_as_required(["source", "out"])


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  try:
    options = prepare_lib.PrepareOptions(
        tokenizer=_TOKENIZER.value, text_field=_TEXT_FIELD.value,
        shard_tokens=_SHARD_TOKENS.value, add_bos=_ADD_BOS.value, add_eos=_ADD_EOS.value,
        bad_records=_BAD_RECORDS.value)
    result = prepare_lib.prepare(_SOURCE.value, _OUT.value, options, _NUM_WORKERS.value,
                                 progress=_PROGRESS.value)
  except prepare_lib.PrepareError as e:
    sys.exit(f"launch.prepare_data: {e}")
  if result.skipped_records:
    logging.warning("--bad_records=skip: left out %d bad record(s), first: %s",
                    result.skipped_records, ", ".join(result.skipped_first))
  m, seconds = result.manifest, max(result.seconds, 1e-9)
  resumed = (f"; {result.sources_done_before} of {len(m.sources)} files were done before"
             if result.sources_done_before else "")
  print(f"prepare_data: {m.documents} documents, {m.tokens} tokens, {len(m.shards)} shards "
        f"-> {result.manifest_path}; this run {result.documents} documents, {result.tokens} "
        f"tokens in {result.seconds:.1f} s ({result.documents / seconds:,.0f} docs/s, "
        f"{result.tokens / seconds:,.0f} tokens/s, "
        f"{'in-process' if result.workers == 1 else f'{result.workers} worker processes'})"
        f"{resumed}")


def run_main():
  """Console script `zaya-prepare-data` (pyproject.toml): same as `python -m launch.prepare_data`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
