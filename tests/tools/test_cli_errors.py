"""Bad input to the entry points is one line, through the CLI (issue 23): a missing --config
file, a read-only --workdir, a run shorter than its warm-up, absl's own flag errors (a mistyped
value, an unknown or missing flag) in the entry points. Every run here fails (or warns)
before a train step is compiled, so each takes the seconds of importing JAX."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from unittest import mock

import pytest
from absl import flags as absl_flags
from ml_collections import config_flags

from tests.helpers import MODEL_OVERRIDES, REPO
from zaya_jax.config import cli_paths
from zaya_jax.config.cli_paths import (config_file_problem, flag_error, flagfile_problem,
                                       override_error)
from zaya_jax.convert.runs import parse_size

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env or ENV,
                        capture_output=True, text=True, timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  return lines[0]


# --- item 1: a missing --config file ---------------------------------------------------------

def test_config_file_problem_reads_every_flag_form(tmp_path):
  good = os.path.join(REPO, "configs", "zaya1_tiny.py")
  assert config_file_problem(["prog", f"--config={good}"]) is None
  assert config_file_problem(["prog", f"--config={good}:arg"]) is None  # get_config's argument
  assert config_file_problem(["prog", "--workdir=x"]) is None  # absent: absl's business
  missing = str(tmp_path / "nope.py")
  for argv in (["prog", f"--config={missing}"], ["prog", "--config", missing],
               ["prog", f"-config={missing}"], ["prog", f"--config={good}", f"--config={missing}"]):
    problem = config_file_problem(argv)
    assert problem is not None and problem.startswith("--config=") and "no such file" in problem, argv
  assert "is a directory" in config_file_problem(["prog", f"--config={tmp_path}"])
  assert config_file_problem(["prog", "--config="]).startswith("--config= is empty")


@pytest.mark.slow
def test_missing_config_file_is_one_line():
  want = ("invalid flags: --config=configs/nope.py: no such file (relative paths start at the "
          f"current directory, {REPO}); give an existing config file, e.g. "
          "--config=configs/zaya1_tiny.py")
  assert _one_line(_run("launch.train", "--config=configs/nope.py", "--workdir=/tmp/x")) == want
  # An override used to fail inside the flag parser, with another traceback.
  assert _one_line(_run("launch.train", "--config=configs/nope.py", "--workdir=/tmp/x",
                        "--config.train.lr=1e-3")) == want
  assert _one_line(_run("launch.sizing", "--config=configs/nope.py", "--num_devices=1")) == want


# --- item 2: a read-only --workdir -----------------------------------------------------------

def _can_mount_read_only(tmp_path) -> bool:
  """Whether `unshare -m` can bind-mount a directory read-only (root with CAP_SYS_ADMIN, as
  in CI). chmod would not do: root writes through permissions."""
  d = tmp_path / "probe"
  d.mkdir()
  script = f"mount --bind {d} {d} && mount -o remount,bind,ro {d} && ! touch {d}/x 2>/dev/null"
  try:
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                          timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@pytest.mark.slow
def test_read_only_workdir_is_one_line(tmp_path):
  if not _can_mount_read_only(tmp_path):
    pytest.skip("needs `unshare -m` and a read-only bind mount (root with CAP_SYS_ADMIN); "
                "chmod is not enforced for root")
  ro, run = tmp_path / "ro", tmp_path / "run"  # ro: a read-only mount; run/checkpoints: another
  ro.mkdir()
  (run / "checkpoints").mkdir(parents=True)
  logs = tmp_path / "logs"
  logs.mkdir()
  cases = {"mount": ro, "below": ro / "new" / "run", "checkpoints": run}
  # The old code trained this micro run, then failed to save into run/checkpoints (226 lines).
  train = shlex.join([sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
                      *MODEL_OVERRIDES, "--config.train.seq_len=32",
                      "--config.train.batch_size=2", "--config.train.num_steps=2",
                      "--config.train.warmup_steps=1", "--config.train.eval_batches=0"])
  script = " && ".join(
      [f"mount --bind {ro} {ro}", f"mount -o remount,bind,ro {ro}",
       f"mount --bind {run}/checkpoints {run}/checkpoints",
       f"mount -o remount,bind,ro {run}/checkpoints"]
      + [f"{{ {train} --workdir={w} 2>{logs}/{name}.err; echo $? > {logs}/{name}.rc; }}"
         for name, w in cases.items()])
  proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)  # a timeout ends the trainers too
  try:
    out = proc.communicate(timeout=150)[0]  # ~10 s; the old code trained, then hung saving
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise
  assert proc.returncode == 0, out[-3000:]
  want = {
      "mount": f"invalid config: --workdir={ro}: {ro} is on a read-only file system",
      "below": f"invalid config: --workdir={ro}/new/run cannot be created: {ro} is on a "
               "read-only file system",
      "checkpoints": f"invalid config: --workdir={run}: {run}/checkpoints is on a read-only "
                     "file system",
  }
  for name, start in want.items():
    err = (logs / f"{name}.err").read_text()
    assert (logs / f"{name}.rc").read_text().strip() == "1", (name, err[-3000:])
    assert "Traceback" not in err, (name, err[-3000:])
    lines = err.strip().splitlines()
    # The last line is the error; at most absl's "single process: ..." INFO line before it.
    assert len(lines) <= 2 and lines[-1].startswith(start), (name, err[-3000:])
    assert lines[-1].endswith("; pass a directory you can write to (or remount it read-write)")
  assert not (ro / "new").exists() and os.listdir(run / "checkpoints") == []


# --- item 6: a run shorter than its config's warm-up ---------------------------------------

@pytest.mark.slow
def test_short_run_clamps_the_warm_up_with_one_warning(tmp_path):
  """zaya1_tiny (30 warm-up steps) with num_steps=20 used to stop on the config error; now
  one warning and the run goes on (here to the next check: a --workdir that is a file, so
  that nothing is compiled)."""
  (tmp_path / "file").write_text("")
  proc = _run("launch.train", "--config=configs/zaya1_tiny.py", "--config.train.num_steps=20",
              f"--workdir={tmp_path / 'file'}")
  warnings = [l for l in proc.stderr.splitlines() if "warmup" in l]
  assert len(warnings) == 1 and warnings[0].endswith(
      "train.warmup_steps=30 does not fit train.num_steps=20: warming up over 19 steps (the "
      "warm-up is clamped to the run); set train.warmup_steps to choose"), proc.stderr[-3000:]
  assert warnings[0].startswith("W")  # absl's WARNING prefix
  assert proc.stderr.strip().splitlines()[-1] == (
      f"invalid config: --workdir={tmp_path / 'file'} exists and is not a directory; pass a "
      "directory path"), proc.stderr[-3000:]


# --- absl's own flag errors, in every entry point ------------------------------------------

def test_flag_error_lines(tmp_path):
  """`flag_error` on the messages absl raises (absl.flags 2.x wording): each names the flag,
  what it takes and an example, the flag's default where it has one."""
  values = absl_flags.FlagValues()
  absl_flags.DEFINE_integer("batches", 64, "n", flag_values=values)
  absl_flags.DEFINE_integer("window", 16, "w", lower_bound=1, flag_values=values)
  absl_flags.DEFINE_integer("least", 64, "n", lower_bound=2, flag_values=values)
  absl_flags.DEFINE_float("temperature", 0.8, "t", lower_bound=0.0, flag_values=values)
  absl_flags.DEFINE_float("lr", None, "l", flag_values=values)
  absl_flags.DEFINE_integer("steps", None, "s", lower_bound=1, flag_values=values)
  absl_flags.DEFINE_integer("skip", None, "s", lower_bound=0, flag_values=values)
  absl_flags.DEFINE_enum("mode", "next", ["next", "current"], "m", flag_values=values)
  absl_flags.DEFINE_string("workdir", None, "dir", flag_values=values)
  absl_flags.mark_flag_as_required("workdir", flag_values=values)
  absl_flags.DEFINE_integer("min_size", 64, "n", flag_values=values)
  absl_flags.DEFINE_integer("max_size", 128, "n", flag_values=values)
  absl_flags.DEFINE_list("kernels", ["copy"], "k", flag_values=values)
  absl_flags.register_validator("min_size", lambda v: v >= 1, "must be >= 1", flag_values=values)
  absl_flags.register_validator("kernels", lambda v: set(v) <= {"copy", "scale"},
                                "must be a subset of ('copy', 'scale')", flag_values=values)
  absl_flags.register_multi_flags_validator(
      ["min_size", "max_size"], lambda f: f["min_size"] <= f["max_size"],
      "--min_size must be <= --max_size", flag_values=values)
  cases = {
      # register_validator messages were absl's `flag --min_size=0: must be >= 1 (see --help)`
      "--min_size=0": "--min_size=0: the value must be >= 1, e.g. --min_size=64",
      "--kernels=copy,bogus": ("--kernels=copy,bogus: the value must be a subset of ('copy', "
                               "'scale'), e.g. --kernels=copy"),
      "--min_size=500": "--min_size=500, --max_size=128: --min_size must be <= --max_size",
      "--batches=abc": "--batches=abc: the value must be an integer, e.g. --batches=64",
      "--lr=x": "--lr=x: the value must be a number, e.g. --lr=3e-4",  # no default
      "--temperature=x": "--temperature=x: the value must be a number, e.g. --temperature=0.8",
      "--window=0": "--window=0: the value must be a positive integer, e.g. --window=16",
      # no default: the bound's least value (was `e.g. --steps=...`)
      "--steps=0": "--steps=0: the value must be a positive integer, e.g. --steps=1",
      "--skip=-1": "--skip=-1: the value must be a non-negative integer, e.g. --skip=0",
      "--temperature=-1": ("--temperature=-1: the value must be a non-negative number, e.g. "
                           "--temperature=0.8"),
      "--mode=both": "--mode=both: the value must be one of next, current, e.g. --mode=next",
      "--window": "--window needs a value, e.g. --window=16",
      "--least=1": "--least=1: the value must be an integer >= 2, e.g. --least=64",
      "--flagfile=/nonexistent/f": ("--flagfile: cannot read it: [Errno 2] No such file or "
                                    "directory: '/nonexistent/f'"),
      "--nope=1": "Unknown command line flag 'nope' (see --help)",
  }
  for arg, want in cases.items():
    with pytest.raises(absl_flags.Error) as e:
      values(["prog", "--workdir=x", arg])
    assert flag_error(e.value, values) == "invalid flags: " + want, arg
    values.unparse_flags()  # a value that failed its validator stays set otherwise
  values = absl_flags.FlagValues()  # a fresh set: --workdir was given above
  absl_flags.DEFINE_string("workdir", None, "dir", flag_values=values)
  absl_flags.mark_flag_as_required("workdir", flag_values=values)
  with pytest.raises(absl_flags.Error) as e:
    values(["prog"])
  assert flag_error(e.value, values) == (
      "invalid flags: --workdir is required, e.g. --workdir=... (see --help)")
  absl_flags.DEFINE_integer("batches", 64, "n", flag_values=values)
  with pytest.raises(absl_flags.Error) as e:  # without the flag values: a generic example
    values(["prog", "--batches=abc", "--workdir=x"])
  assert flag_error(e.value) == (
      "invalid flags: --batches=abc: the value must be an integer, e.g. --batches=100")
  values = absl_flags.FlagValues()  # a value for a whole config group (was "must be a dict.")
  config_file = tmp_path / "groups.py"
  config_file.write_text("import ml_collections\n\ndef get_config():\n  return "
                         "ml_collections.ConfigDict({'train': {'seed': 0, 'lr': 3e-4}})\n")
  argv = ["prog", f"--config={config_file}", "--config.train=5"]
  with mock.patch.object(sys, "argv", argv):  # ml_collections reads the overrides from it
    config_flags.DEFINE_config_file("config", flag_values=values)
    with pytest.raises(absl_flags.Error) as e:
      values(argv)
  assert flag_error(e.value, values) == (
      "invalid flags: --config.train=5: --config.train is a group of settings, not one value; "
      "set its fields, e.g. --config.train.lr=...")


def test_flag_taken_as_value():
  """absl reads `--out --steps=3` as out="--steps=3" (and drops --steps): one line instead.
  A next token that is no known flag stays a value (a negative number, a prompt)."""
  values = absl_flags.FlagValues()
  absl_flags.DEFINE_string("out", "/tmp/o", "o", flag_values=values)
  absl_flags.DEFINE_integer("steps", 3, "s", flag_values=values)
  absl_flags.DEFINE_float("lr", None, "l", flag_values=values)
  absl_flags.DEFINE_bool("walk", True, "w", flag_values=values)
  assert cli_paths.flag_taken_as_value(["prog", "--out", "--steps=3"], values) == (
      "--out has no value (absl would take --steps=3 as it); give one, e.g. --out=/tmp/o")
  absl_flags.DEFINE_string("config", None, "c", flag_values=values)  # its fields: --config.a.b
  assert cli_paths.flag_taken_as_value(["prog", "--out", "--config.train.lr=1"], values) == (
      "--out has no value (absl would take --config.train.lr=1 as it); give one, e.g. "
      "--out=/tmp/o")
  assert cli_paths.flag_taken_as_value(["prog", "--lr", "--nowalk"], values) == (
      "--lr has no value (absl would take --nowalk as it); give one, e.g. --lr=...")
  for argv in (["prog", "--lr", "-1"], ["prog", "--out", "-x"], ["prog", "--walk", "--steps=2"],
               ["prog", "--nowalk", "--steps=2"], ["prog", "--out=a", "--steps=2"],
               ["prog", "--", "--out", "--steps=2"]):
    assert cli_paths.flag_taken_as_value(argv, values) is None, argv


def test_flagfile_problem_reads_nested_flag_files(tmp_path):
  """An unreadable --flagfile, also one named inside a flag file, is one line (absl reads
  them while parsing, ml_collections' DEFINE_config_file already at import)."""
  good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
  good.write_text("# a comment\n--workdir=/tmp/x\n")
  bad.write_text(f"--flagfile={good}\n--flagfile={tmp_path / 'gone.txt'}\n")
  assert flagfile_problem(["prog", f"--flagfile={good}", "--x=1"]) is None
  assert flagfile_problem(["prog", "--flagfile", str(good)]) is None
  assert flagfile_problem(["prog", f"--flagfile={bad}"]) == (
      f"--flagfile={tmp_path / 'gone.txt'}: cannot read it: No such file or directory; give a "
      "readable file of flags")
  assert flagfile_problem(["prog", f"--flagfile={tmp_path}"]).endswith(
      "cannot read it: Is a directory; give a readable file of flags")
  assert flagfile_problem(["prog", "--flagfile"]) == (
      "--flagfile needs a value, e.g. --flagfile=FLAGS.txt")


def test_override_error_lines():
  """`override_error` on ml_collections' errors for a `--config.*` field that does not exist
  (what config_flags raises: the KeyError's text, with and without a close match)."""
  argv = ["prog", "--config=c.py", "--config.train.lrr=1", "--config.nope=2"]
  assert override_error(argv, AttributeError('\'lrr\'\nDid you mean "lr" instead of "lrr"?')) == (
      "invalid config override --config.train.lrr: no field 'lrr' in train; did you mean 'lr'?")
  assert override_error(argv, AttributeError("\"'nope'\"")) == (
      "invalid config override --config.nope: no field 'nope' in the config (launch.train "
      "--config=FILE --print_config lists the fields)")
  assert override_error(argv, ValueError("could not parse\n 1,2")) == (
      "invalid config override: could not parse 1,2")


def test_override_error_names_an_override_in_a_flag_file(tmp_path):
  """A misspelt `--config.*` field inside a --flagfile (nested too) is named like one on the
  command line (it was ml_collections' bare `'lrr' Did you mean "lr"`)."""
  inner = tmp_path / "inner.txt"
  inner.write_text("# a comment\n--config.train.lrr=1\n")
  outer = tmp_path / "outer.txt"
  outer.write_text(f"--flagfile={inner}\n")
  argv = ["prog", "--config=c.py", f"--flagfile={outer}"]
  assert override_error(argv, AttributeError('\'lrr\'\nDid you mean "lr" instead of "lrr"?')) == (
      "invalid config override --config.train.lrr: no field 'lrr' in train; did you mean 'lr'?")


@pytest.mark.slow
def test_entry_points_say_a_bad_flag_in_one_line():
  """Entry points other than launch.train parse through `cli_paths.parse_flags`: one line,
  status 1, not absl's `FATAL Flags parsing error` and usage hint (launch.balance_floor,
  launch.plot, launch.generate) or ml_collections' traceback (launch.sizing's override)."""
  assert _one_line(_run("launch.balance_floor", "--workdir=/tmp/x", "--batches=abc")) == (
      "invalid flags: --batches=abc: the value must be an integer, e.g. --batches=64")
  # A positional argument used to print absl's usage text (16 lines) under the error.
  assert _one_line(_run("launch.evaluate", "--workdir=/tmp/x", "extra")) == (
      "invalid arguments: extra: this command takes flags only, e.g. --name=value (see --help)")
  # An unreadable --flagfile in an entry point with --config: ml_collections read it at
  # import, a 33-line traceback.
  assert _one_line(_run("launch.evaluate", "--flagfile=/nonexistent/flags.txt")) == (
      "invalid flags: --flagfile=/nonexistent/flags.txt: cannot read it: No such file or "
      "directory; give a readable file of flags")
  # --help prints the flags and exits 0 (absl's own help flag exits 1).
  helped = _run("launch.balance_floor", "--help")
  assert helped.returncode == 0 and "--window" in helped.stdout, helped.stderr[-2000:]
  assert _one_line(_run("launch.plot")) == (
      "invalid flags: --workdir is required, e.g. --workdir=... (see --help)")
  assert _one_line(_run("launch.generate", "--temprature=0.8")).startswith(
      "invalid flags: Unknown command line flag 'temprature'")
  # An entry point with --config (not launch.train, which had its own parser): a misspelt
  # override used to be ml_collections' 58-line traceback.
  assert _one_line(_run("launch.sizing", "--config=configs/zaya1_tiny.py", "--num_devices=1",
                        "--config.train.lrr=1")) == (
      "invalid config override --config.train.lrr: no field 'lrr' in train; did you mean 'lr'?")


def test_unwritable_outputs_and_bad_values_stop_before_the_work(tmp_path):
  """Output paths are checked before anything slow starts (they were tracebacks after the
  work), and values that used to run with status 0 (a failed row, 131 one-tensor shards) are
  one line with status 1."""
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  assert cli_paths.unwritable_file_problem(str(tmp_path / "out.json"), "--out") is None
  assert cli_paths.unwritable_file_problem(str(tmp_path), "--out").startswith(
      f"--out={tmp_path} is a directory; pass a file path")
  assert cli_paths.unwritable_file_problem(f"{a_file}/x.json", "--out") == (
      f"--out={a_file}/x.json: {a_file} is not a folder; pass a path in a folder")
  if os.path.exists("/proc/self/mounts"):  # root may "write" to /proc by os.access
    assert cli_paths.unwritable_dir_problem("/proc/zaya/run", "--workdir") == (
        "--workdir=/proc/zaya/run: /proc is on the kernel's proc file system, where nothing "
        "can be created; pass a directory you can write to")
    assert cli_paths.unwritable_file_problem("/proc/x.json", "--out") == (
        "--out=/proc/x.json: /proc is on the kernel's proc file system, where nothing can be "
        "created; pass another path")
  assert _one_line(_run("launch.evaluate", "--workdir=/tmp/x", "--out=/nonexistent_dir/x.json")) == (
      "launch.evaluate: --out=/nonexistent_dir/x.json: the folder /nonexistent_dir does not "
      "exist; create it or pass another path")
  assert _one_line(_run("launch.plot", "--workdir=/tmp/x", f"--out={a_file}")) == (
      f"launch.plot: --out={a_file} exists and is not a directory; pass a directory path")
  assert _one_line(_run("launch.mesh_sweep", "--config=configs/zaya1_tiny.py", "--out=/tmp/x",
                        "--dispatches=bogus")) == (
      "invalid flags: --dispatches=bogus: bogus is not a dispatch path; use some of auto, local, "
      "allgather, all_to_all, ragged_all_to_all")
  assert _one_line(_run("launch.bench_collectives", "--num_cpu_devices=0")) == (
      "invalid flags: --num_cpu_devices=0: the value must be a positive integer, e.g. "
      "--num_cpu_devices=8")
  with pytest.raises(ValueError, match="--max_shard_size='0' must be at least one byte"):
    parse_size("0")
  # status 0 with an empty table / a traceback-free error naming no flag / a negative rate
  assert _one_line(_run("launch.balance_report", "--workdirs=")) == (
      "invalid flags: --workdirs is empty; e.g. --workdirs=/tmp/run_a,/tmp/run_b")
  assert _one_line(_run("launch.balance_report", "--workdirs=/tmp/x", "--first=50",
                        "--last=10")) == (  # was "train ... for >= 50 steps"
      "invalid flags: --first=50, --last=10: --first must be <= --last (the window's first and "
      "last step)")
  assert _one_line(_run("launch.balance_report", "--workdirs=/tmp/x", "--entropy_steps=a,b")) == (
      "invalid flags: --entropy_steps=a,b: 'a' is not a step number; e.g. "
      "--entropy_steps=100,200,400")
  assert _one_line(_run("launch.bench_loader", "--batch_size=-1")) == (
      "invalid flags: --batch_size=-1: the value must be a positive integer, e.g. "
      "--batch_size=1")
  # an export into the run's own directory overwrote its config.json (status 0)
  run = tmp_path / "run"
  run.mkdir()
  assert _one_line(_run("launch.convert_to_hf", f"--workdir={run}", f"--out={run}")) == (
      f"invalid flags: --out={run} is the run's own directory and the export would overwrite "
      "its files; pass a new directory, e.g. --out=/tmp/hf_export")
  assert os.listdir(run) == []


def test_second_trial_leftovers_are_one_line(tmp_path):
  """The bad inputs a fresh-user trial found still giving a traceback, a raw errno, the
  wrong flag's name, status 0 with failed rows or a silent no-op: one line, status 1, naming
  the flag, before any compile (the dispatch sweep and the collective count compile for
  minutes)."""
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  sizing = ("launch.sizing", "--config=configs/zaya1_tiny.py", "--num_devices=8", "--predict_step")
  wrong_mode = ("balance.mode='bogus' must be one of \"pid\", \"sign\", \"adamw\", \"quantile\" "
                "(e.g. none, pid, sign, adamw, quantile:current, quantile:next, quantile:reroute)")
  assert _one_line(_run(*sizing, "--balance_variants=bogus")) == (  # it named --compare_balance
      f"invalid arguments: --balance_variants entry 'bogus': {wrong_mode}")
  assert _one_line(_run(*sizing, "--intra_GBps=0")) == (  # silently the profile's peak
      "invalid flags: --intra_GBps=0.0: the value must be > 0 (GB/s; leave the flag out for the "
      "profile's peak), e.g. --intra_GBps=...")
  assert _one_line(_run("launch.balance_cost", "--config=configs/zaya1_tiny.py",
                        "--variants=none,bogus")) == (  # after compiling "none"
      f"invalid arguments: --variants entry 'bogus': {wrong_mode}")
  assert _one_line(_run("launch.mesh_sweep", "--config=configs/zaya1_tiny.py",
                        f"--out={tmp_path / 'ms'}", "--meshes=2,2,4")) == (  # status 0, a failed row
      "invalid flags: --meshes: mesh {'data': 2, 'fsdp': 2, 'expert': 4, 'context': 1}: the "
      "product of the fixed axes (16) does not divide the 8 devices; choose sizes whose product "
      "divides 8 (--num_cpu_devices or XLA_FLAGS sets the count)")
  assert not (tmp_path / "ms").exists()
  assert _one_line(_run("launch.train", "--config=configs/zaya1_tiny.py",
                        f"--workdir={tmp_path / 'w'}", "--local_device_ids=a,b")) == (
      "invalid flags: --local_device_ids=a,b: the value must be local device numbers (integers "
      ">= 0), e.g. --local_device_ids=...")
  assert _one_line(_run("launch.bench_loader", "--synthetic_documents=10",
                        f"--synthetic_dir={a_file}/x")) == (  # [Errno 20] Not a directory
      f"launch.bench_loader: --synthetic_dir={a_file}/x: {a_file} is not a directory, so "
      f"{a_file}/x cannot be created there; pass a directory path")
  assert _one_line(_run("launch.evaluate", f"--hf_dir={tmp_path}", "--config=configs/zaya1_tiny.py",
                        "--append_metrics")) == (  # silently ignored
      "launch.evaluate: --append_metrics appends to a run's metrics.jsonl and --hf_dir has none; "
      "drop it (or use --out=FILE)")
  assert _one_line(_run("launch.evaluate", f"--workdir={tmp_path}", "--eval_batches=0")) == (
      "invalid flags: --eval_batches=0: the value must be a positive integer, e.g. "
      "--eval_batches=1")
  # a config error was the second line, after the console's `single process: ...` INFO line
  assert _one_line(_run("launch.train", "--config=configs/zaya1_tiny.py",
                        f"--workdir={tmp_path / 'w2'}", "--config.train.eval_batches=2",
                        "--config.data.eval_fraction=0.0")) == (
      "invalid config: train.eval_batches=2 but data.eval_fraction=0 holds out no documents; set "
      "train.eval_batches=0 or data.eval_fraction > 0")
  assert not (tmp_path / "w2").exists()
  # get_config's own error was ml_collections' traceback flattened onto the line
  assert _one_line(_run("launch.train", "--config=configs/zaya1_tiny.py:bad_arg",
                        f"--workdir={tmp_path / 'w3'}")) == (
      "invalid flags: --config=configs/zaya1_tiny.py:bad_arg: the config file failed to load: "
      "TypeError: get_config() takes 0 positional arguments but 1 was given; give get_config "
      "the arguments it takes (the part after ':')")
  # an error absl does not wrap (not ValueError / TypeError) was a 42-line traceback
  (tmp_path / "raising.py").write_text("def get_config():\n  raise RuntimeError('boom')\n")
  assert _one_line(_run("launch.train", f"--config={tmp_path / 'raising.py'}",
                        f"--workdir={tmp_path / 'w4'}")) == (
      f"invalid flags: --config={tmp_path / 'raising.py'}: the config file failed to load: "
      "RuntimeError: boom")


def test_a_config_file_that_fails_to_load_is_named_in_one_line(tmp_path):
  """Errors of the config file's own code, which absl does not wrap (only ValueError and
  TypeError become its flag errors): raised in get_config, a SyntaxError, a failing import,
  no get_config, a get_config that returns no ConfigDict. Found by a new-user trial
  (2026-12-07): each was a 40-line traceback."""
  from ml_collections import config_flags

  def load_error(source: str) -> BaseException:
    path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.py"
    path.write_text(source)
    values = absl_flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values)
    sys.modules.pop("config_config", None)  # ml_collections' module name: a fresh one per file
    try:
      values(["prog", f"--config={path}"])
    except BaseException as e:  # pylint: disable=broad-except
      return path, e, values
    return path, None, values

  for source, want in (("def get_config():\n  raise RuntimeError('boom')\n", "RuntimeError: boom"),
                       ("def get_config(:\n", "SyntaxError: invalid syntax ({path}, line 1)"),
                       ("import nope_no_such_module\n",
                        "ModuleNotFoundError: No module named 'nope_no_such_module'"),
                       ("def get_config():\n  return {}['x']\n", "KeyError: 'x'")):
    path, error, _ = load_error(source)
    assert error is not None, source
    assert cli_paths.config_load_error(["prog", f"--config={path}"], error) == (
        f"invalid flags: --config={path}: the config file failed to load: "
        + want.format(path=path)), source
  path, error, _ = load_error("X = 1\n")
  assert cli_paths.config_load_error(["prog", f"--config={path}"], error) == (
      f"invalid flags: --config={path}: the config file has no get_config(); define "
      "get_config() returning an ml_collections.ConfigDict")
  # an override's own KeyError is not the file's: override_error names the field
  assert cli_paths.config_load_error(["prog", f"--config={path}"], KeyError("lrr")) is None
  path, error, values = load_error("def get_config():\n  return 5\n")
  assert error is None
  assert cli_paths.config_value_problem(["prog", f"--config={path}"], values) == (
      f"--config={path}: get_config() returned int, not an ml_collections.ConfigDict; return one")
  good = os.path.join(REPO, "configs", "zaya1_tiny.py")
  _, error, values = load_error(open(good).read().replace("from configs import base",
                                                          "import configs.base as base"))
  assert error is None and cli_paths.config_value_problem(["prog", f"--config={good}"], values) is None
