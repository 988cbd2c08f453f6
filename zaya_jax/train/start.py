# Shape letters: B T (see zaya_jax/__init__.py).
"""The start of a run (`zaya_jax.train.loop.run`), before its first step, in two phases.

Restore or init: `restore_or_init` builds the jitted train step (`setup_training`) and opens
the data: the training iterator and the evaluation batches, from a raw corpus listed once or
prepared corpora opened once (the console header reuses both). Then it takes, in order:
  1. the newest checkpoint of `workdir/checkpoints` that reads back intact (parameters,
     balancing biases, optimizer, step, RNG key and data position). A data position saved by
     another process count cannot be restored: the data order restarts at seed + step. The
     saved schedule is extended to the new `train.num_steps` (`extend_schedule`), and the
     step is rebuilt if its horizon moved;
  2. else `train.init_from` (another run's checkpoint or a Hugging Face directory: parameters
     only, optimizer and step fresh);
  3. else a fresh state from `train.seed`.

Compile and header: `compile_and_header` finds the run's peak FLOP/s, writes
WORKDIR/config.json and optimizer.txt, prints the console header (process 0) and compiles the
eval step ahead of time, so that every evaluation runs under the watchdog.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, NamedTuple

import jax
from absl import logging

from zaya_jax.checkpoint import Checkpointer, config_record
from zaya_jax.config import ConfigError, RunConfig
from zaya_jax.data import list_documents, make_eval_sets, make_train_iterator, prepared
from zaya_jax.data.global_iterator import GlobalBatchIterator
from zaya_jax.model import sizing
from zaya_jax.parallel import accelerators
from zaya_jax.parallel.mesh import abstract_with_shardings
from zaya_jax.train import console
from zaya_jax.train.batches import close_data, global_batch
from zaya_jax.train.fault import Watchdog
from zaya_jax.train.init_from import initial_state
from zaya_jax.train.optim import describe_optimizer, schedule_horizon
from zaya_jax.train.schedule_extend import extend_schedule
from zaya_jax.train.setup import TrainSetup, setup_training
from zaya_jax.train.state import TrainState, init_train_state
from zaya_jax.train.step import make_eval_step


class Start(NamedTuple):
  """What the loop starts from.

  Attributes:
    cfg: the run's config; on a resume its `train` carries the extended schedule (saved with
      the checkpoints: the horizon).
    built: the static pieces of the step (graphdef, shapes, shardings, optimizer).
    train_step: the jitted step to run (`built.step`, or rebuilt for a moved horizon).
    data_iter: the training iterator (closed by `on_exit`).
    corpora: the prepared corpora opened by the training iterator, or None (raw text).
    documents: the raw corpus as listed once (`list_documents`), or None (prepared).
    eval_sets: source name ("" for one corpus) -> its global `[B, T]` eval batches ({} with
      train.eval_batches=0).
    ckpt: the Checkpointer of `workdir/checkpoints`.
    target: the abstract TrainState with its shardings (what a restore reads into).
    watchdog: the run's Watchdog (it guarded the restore).
    state: the TrainState to train on.
    latest: the checkpoint step resumed from, or None for a new run.
  """

  cfg: RunConfig
  built: TrainSetup
  train_step: Callable[..., Any]
  data_iter: Any
  corpora: list | None
  documents: list | None
  eval_sets: dict[str, list[dict[str, jax.Array]]]
  ckpt: Checkpointer
  target: TrainState
  watchdog: Watchdog
  state: TrainState
  latest: int | None


class Compiled(NamedTuple):
  """What `compile_and_header` leaves to the loop.

  Attributes:
    eval_step: the eval step, AOT-compiled when there are eval batches (else jitted).
    compile_s: seconds the eval step took to compile (0.0 without eval batches).
    peak_flops: the run's peak FLOP/s (all devices), or None (MFU not reported).
    flops_per_token: training FLOPs per token (`sizing.train_flops_per_token`).
  """

  eval_step: Callable[..., Any]
  compile_s: float
  peak_flops: float | None
  flops_per_token: float


def restore_or_init(cfg: RunConfig, workdir: str, mesh: jax.sharding.Mesh, is_main: bool,
                    on_exit: contextlib.ExitStack) -> Start:
  """The data and the train state of a run (module docstring), inside `use_mesh(mesh)`.

  Creates `workdir` once the config and the data are known to be good. Logs (process 0) an
  `init_from` source used or ignored, and a checkpoint step already at `train.num_steps`.

  Raises:
    ConfigError: bad data settings (no files, a missing text field, an empty split, ...), in
      one line.
    ValueError: a checkpoint that does not match the config or cannot be read, or an
      `init_from` source that does not fit (`Checkpointer.restore_latest`, `initial_state`).
  """
  train = cfg.train
  built = setup_training(cfg.model, train, mesh, cfg.balance,
                         fault_injection=bool(train.inject_nan_at_steps))
  train_step = built.step
  local_batch = train.batch_size // jax.process_count()
  try:  # Bad data settings (no files, missing text field, ...) are user errors: one line.
    # A raw corpus is listed once, here; the training iterator, eval and header reuse it.
    documents = None if prepared.uses_prepared(cfg.data) else list_documents(cfg.data)
    data_iter = make_train_iterator(cfg.data, seq_len=train.seq_len, batch_size=local_batch,
                                    seed=train.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count(), documents=documents)
    on_exit.callback(close_data, data_iter)
    # Prepared corpora are opened once, by the training iterator; eval and header reuse them.
    opened = data_iter.corpora if isinstance(data_iter, GlobalBatchIterator) else None
    eval_sets = {}  # source name ("" for one corpus) -> its eval batches
    if train.eval_batches:
      eval_sets = {name: [global_batch(b, built.data_sharding) for b in batches]
                   for name, batches in make_eval_sets(
                       cfg.data, corpora=opened, documents=documents, seq_len=train.seq_len,
                       batch_size=local_batch,
                       max_batches=train.eval_batches, process_index=jax.process_index(),
                       process_count=jax.process_count()).items()}
  except ValueError as e:
    raise ConfigError(str(e)) from e

  os.makedirs(workdir, exist_ok=True)  # only once the config and the data are known to be good
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
  target = abstract_with_shardings(built.abstract_state, built.state_sharding)
  watchdog = Watchdog(train.step_timeout_s, train.step_timeout_factor)
  with watchdog.guard("restoring the newest checkpoint"):  # reads and collectives
    restored = ckpt.restore_latest(target, data_iter, cfg)
  if restored is None and train.init_from:  # a new run from another run's or an HF model
    state, source = initial_state(train.init_from, cfg, built.tx, built.abstract_state,
                                  built.state_sharding)
    latest = None
    if is_main:
      logging.info("initialised from %s (%s): %d parameters; optimizer and step fresh",
                   train.init_from, source, sum(x.size for x in jax.tree.leaves(state.params)))
  elif restored is None:
    state, latest = init_train_state(cfg.model, built.tx, train.seed, mesh), None
  else:
    state, latest, data_restored = restored
    if train.init_from and is_main:
      logging.info("train.init_from=%s ignored: resuming from checkpoint %d in %s",
                   train.init_from, latest, ckpt.directory)
    if not data_restored:  # saved by another process count: the positions mean other documents
      close_data(data_iter)
      data_iter = make_train_iterator(cfg.data, seq_len=train.seq_len, batch_size=local_batch,
                                      seed=train.seed + latest, process_index=jax.process_index(),
                                      process_count=jax.process_count(), documents=documents)
      on_exit.callback(close_data, data_iter)
    resumed = extend_schedule(ckpt.saved_config(latest)["train"], train, latest)
    if schedule_horizon(resumed) != schedule_horizon(train):  # rebuilt before its first call
      train_step = setup_training(cfg.model, resumed, mesh, cfg.balance,
                                  fault_injection=bool(train.inject_nan_at_steps)).step
    cfg = dataclasses.replace(cfg, train=resumed)  # saved with the checkpoints: the horizon
    train = cfg.train
  step = int(state.step)
  if step >= train.num_steps and is_main:
    logging.warning("checkpoint step %d >= train.num_steps=%d: nothing to train; raise "
                    "--config.train.num_steps to continue (see train.schedule_extend for the "
                    "learning rate)", step, train.num_steps)
  return Start(cfg, built, train_step, data_iter, opened, documents, eval_sets, ckpt, target,
               watchdog, state, latest)


def _peak_flops(cfg: RunConfig) -> tuple[accelerators.AcceleratorProfile | None, float | None, bool]:
  """(the detected accelerator profile or None, the run's peak FLOP/s or None, whether that
  peak was measured): the profile's dense peak for the model dtype x devices, or on a CPU
  without a profile a matmul peak measured now x processes."""
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
  return profile, peak_flops, peak_measured


def compile_and_header(start: Start, workdir: str, mesh: jax.sharding.Mesh,
                       is_main: bool) -> Compiled:
  """The run's peak FLOP/s; WORKDIR/config.json, WORKDIR/optimizer.txt and the console header
  ('Starting|Resuming at step S/N: ...', `console.header_lines`) on process 0; then the eval
  step, compiled ahead of time when there are eval batches and steps to train."""
  cfg, train, step = start.cfg, start.cfg.train, int(start.state.step)
  profile, peak_flops, peak_measured = _peak_flops(cfg)
  flops_per_token = sizing.train_flops_per_token(cfg.model, train.seq_len)
  if is_main:
    counts = sizing.count_params(cfg.model)
    console.write_json_atomic(os.path.join(workdir, "config.json"), config_record(cfg))
    with open(os.path.join(workdir, "optimizer.txt"), "w", encoding="utf-8") as f:
      f.write(describe_optimizer(train, start.built.params_shape) + "\n")
    header = console.header_lines(
        resuming=start.latest is not None, step=step, num_steps=train.num_steps,
        params_total=counts.total, params_active=counts.active, layers=cfg.model.num_layers,
        experts=cfg.model.num_experts, devices=jax.device_count(),
        processes=jax.process_count(), mesh_shape=dict(mesh.shape), workdir=workdir,
        accelerator=profile.name if profile else jax.devices()[0].platform,
        peak_flops=peak_flops, peak_measured=peak_measured, batch_size=train.batch_size,
        seq_len=train.seq_len,
        data=console.data_summary(cfg.data, train.num_steps * train.batch_size * train.seq_len,
                                  corpora=start.corpora, documents=start.documents))
    logging.info("%s", "\n".join(header))
    if train.inject_nan_at_steps:
      logging.warning("train.inject_nan_at_steps=%s: NaN loss and gradients will be injected "
                      "(a test-only setting)", train.inject_nan_at_steps)

  eval_step = make_eval_step(start.built.graphdef, start.built.state_sharding,
                             start.built.data_sharding)
  eval_batches = [b for batches in start.eval_sets.values() for b in batches]
  compile_s = 0.0
  if eval_batches and step < train.num_steps:  # compiled now, so that every evaluation can run
    # under the watchdog; a run with nothing to train evaluates nothing (`loop.finish`)
    if is_main:
      logging.info("compiling the eval step ...")
    begin = time.perf_counter()
    eval_step = eval_step.lower(start.target, eval_batches[0]).compile()
    compile_s = time.perf_counter() - begin
    if is_main:
      logging.info("eval step compiled in %.1f s%s", compile_s, console.memory_analysis(eval_step))
  return Compiled(eval_step, compile_s, peak_flops, flops_per_token)
