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
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from zaya_jax.checkpoint import Checkpointer, config_record
from zaya_jax.config import ConfigError, RunConfig, cli_paths, resolve
from zaya_jax.logs import quiet_third_party
from zaya_jax.data import list_documents, make_eval_sets, make_train_iterator, prepared
from zaya_jax.data.global_iterator import GlobalBatchIterator
from zaya_jax.model import sizing
from zaya_jax.parallel import accelerators
from zaya_jax.parallel.mesh import abstract_with_shardings, check_divisibility, make_mesh, use_mesh
from zaya_jax.train import console
from zaya_jax.train.evaluate import evaluate_sets
from zaya_jax.train.fault import StopSignals, Watchdog
from zaya_jax.train.init_from import initial_state
from zaya_jax.train.metrics import METRICS_FILE, MetricsWriter, with_perplexity
from zaya_jax.train.optim import describe_optimizer, schedule_horizon
from zaya_jax.train.schedule_extend import extend_schedule
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import TrainState, init_train_state
from zaya_jax.train.step import BALANCE_PER_LAYER, BALANCE_SCALARS, make_eval_step

# A run that goes non-finite again after this many rollbacks to one checkpoint stops.
MAX_ROLLBACKS_PER_CHECKPOINT = 3


class TrainingError(RuntimeError):
  """Training stopped on an error outside the model (e.g. the data); the message names the
  cause, the checkpoint written and how to resume (launch.train prints it as one line)."""


def global_batch(batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
  """This process's `[B / processes, T]` numpy batch -> global `[B, T]` arrays in `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


class _DataError(Exception):
  """Raised from the data iterator (the cause): an error of the data, not of training."""


def _next_batch(data_iter) -> dict[str, np.ndarray]:
  """`next(data_iter)`, with any error wrapped in `_DataError`.

  A batch made by grain's worker processes (data.num_workers > 0) lives in shared memory
  (numpy subclasses); it is copied into plain arrays here, so the shared memory is released
  as soon as the batch is read, not when the garbage collector reaches the device arrays
  that alias it (after the run's end, so the resource tracker warned of leaked
  shared_memory objects at every exit).
  """
  try:
    batch = next(data_iter)
  except Exception as e:
    raise _DataError(str(e)) from e
  return {k: v if type(v) is np.ndarray else np.array(v) for k, v in batch.items()}


def run(config: ml_collections.ConfigDict, workdir: str) -> TrainState:
  """Trains the model described by `config`, resuming from `workdir` if it holds checkpoints.

  Args:
    config: a ConfigDict from `configs/*.py`; validated here by `zaya_jax.config.resolve`.
    workdir: output directory (created if missing).

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
                       batch_size=train.batch_size, grad_accum_steps=train.grad_accum_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  # Signals are taken over before anything slow starts: a stop before or during the first
  # step ends the run after it, without a checkpoint.
  with use_mesh(mesh), StopSignals() as stop, contextlib.ExitStack() as on_exit:
    return _train(cfg, workdir, mesh, is_main, stop, on_exit)


def _close_data(data_iter) -> None:
  """Closes a data iterator (grain's: its worker processes and their shared memory)."""
  close = getattr(data_iter, "close", None)
  if close is not None:
    close()


def _train(cfg: RunConfig, workdir: str, mesh: jax.sharding.Mesh, is_main: bool,
           stop: StopSignals, on_exit: contextlib.ExitStack) -> TrainState:
  """The training loop of `run`, inside the mesh context, with `stop` installed; the data
  iterators are closed by `on_exit` (at the end, on a stop or an error)."""
  train = cfg.train
  built = setup_training(cfg.model, train, mesh, cfg.balance,
                         fault_injection=bool(train.inject_nan_at_steps))
  graphdef, params_shape, tx = built.graphdef, built.params_shape, built.tx
  abstract_state, state_sharding, data_sharding = (built.abstract_state, built.state_sharding,
                                                   built.data_sharding)
  train_step = built.step

  local_batch = train.batch_size // jax.process_count()
  try:  # Bad data settings (no files, missing text field, ...) are user errors: one line.
    # A raw corpus is listed once, here; the training iterator, eval and header reuse it.
    documents = None if prepared.uses_prepared(cfg.data) else list_documents(cfg.data)
    data_iter = make_train_iterator(cfg.data, seq_len=train.seq_len, batch_size=local_batch,
                                    seed=train.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count(), documents=documents)
    on_exit.callback(_close_data, data_iter)
    # Prepared corpora are opened once, by the training iterator; eval and header reuse them.
    opened = data_iter.corpora if isinstance(data_iter, GlobalBatchIterator) else None
    eval_sets = {}  # source name ("" for one corpus) -> its eval batches
    if train.eval_batches:
      eval_sets = {name: [global_batch(b, data_sharding) for b in batches]
                   for name, batches in make_eval_sets(
                       cfg.data, corpora=opened, documents=documents, seq_len=train.seq_len,
                       batch_size=local_batch,
                       max_batches=train.eval_batches, process_index=jax.process_index(),
                       process_count=jax.process_count()).items()}
    eval_batches = [b for batches in eval_sets.values() for b in batches]
  except ValueError as e:
    raise ConfigError(str(e)) from e

  os.makedirs(workdir, exist_ok=True)  # only once the config and the data are known to be good
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
  target = abstract_with_shardings(abstract_state, state_sharding)
  watchdog = Watchdog(train.step_timeout_s, train.step_timeout_factor)
  with watchdog.guard("restoring the newest checkpoint"):  # reads and collectives
    restored = ckpt.restore_latest(target, data_iter, cfg)
  if restored is None and train.init_from:  # a new run from another run's or an HF model
    state, source = initial_state(train.init_from, cfg, tx, abstract_state, state_sharding)
    latest = None
    if is_main:
      logging.info("initialised from %s (%s): %d parameters; optimizer and step fresh",
                   train.init_from, source, sum(x.size for x in jax.tree.leaves(state.params)))
  elif restored is None:
    state, latest = init_train_state(cfg.model, tx, train.seed, mesh), None
  else:
    state, latest, data_restored = restored
    if train.init_from and is_main:
      logging.info("train.init_from=%s ignored: resuming from checkpoint %d in %s",
                   train.init_from, latest, ckpt.directory)
    if not data_restored:  # saved by another process count: the positions mean other documents
      _close_data(data_iter)
      data_iter = make_train_iterator(cfg.data, seq_len=train.seq_len, batch_size=local_batch,
                                      seed=train.seed + latest, process_index=jax.process_index(),
                                      process_count=jax.process_count(), documents=documents)
      on_exit.callback(_close_data, data_iter)
    resumed = extend_schedule(ckpt.saved_config(latest)["train"], train, latest)
    if schedule_horizon(resumed) != schedule_horizon(train):  # rebuilt before its first call
      train_step = setup_training(cfg.model, resumed, mesh, cfg.balance,
                                  fault_injection=bool(train.inject_nan_at_steps)).step
    cfg = dataclasses.replace(cfg, train=resumed)  # saved with the checkpoints: the horizon
    train = cfg.train
  step = int(state.step)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  if step >= train.num_steps and is_main:
    logging.warning("checkpoint step %d >= train.num_steps=%d: nothing to train; raise "
                    "--config.train.num_steps to continue (see train.schedule_extend for the "
                    "learning rate)", step, train.num_steps)
  times = {"compile": 0.0, "train": 0.0, "eval": 0.0, "checkpoint": 0.0, "train_tokens": 0}
  run_start = time.perf_counter()
  profile = accelerators.detect_profile()
  peak_measured = profile is None and jax.devices()[0].platform == "cpu"
  if profile is not None:
    try:
      peak_flops = profile.peak_flops(cfg.model.dtype) * jax.device_count()
    except ValueError:  # a dtype without a profile figure
      peak_flops = None
  elif peak_measured:  # the devices of a CPU host share its cores: one peak per process
    peak_flops = accelerators.measure_matmul_peak(size=1024, repeats=3) * jax.process_count()
  else:
    peak_flops = None
  flops_per_token = sizing.train_flops_per_token(cfg.model, train.seq_len)
  if is_main:
    counts = sizing.count_params(cfg.model)
    console.write_json_atomic(os.path.join(workdir, "config.json"), config_record(cfg))
    with open(os.path.join(workdir, "optimizer.txt"), "w", encoding="utf-8") as f:
      f.write(describe_optimizer(train, params_shape) + "\n")
    header = console.header_lines(
        resuming=latest is not None, step=step, num_steps=train.num_steps,
        params_total=counts.total, params_active=counts.active, layers=cfg.model.num_layers,
        experts=cfg.model.num_experts, devices=jax.device_count(),
        processes=jax.process_count(), mesh_shape=dict(mesh.shape), workdir=workdir,
        accelerator=profile.name if profile else jax.devices()[0].platform,
        peak_flops=peak_flops, peak_measured=peak_measured, batch_size=train.batch_size,
        seq_len=train.seq_len,
        data=console.data_summary(cfg.data, train.num_steps * train.batch_size * train.seq_len,
                                  corpora=opened, documents=documents))
    logging.info("%s", "\n".join(header))
    if train.inject_nan_at_steps:
      logging.warning("train.inject_nan_at_steps=%s: NaN loss and gradients will be injected "
                      "(a test-only setting)", train.inject_nan_at_steps)

  poisoned: set[int] = set()  # injected steps: once each per process, so a rollback moves past them
  eval_step = make_eval_step(graphdef, state_sharding, data_sharding)
  if eval_batches:  # compiled now, so that every evaluation can run under the watchdog
    if is_main:
      logging.info("compiling the eval step ...")
    start = time.perf_counter()
    eval_step = eval_step.lower(target, eval_batches[0]).compile()
    times["compile"] += time.perf_counter() - start
    if is_main:
      logging.info("eval step compiled in %.1f s%s", time.perf_counter() - start,
                   console.memory_analysis(eval_step))
  # Drops records > latest (> 0 for a fresh start: those of an attempt that left no checkpoint).
  metrics_out = MetricsWriter(metrics_path, enabled=is_main,
                              resume_step=0 if latest is None else latest)
  tokens_per_step = train.batch_size * train.seq_len
  saved_step = latest
  evals_run = 0
  last_eval: dict[str, Any] | None = None
  window = console.LogWindow()
  last_train_loss: float | None = None
  rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it

  def run_eval():
    nonlocal evals_run, last_eval
    if not eval_batches:
      return
    jax.block_until_ready(state.step)  # the train steps dispatched so far stay in the window
    start = time.perf_counter()
    with window.excluded(), watchdog.guard(f"evaluation at step {step}", len(eval_batches)):
      record = {"kind": "eval", "step": step, **evaluate_sets(eval_step, state, eval_sets)}
    seconds = time.perf_counter() - start
    times["eval"] += seconds
    evals_run += 1
    record["eval_time_s"] = seconds
    metrics_out.write(record)
    last_eval = with_perplexity(record)
    if is_main:
      logging.info("eval step %d | loss %.4f | ppl %.2f | %d tokens | %.1f s%s", step,
                   record["loss"], last_eval.get("perplexity", float("nan")), record["tokens"],
                   seconds, "".join(f" | {name} {r['loss']:.4f}"
                                    for name, r in record.get("sources", {}).items()))

  def save():
    jax.block_until_ready(state.step)
    start = time.perf_counter()
    with window.excluded(), watchdog.guard(f"checkpoint save at step {step}"):
      saved = ckpt.save(state, data_iter, cfg)
    seconds = time.perf_counter() - start
    times["checkpoint"] += seconds
    if is_main:
      logging.info("saved checkpoint %d in %.2f s%s", saved, seconds,
                   " (async: the call; writing goes on in the background)"
                   if cfg.checkpoint.async_save else "")
    return saved

  def rollback(bad: dict[str, Any]) -> TrainState:
    """Restores the last checkpoint after `max_consecutive_skips` non-finite updates."""
    nonlocal metrics_out
    if saved_step is None:
      raise FloatingPointError(
          f"{int(bad['consecutive_skips'])} consecutive updates up to step {bad['step']} had a "
          "non-finite loss or gradient and there is no checkpoint to roll back to. Lower "
          "train.lr, raise train.warmup_steps, or check the data.")
    rollbacks[saved_step] = rollbacks.get(saved_step, 0) + 1
    if rollbacks[saved_step] > MAX_ROLLBACKS_PER_CHECKPOINT:
      raise FloatingPointError(
          f"rolled back to checkpoint {saved_step} {MAX_ROLLBACKS_PER_CHECKPOINT} times and the "
          "loss still goes non-finite: the model diverges whatever the data. Lower train.lr "
          "or resume from an earlier checkpoint.")
    if is_main:
      logging.warning(
          "%d consecutive non-finite updates (steps %d-%d): restoring checkpoint %d%s",
          int(bad["consecutive_skips"]), bad["step"] - int(bad["consecutive_skips"]) + 1,
          bad["step"], saved_step, "; the data iterator keeps its position, so the batches "
          "since that checkpoint are skipped" if train.skip_data_on_rollback else
          "; the data iterator goes back too (train.skip_data_on_rollback=False)")
    # The newest intact checkpoint: `saved_step`, unless it fails to read back (then older).
    restored = ckpt.restore_latest(target, None if train.skip_data_on_rollback else data_iter, cfg)
    skipped = jax.device_put(np.int32(bad["skipped_steps"]), state_sharding.skipped_steps)
    zero = jax.device_put(np.int32(0), state_sharding.consecutive_skips)
    if is_main:  # the steps after the checkpoint are trained again: one record per step
      metrics_out.close()
      metrics_out = MetricsWriter(metrics_path, enabled=True, resume_step=restored.step)
    return restored.state.replace(skipped_steps=skipped, consecutive_skips=zero)

  def check_previous(prev: dict[str, Any] | None) -> bool:
    """Reads the flags of the previous update (done by now); True if it is time to roll back."""
    if prev is None:
      return False
    flags = jax.device_get({k: prev[k] for k in ("skipped", "skipped_steps", "consecutive_skips")})
    if flags["skipped"] and is_main:
      logging.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in "
                      "this run so far)", prev["step"], flags["consecutive_skips"],
                      flags["skipped_steps"])
    prev.update(flags)
    return bool(train.max_consecutive_skips and
                flags["consecutive_skips"] >= train.max_consecutive_skips)

  @contextlib.contextmanager
  def checkpoint_on_error():
    """On an exception in the loop, checkpoints the last completed step if the train state
    is intact (its buffers not donated to a failed step), then re-raises; an error reading
    the data becomes a one-line TrainingError."""
    nonlocal saved_step
    try:
      yield
    except Exception as e:  # KeyboardInterrupt (a second Ctrl-C) is not caught: no save
      intact = not any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
      written = None
      if (isinstance(e, FloatingPointError) or not intact or not steps_this_run
          or int(state.step) == saved_step):
        pass  # a diverged run, a state lost with the failed step, nothing new, or saved already
      elif jax.process_count() > 1:  # the others are in the next collective: no joint save
        logging.error("no checkpoint of step %d: an error on one of %d processes cannot be "
                      "agreed on; the newest checkpoint is %s", int(state.step),
                      jax.process_count(), saved_step)
      else:
        try:
          saved_step = written = save()
          with watchdog.guard("writing the checkpoint after an error"):
            ckpt.wait()
          logging.error("error at step %d: %s; checkpoint %d written to %s", step + 1,
                        type(e).__name__, written, ckpt.directory)
        except Exception as save_error:  # pylint: disable=broad-except
          logging.error("could not checkpoint step %d after the error: %s", int(state.step),
                        save_error)
          written = None
      if isinstance(e, _DataError):
        where = (f"checkpoint {written} (the last completed step) is in {ckpt.directory}"
                 if written is not None else f"the newest checkpoint is {saved_step}")
        raise TrainingError(f"step {step + 1}: reading the next batch failed: {e.__cause__}; "
                            f"{where}. Fix the data and rerun the same command to resume.") from e
      raise
    finally:
      watchdog.disarm()

  steps_this_run = 0
  previous: dict[str, Any] | None = None  # the last update's metrics, checked one step late
  stop_reason = None
  window_steps_timed, first_start = 0, time.perf_counter()  # steps timed in `window`
  with checkpoint_on_error():
    while step < train.num_steps and not (
        train.max_steps_per_run and steps_this_run >= train.max_steps_per_run):
      if not steps_this_run:
        if is_main:
          logging.info("compiling the train step ...")
        first_start = time.perf_counter()
      iteration_start, excluded_before = time.perf_counter(), times["eval"] + times["checkpoint"]
      guard = watchdog.guard(f"train step {step + 1}") if steps_this_run else contextlib.nullcontext()
      with guard:
        batch = global_batch(_next_batch(data_iter), data_sharding)
        if train.inject_nan_at_steps:
          poison = step + 1 in train.inject_nan_at_steps and step + 1 not in poisoned
          if poison:
            poisoned.add(step + 1)
          state, metrics = train_step(state, batch, np.bool_(poison))
        else:
          state, metrics = train_step(state, batch)
        step += 1
        steps_this_run += 1
        window.add(metrics["loss"])
        if steps_this_run == 1:  # Keep compilation out of the throughput numbers.
          jax.block_until_ready(metrics)
          seconds = time.perf_counter() - first_start
          times["compile"] += seconds
          memory, _ = accelerators.peak_memory_bytes()
          if is_main:
            logging.info("train step compiled in %.1f s (first step included; peak memory %s)",
                         seconds, console.gib(memory))
          first_loss = metrics["loss"]
          window.reset()
          window.add(first_loss)  # its loss counts, its time does not
          window_steps_timed = 0
        else:
          window_steps_timed += 1
        if check_previous(previous):  # `state` (one update further) is discarded
          state = rollback(previous)
          step, saved_step, previous = int(state.step), int(state.step), None
          window.reset()
          window_steps_timed = 0
          continue
        previous = {**metrics, "step": step}
      watchdog.arm(f"fetching the metrics of step {step}")  # the step's collectives finish here
      if step % train.log_every == 0 or step == train.num_steps:
        m = jax.device_get(metrics)
        elapsed = window.elapsed()
        last_train_loss = window.mean_loss()
        times["train"] += elapsed
        times["train_tokens"] += window_steps_timed * tokens_per_step
        end = train.num_steps if not train.max_steps_per_run else min(
            train.num_steps, step - steps_this_run + train.max_steps_per_run)
        rates = console.throughput(window_steps_timed, elapsed, tokens_per_step,
                                   jax.device_count(), flops_per_token, peak_flops, end - step)
        record = {
            "kind": "train", "step": step, "loss": last_train_loss, "loss_last": float(m["loss"]),
            "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]), "tokens": float(m["tokens"]),
            "data/padding_fraction": 1.0 - float(m["tokens"]) / tokens_per_step,  # logged step
            **rates, "peak_memory_bytes": accelerators.peak_memory_bytes()[0],
            "skipped_steps": int(m["skipped_steps"]),
            "moe/dropped_fraction": float(m["moe/dropped_fraction"]),
            "expert_load": np.asarray(m["expert_load"]).tolist(),
            **{k: float(m[k]) for k in BALANCE_SCALARS},
            **{k: np.asarray(m[k]).tolist() for k in BALANCE_PER_LAYER},
        }
        metrics_out.write(record)
        if is_main:
          logging.info("%s", console.step_line(step, train.num_steps, record))
        window.reset()
        window_steps_timed = 0
      if train.eval_every and step % train.eval_every == 0 and step != train.num_steps:
        run_eval()
      if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
        saved_step = save()
      watchdog.arm(f"agreeing on stop signals after step {step}")  # a collective
      if stop.any_process():
        stop_reason = stop.received or "a stop signal on another process"
        break
      watchdog.disarm()
      if steps_this_run > 1:  # the watchdog's median step time; the first step compiled
        watchdog.record_step(time.perf_counter() - iteration_start
                             - (times["eval"] + times["checkpoint"] - excluded_before))

    watchdog.arm(f"reading the flags of step {step}")
    if check_previous(previous) and is_main:  # the last update's flags: log a skip, no rollback
      logging.warning("the run ends on %d consecutive skipped updates",
                      int(previous["consecutive_skips"]))
    watchdog.disarm()
    # A stop during this run's first step (typically its compilation) saves nothing: a fresh
    # run leaves no checkpoint to pin its model config, a resumed one keeps its last.
    first_step_stop = bool(stop_reason) and steps_this_run == 1
    if steps_this_run and step == train.num_steps and not first_step_stop:
      run_eval()
    if step != saved_step and not first_step_stop:
      saved_step = save()
    with watchdog.guard("waiting for the last checkpoint to be written"):
      ckpt.close()  # Waits for asynchronous saves: the process may exit right after.
  if stop_reason:
    ended = f"stopped by {stop_reason}"
  elif step >= train.num_steps:
    ended = "finished" if steps_this_run else "nothing to train (num_steps reached)"
  else:
    ended = f"train.max_steps_per_run={train.max_steps_per_run} reached"
  times["total"] = time.perf_counter() - run_start
  tokens_this_run = steps_this_run * tokens_per_step
  metrics_out.write({
      "kind": "summary", "step": step, "ended": ended, "steps_this_run": steps_this_run,
      "tokens_this_run": tokens_this_run, "train_loss": last_train_loss,
      "eval_loss": last_eval["loss"] if last_eval else None,
      "tokens_per_s": times["train_tokens"] / times["train"] if times["train"] else None,
      "step_time_median_s": watchdog.median_step_s,  # what the watchdog's bound follows
      **{f"{k}_time_s": times[k] for k in ("total", "compile", "train", "eval", "checkpoint")}})
  tensorboard_dir = metrics_out.tensorboard_dir
  metrics_out.close()
  if is_main:
    logging.info("%s", "\n".join(console.summary_lines(
        ended=ended, steps_this_run=steps_this_run, times=times,
        tokens_this_run=tokens_this_run, train_loss=last_train_loss, eval_record=last_eval,
        checkpoint_step=saved_step, checkpoint_dir=ckpt.directory, metrics_path=metrics_path,
        tensorboard_dir=tensorboard_dir)))
    if first_step_stop:
      logging.warning("Stopped by %s during the first step of this run: nothing was saved; %s",
                      stop_reason, f"checkpoint {saved_step} in {ckpt.directory} is unchanged. "
                      "Rerun the same command to resume." if saved_step is not None else
                      f"{workdir} holds no checkpoint, so the next run starts over (with any "
                      "config).")
    elif stop_reason:
      logging.warning("Stopped by %s at step %d/%d; checkpoint %d is in %s. Rerun the same "
                      "command to resume.", stop_reason, step, train.num_steps, saved_step,
                      ckpt.directory)
  return state
