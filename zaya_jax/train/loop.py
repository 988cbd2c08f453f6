# Shape letters: L X (see zaya_jax/__init__.py).
"""`run(config, workdir)`: build everything, restore or initialise, train, evaluate, save.

Running the same command again resumes from the newest checkpoint in `workdir/checkpoints`
(parameters, balancing biases, optimizer, step, RNG key and data position), so a restarted
run continues bit-for-bit on CPU. Outputs in `workdir`:
  checkpoints/<step>/   Orbax checkpoints (see zaya_jax/checkpoint/__init__.py)
  metrics.jsonl         one JSON object per line: {"kind": "train" | "eval" | "summary", ...}
  config.json           the resolved RunConfig (as in every checkpoint), rewritten per start
  optimizer.txt         the optimizer's parameter groups
  tensorboard/          the same records as TensorBoard events (zaya_jax/train/metrics.py)

Fault tolerance (README "Fault tolerance"): the newest checkpoint that reads back intact is
used (`Checkpointer.restore_latest`); SIGTERM/SIGINT end the run after the current step with a
checkpoint (`StopSignals`), except during this run's first step (then nothing is saved, so an
interrupted first compile leaves no checkpoint); an update with a non-finite loss or gradient
is skipped, and `train.max_consecutive_skips` of them in a row restore the last checkpoint
while the data iterator keeps going (past the offending batches); a `Watchdog` (on by default:
max(`train.step_timeout_s`, `train.step_timeout_factor` x the median step time so far);
`step_timeout_s=0` = off) is armed around every call that can block the host after the first
step (data fetch and step, metrics fetch, evaluation, save, restore, the stop-signal
agreement) and exits 3 with every thread's stack when one overruns; an exception in
the loop that leaves the train state intact (a bad batch, an I/O error, a failed evaluation)
first checkpoints the last completed step (single-process runs). The loop reads each update's
skip flags one step late, so the host never waits for the step it just dispatched.

Phases (`_train`): restore or init, compile and header (zaya_jax/train/start.py); per step:
train, log, evaluate, save, stop; finish; summary. The console text: zaya_jax/train/console.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

from zaya_jax.config import ConfigError, RunConfig, cli_paths, resolve
from zaya_jax.logs import quiet_third_party
from zaya_jax.parallel import accelerators, distributed
from zaya_jax.parallel.mesh import check_divisibility, make_mesh, use_mesh
from zaya_jax.train import console
from zaya_jax.train.evaluate import evaluate_sets
from zaya_jax.train.fault import StopSignals
from zaya_jax.train.metrics import METRICS_FILE, MetricsWriter, with_perplexity
from zaya_jax.train.batches import DataError, global_batch, next_batch
from zaya_jax.train.rollback import Rollback
from zaya_jax.train.start import Compiled, Start, compile_and_header, restore_or_init
from zaya_jax.train.state import TrainState
from zaya_jax.train.step import BALANCE_PER_LAYER, BALANCE_SCALARS


class TrainingError(RuntimeError):
  """Training stopped on an error outside the model (e.g. the data); the message names the
  cause, the checkpoint written and how to resume (launch.train prints it as one line)."""


def run(config: ml_collections.ConfigDict, workdir: str, *,
        distributed_method: str | None = None) -> TrainState:
  """Trains the model described by `config`, resuming from `workdir` if it holds checkpoints.

  Once the config, the workdir and the mesh are checked (so that a bad one is the first line
  printed), process 0 logs the processes and devices (`distributed.describe`).

  Args:
    config: a ConfigDict from `configs/*.py`; validated here by `zaya_jax.config.resolve`.
    workdir: output directory (created if missing).
    distributed_method: how `distributed.maybe_initialize` started JAX's multi-controller
      runtime (its return value, e.g. "explicit"), for that line; None = a single process.

  Returns:
    The final TrainState.

  Raises:
    zaya_jax.config.ConfigError: for an invalid config (naming the field).
    ValueError: for a checkpoint that does not match the config or cannot be read.
    TrainingError: reading the data failed mid-run (after a checkpoint of the last step).
    Any exception of the loop, after a checkpoint of the last completed step (if the train
    state survived it; single-process runs).
  """
  quiet_third_party()  # also for `run` called from Python, not only from launch.train
  cfg: RunConfig = resolve(config, process_count=jax.process_count())
  train = cfg.train
  is_main = jax.process_index() == 0
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir} exists and is not a directory; pass a directory path")
  unwritable = cli_paths.unwritable_dir_problem(workdir, "--workdir", subdirs=("checkpoints",))
  if unwritable:  # found now, not at the first write after the data is listed
    raise ConfigError(unwritable)
  try:
    mesh = make_mesh(cfg.mesh)
    check_divisibility(mesh, num_experts=cfg.model.num_experts, hidden_size=cfg.model.hidden_size,
                       batch_size=train.batch_size, grad_accum_steps=train.grad_accum_steps,
                       seq_len=train.seq_len, halo=max(cfg.model.context_halo),
                       attention_impl=cfg.model.attention_impl)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if is_main:
    logging.info("%s: %s", f"distributed ({distributed_method})" if distributed_method
                 else "single process", distributed.describe())
  # Signals are taken over before anything slow starts: a stop before or during the first
  # step ends the run after it, without a checkpoint.
  with use_mesh(mesh), StopSignals() as stop, contextlib.ExitStack() as on_exit:
    return _train(cfg, workdir, mesh, is_main, stop, on_exit)


def _train(cfg: RunConfig, workdir: str, mesh: jax.sharding.Mesh, is_main: bool,
           stop: StopSignals, on_exit: contextlib.ExitStack) -> TrainState:
  """The phases of `run`, inside the mesh context, with `stop` installed; the data iterators
  are closed by `on_exit` (at the end, on a stop or an error). Returns the final TrainState."""
  start = restore_or_init(cfg, workdir, mesh, is_main, on_exit)
  run_start = time.perf_counter()  # the summary's total time: from here
  compiled = compile_and_header(start, workdir, mesh, is_main)
  loop = _Loop(start, compiled, workdir, is_main, run_start)
  with loop.checkpoint_on_error():
    while loop.steps_left():
      if not loop.train_one_step():  # rolled back to the last checkpoint: train on from there
        continue
      loop.log()
      loop.evaluate_if_due()
      loop.save_if_due()
      if loop.stop_requested(stop):
        break
      loop.record_step_time()
    loop.finish()
  loop.summary()
  return loop.state


class _Loop:
  """The loop's state between its phases (`_train`), one method per phase.

  Built after the start phases (zaya_jax/train/start.py), it opens metrics.jsonl, dropping
  the records after the resumed step (after step 0 for a fresh start: those of an attempt
  that left no checkpoint). Shared state: `state` (TrainState), `step` (its step, on the
  host), `saved_step` (the newest checkpoint step, None before one), `steps_this_run`,
  `times` (seconds of compile, train, eval, checkpoint; train_tokens), `window` (the steps
  since the last log line), `previous` (the last update's metrics, read one step late).
  """

  def __init__(self, start: Start, compiled: Compiled, workdir: str, is_main: bool,
               run_start: float):
    self.cfg, self.train, self.workdir, self.is_main = start.cfg, start.cfg.train, workdir, is_main
    self.built, self.step_fn, self.data_iter = start.built, start.train_step, start.data_iter
    self.ckpt, self.watchdog, self.state = start.ckpt, start.watchdog, start.state
    self.eval_sets, self.eval_step = start.eval_sets, compiled.eval_step
    self.eval_batches = [b for batches in start.eval_sets.values() for b in batches]
    self.peak_flops, self.flops_per_token = compiled.peak_flops, compiled.flops_per_token
    self.rollback = Rollback(start.cfg, start.ckpt, start.target, start.built.state_sharding,
                             is_main)
    self.step, self.run_start = int(self.state.step), run_start
    self.times = {"compile": compiled.compile_s, "train": 0.0, "eval": 0.0, "checkpoint": 0.0,
                  "train_tokens": 0}
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self.metrics_out = MetricsWriter(self.metrics_path, enabled=is_main,
                                     resume_step=0 if start.latest is None else start.latest)
    self.tokens_per_step = self.train.batch_size * self.train.seq_len
    self.saved_step, self.steps_this_run = start.latest, 0
    self.previous: dict[str, Any] | None = None  # the last update's metrics, checked one step late
    self.metrics: dict[str, Any] = {}  # the last update's metrics (device arrays)
    self.stop_reason: str | None = None  # the signal that ends the run
    self.first_step_stop = False  # it came during this run's first step: nothing saved
    self.window = console.LogWindow()
    self.window_steps_timed = 0  # steps timed in `window`
    self.first_start = self.iteration_start = time.perf_counter()
    self.excluded_before = 0.0  # eval + checkpoint seconds before this iteration
    self.last_eval: dict[str, Any] | None = None  # with its perplexity
    self.last_train_loss: float | None = None  # of the last log window
    self.poisoned: set[int] = set()  # injected steps: once each, so a rollback moves past them

  # ------------------------------------------------------------------ step, log and evaluate

  def steps_left(self) -> bool:
    """Whether to train another step: below train.num_steps and train.max_steps_per_run."""
    train = self.train
    return self.step < train.num_steps and not (
        train.max_steps_per_run and self.steps_this_run >= train.max_steps_per_run)

  def train_one_step(self) -> bool:
    """Fetches the next batch and dispatches one update (the run's first compiles, unguarded
    and untimed); then reads the previous update's flags, done by now. Returns False after a
    rollback (`state`, one update further, is discarded for the checkpoint's), else True.

    Raises:
      DataError: the data iterator failed.
      FloatingPointError: a rollback is due and impossible (`Rollback.restore`).
    """
    train = self.train
    if not self.steps_this_run:
      if self.is_main:
        logging.info("compiling the train step ...")
      self.first_start = time.perf_counter()
    self.iteration_start = time.perf_counter()
    self.excluded_before = self.times["eval"] + self.times["checkpoint"]
    guard = (self.watchdog.guard(f"train step {self.step + 1}") if self.steps_this_run
             else contextlib.nullcontext())
    with guard:
      batch = global_batch(next_batch(self.data_iter), self.built.data_sharding)
      if train.inject_nan_at_steps:
        poison = self.step + 1 in train.inject_nan_at_steps and self.step + 1 not in self.poisoned
        if poison:
          self.poisoned.add(self.step + 1)
        self.state, self.metrics = self.step_fn(self.state, batch, np.bool_(poison))
      else:
        self.state, self.metrics = self.step_fn(self.state, batch)
      self.step += 1
      self.steps_this_run += 1
      self.window.add(self.metrics["loss"])
      if self.steps_this_run == 1:  # Keep compilation out of the throughput numbers.
        jax.block_until_ready(self.metrics)
        seconds = time.perf_counter() - self.first_start
        self.times["compile"] += seconds
        memory, _ = accelerators.peak_memory_bytes()
        if self.is_main:
          logging.info("train step compiled in %.1f s (first step included; peak memory %s)",
                       seconds, console.gib(memory))
        self.window.reset()
        self.window.add(self.metrics["loss"])  # its loss counts, its time does not
        self.window_steps_timed = 0
      else:
        self.window_steps_timed += 1
      if self.rollback.check(self.previous):
        self.state, restored_step = self.rollback.restore(self.previous, self.saved_step,
                                                          self.data_iter)
        if self.is_main:  # the steps after the checkpoint are trained again: one record per step
          self.metrics_out.close()
          self.metrics_out = MetricsWriter(self.metrics_path, enabled=True,
                                           resume_step=restored_step)
        self.step = self.saved_step = int(self.state.step)
        self.previous = None
        self.window.reset()
        self.window_steps_timed = 0
        return False
      self.previous = {**self.metrics, "step": self.step}
    return True

  def log(self) -> None:
    """Every train.log_every steps and at the last: the train record of the log window
    (metrics.jsonl) and its console line. Arms the watchdog first: the step's collectives
    finish in the fetch (it stays armed through evaluation and save)."""
    train, step = self.train, self.step
    self.watchdog.arm(f"fetching the metrics of step {step}")
    if not (step % train.log_every == 0 or step == train.num_steps):
      return
    m = jax.device_get(self.metrics)
    elapsed = self.window.elapsed()
    self.last_train_loss = self.window.mean_loss()
    self.times["train"] += elapsed
    self.times["train_tokens"] += self.window_steps_timed * self.tokens_per_step
    end = train.num_steps if not train.max_steps_per_run else min(
        train.num_steps, step - self.steps_this_run + train.max_steps_per_run)
    rates = console.throughput(self.window_steps_timed, elapsed, self.tokens_per_step,
                               jax.device_count(), self.flops_per_token, self.peak_flops,
                               end - step)
    record = {
        "kind": "train", "step": step, "loss": self.last_train_loss,
        "loss_last": float(m["loss"]), "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
        "tokens": float(m["tokens"]),
        "data/padding_fraction": 1.0 - float(m["tokens"]) / self.tokens_per_step,  # logged step
        **rates, "peak_memory_bytes": accelerators.peak_memory_bytes()[0],
        "skipped_steps": int(m["skipped_steps"]),
        "moe/dropped_fraction": float(m["moe/dropped_fraction"]),
        "expert_load": np.asarray(m["expert_load"]).tolist(),
        **{k: float(m[k]) for k in BALANCE_SCALARS},
        **{k: np.asarray(m[k]).tolist() for k in BALANCE_PER_LAYER},
    }
    self.metrics_out.write(record)
    if self.is_main:
      logging.info("%s", console.step_line(step, train.num_steps, record))
    self.window.reset()
    self.window_steps_timed = 0

  def evaluate_if_due(self) -> None:
    """Every train.eval_every steps (not at the last step: `finish` evaluates there)."""
    train = self.train
    if train.eval_every and self.step % train.eval_every == 0 and self.step != train.num_steps:
      self._evaluate()

  def _evaluate(self) -> None:
    """The eval record of the current state (metrics.jsonl) and its console line, its time
    kept out of the log window; nothing without eval batches."""
    if not self.eval_batches:
      return
    jax.block_until_ready(self.state.step)  # the train steps dispatched so far stay in the window
    start = time.perf_counter()
    with self.window.excluded(), self.watchdog.guard(f"evaluation at step {self.step}",
                                                     len(self.eval_batches)):
      record = {"kind": "eval", "step": self.step,
                **evaluate_sets(self.eval_step, self.state, self.eval_sets)}
    seconds = time.perf_counter() - start
    self.times["eval"] += seconds
    record["eval_time_s"] = seconds
    self.metrics_out.write(record)
    self.last_eval = with_perplexity(record)
    if self.is_main:
      logging.info("%s", console.eval_line(self.step, record,
                                           self.last_eval.get("perplexity", float("nan")),
                                           seconds))

  # ------------------------------------------------------------------ save and stop

  def save_if_due(self) -> None:
    """Every checkpoint.every_steps steps."""
    every = self.cfg.checkpoint.every_steps
    if every and self.step % every == 0:
      self.saved_step = self._save()

  def _save(self) -> int:
    """Checkpoints the current state and data position (time kept out of the log window);
    returns the step saved."""
    jax.block_until_ready(self.state.step)
    start = time.perf_counter()
    with self.window.excluded(), self.watchdog.guard(f"checkpoint save at step {self.step}"):
      saved = self.ckpt.save(self.state, self.data_iter, self.cfg)
    seconds = time.perf_counter() - start
    self.times["checkpoint"] += seconds
    if self.is_main:
      logging.info("%s", console.saved_line(saved, seconds, self.cfg.checkpoint.async_save))
    return saved

  def stop_requested(self, stop: StopSignals) -> bool:
    """Whether any process received a stop signal (a collective, under the watchdog; a True
    leaves it armed for `finish`). Sets `stop_reason`."""
    self.watchdog.arm(f"agreeing on stop signals after step {self.step}")  # a collective
    if stop.any_process():
      self.stop_reason = stop.received or "a stop signal on another process"
      return True
    self.watchdog.disarm()
    return False

  def record_step_time(self) -> None:
    """The iteration's wall time, evaluation and save left out, into the watchdog's median
    (not the first step's: it compiled)."""
    if self.steps_this_run > 1:
      self.watchdog.record_step(time.perf_counter() - self.iteration_start
                                - (self.times["eval"] + self.times["checkpoint"]
                                   - self.excluded_before))

  def finish(self) -> None:
    """After the last step: logs a skip of the last update, evaluates at train.num_steps and
    checkpoints the last step, then waits for the checkpoint writes. A stop during this run's
    first step (typically its compilation) saves nothing: a fresh run leaves no checkpoint to
    pin its model config, a resumed one keeps its last."""
    self.watchdog.arm(f"reading the flags of step {self.step}")
    if self.rollback.check(self.previous) and self.is_main:  # logged, no rollback
      logging.warning("the run ends on %d consecutive skipped updates",
                      int(self.previous["consecutive_skips"]))
    self.watchdog.disarm()
    self.first_step_stop = bool(self.stop_reason) and self.steps_this_run == 1
    if self.steps_this_run and self.step == self.train.num_steps and not self.first_step_stop:
      self._evaluate()
    if self.step != self.saved_step and not self.first_step_stop:
      self.saved_step = self._save()
    with self.watchdog.guard("waiting for the last checkpoint to be written"):
      self.ckpt.close()  # Waits for asynchronous saves: the process may exit right after.

  @contextlib.contextmanager
  def checkpoint_on_error(self) -> Iterator[None]:
    """On an exception in the loop, checkpoints the last completed step if the train state
    is intact (its buffers not donated to a failed step), then re-raises; an error reading
    the data becomes a one-line TrainingError.

    Raises:
      TrainingError: for a `DataError` (naming the checkpoint and how to resume).
      The exception itself otherwise.
    """
    try:
      yield
    except Exception as e:  # KeyboardInterrupt (a second Ctrl-C) is not caught: no save
      state, ckpt = self.state, self.ckpt
      intact = not any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
      written = None
      if (isinstance(e, FloatingPointError) or not intact or not self.steps_this_run
          or int(state.step) == self.saved_step):
        pass  # a diverged run, a state lost with the failed step, nothing new, or saved already
      elif jax.process_count() > 1:  # the others are in the next collective: no joint save
        logging.error("no checkpoint of step %d: an error on one of %d processes cannot be "
                      "agreed on; the newest checkpoint is %s", int(state.step),
                      jax.process_count(), self.saved_step)
      else:
        try:
          self.saved_step = written = self._save()
          with self.watchdog.guard("writing the checkpoint after an error"):
            ckpt.wait()
          logging.error("error at step %d: %s; checkpoint %d written to %s", self.step + 1,
                        type(e).__name__, written, ckpt.directory)
        except Exception as save_error:  # pylint: disable=broad-except
          logging.error("could not checkpoint step %d after the error: %s", int(state.step),
                        save_error)
          written = None
      if isinstance(e, DataError):
        where = (f"checkpoint {written} (the last completed step) is in {ckpt.directory}"
                 if written is not None else f"the newest checkpoint is {self.saved_step}")
        raise TrainingError(f"step {self.step + 1}: reading the next batch failed: "
                            f"{e.__cause__}; {where}. Fix the data and rerun the same command "
                            "to resume.") from e
      raise
    finally:
      self.watchdog.disarm()

  # ------------------------------------------------------------------ summary

  def summary(self) -> None:
    """The summary record (metrics.jsonl, then closed) and the console's end-of-run block
    (process 0), with what a stop signal left and how to resume."""
    train, times = self.train, self.times
    ended = console.run_ended(stop_reason=self.stop_reason, step=self.step,
                              num_steps=train.num_steps, steps_this_run=self.steps_this_run,
                              max_steps_per_run=train.max_steps_per_run)
    times["total"] = time.perf_counter() - self.run_start
    tokens_this_run = self.steps_this_run * self.tokens_per_step
    self.metrics_out.write({
        "kind": "summary", "step": self.step, "ended": ended,
        "steps_this_run": self.steps_this_run, "tokens_this_run": tokens_this_run,
        "train_loss": self.last_train_loss,
        "eval_loss": self.last_eval["loss"] if self.last_eval else None,
        "tokens_per_s": console.mean_tokens_per_s(times),
        "step_time_median_s": self.watchdog.median_step_s,  # what the watchdog's bound follows
        **{f"{k}_time_s": times[k] for k in ("total", "compile", "train", "eval", "checkpoint")}})
    tensorboard_dir = self.metrics_out.tensorboard_dir
    self.metrics_out.close()
    if self.is_main:
      logging.info("%s", "\n".join(console.summary_lines(
          ended=ended, steps_this_run=self.steps_this_run, times=times,
          tokens_this_run=tokens_this_run, train_loss=self.last_train_loss,
          eval_record=self.last_eval, checkpoint_step=self.saved_step,
          checkpoint_dir=self.ckpt.directory, metrics_path=self.metrics_path,
          tensorboard_dir=tensorboard_dir)))
      warning = console.stop_warning(
          stop_reason=self.stop_reason, first_step_stop=self.first_step_stop, step=self.step,
          num_steps=train.num_steps, checkpoint_step=self.saved_step,
          checkpoint_dir=self.ckpt.directory, workdir=self.workdir)
      if warning:
        logging.warning("%s", warning)
