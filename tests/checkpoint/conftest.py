"""Shared fixtures of the checkpoint tests: one tiny TrainState and a directory of three
checkpoints (steps 1, 2, 3) written from it, built once per session.

The model has the sizes of tests/helpers.py (MODEL_OVERRIDES) (2 layers, 4 experts, hidden 32); the
optimizer moments are filled with noise so that every expert slice of every tensor differs.
Tests that damage checkpoints work on a copy (`checkpoints_copy`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import zaya1_tiny
from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import CheckpointConfig, RunConfig, resolve
from zaya_jax.data import make_train_iterator
from zaya_jax.parallel.mesh import abstract_with_shardings
from zaya_jax.train import init_train_state, make_optimizer
from zaya_jax.train.state import TrainState, abstract_model, abstract_train_state

MODEL = dict(hidden_size=32, num_layers=2, layer_types=("hybrid", "hybrid_sliding"),
             sliding_window=8, num_heads=2, num_kv_heads=2, head_dim=16, num_experts=4,
             moe_intermediate_size=32, router_hidden_size=16)  # = tiny_cli.MODEL_OVERRIDES
SEQ_LEN, BATCH = 32, 2
STEPS = (1, 2, 3)


@dataclasses.dataclass
class Tiny:
  cfg: RunConfig
  state: TrainState  # step 0; use `at_step`
  target: TrainState  # abstract, on the CPU device

  def iterator(self):
    return make_train_iterator(self.cfg.data, seq_len=SEQ_LEN, batch_size=BATCH,
                               seed=self.cfg.train.seed)

  def at_step(self, step: int) -> TrainState:
    return self.state.replace(step=jnp.int32(step), skipped_steps=jnp.int32(step - 1),
                              consecutive_skips=jnp.int32(1))

  def checkpointer(self, directory, **kw) -> Checkpointer:
    return Checkpointer(str(directory), CheckpointConfig(
        async_save=kw.get("async_save", False), max_to_keep=kw.get("max_to_keep", 5)))


@pytest.fixture(scope="session")
def tiny() -> Tiny:
  base = resolve(zaya1_tiny.get_config())
  cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, **MODEL),
                            train=dataclasses.replace(base.train, seq_len=SEQ_LEN,
                                                      batch_size=BATCH))
  _, params_shape, _ = abstract_model(cfg.model, cfg.train.seed)
  tx = make_optimizer(cfg.train, params_shape)
  state = init_train_state(cfg.model, tx, cfg.train.seed)
  leaves, treedef = jax.tree.flatten(state.opt_state)
  rng = np.random.default_rng(1)
  leaves = [jnp.asarray(rng.normal(size=x.shape).astype(x.dtype))
            if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
  state = state.replace(opt_state=jax.tree.unflatten(treedef, leaves),
                        rng=jnp.asarray([7, 11], jnp.uint32))
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = abstract_with_shardings(abstract_train_state(cfg.model, tx, cfg.train.seed), cpu)
  return Tiny(cfg=cfg, state=state, target=target)


@dataclasses.dataclass
class Saved:
  directory: str  # holds steps STEPS
  batch_after: dict[int, np.ndarray]  # step -> inputs of the batch drawn right after its save


@pytest.fixture(scope="session")
def saved(tiny, tmp_path_factory) -> Saved:
  directory = tmp_path_factory.mktemp("saved") / "checkpoints"
  ckpt = tiny.checkpointer(directory)
  it = tiny.iterator()
  batch_after = {}
  for step in STEPS:
    next(it)
    ckpt.save(tiny.at_step(step), it, tiny.cfg)
    ckpt.wait()
    batch_after[step] = next(it)["inputs"]
  ckpt.close()
  return Saved(directory=str(directory), batch_after=batch_after)


@pytest.fixture
def checkpoints_copy(saved, tmp_path) -> str:
  """A private copy of the session's checkpoints, `<tmp>/run/checkpoints`."""
  directory = tmp_path / "run" / "checkpoints"
  shutil.copytree(saved.directory, directory)
  return str(directory)


def largest_data_file(step_dir: str, item: str) -> str:
  """The biggest OCDBT data file of one item of a step (it holds the item's largest arrays)."""
  root = os.path.join(step_dir, item, "ocdbt.process_0", "d")
  return max((os.path.join(root, f) for f in os.listdir(root)), key=os.path.getsize)


# A restore that fails on a damaged file makes Orbax abandon its other pending reads; their
# coroutines and TensorStore callbacks raise later, in the garbage collector or another thread
# ("Exception ignored in ..."), which pytest reports as warnings on whichever test runs then.
# Expected in these tests (the failure itself is what they assert on); modules set `pytestmark`.
IGNORE_ABANDONED_READS = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:coroutine '_read_array_index_and_device_put' was never "
                               "awaited:RuntimeWarning"),
]
