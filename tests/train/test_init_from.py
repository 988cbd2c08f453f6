"""train.init_from: a new run from a run's workdir, a checkpoint step directory (also a
--drop_optimizer copy) or an HF directory: the source's parameters and balancing biases
exactly, zero optimizer moments, step 0; another model refused; resume wins over it."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

from tests.train.inproc import STEPS, tiny_run_config
from zaya_jax.checkpoint.reshape import reshape
from zaya_jax.config import ConfigError, resolve
from zaya_jax.hf import save_pretrained
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.parallel.mesh import make_mesh, use_mesh
from zaya_jax.train import run
from zaya_jax.train.init_from import initial_state
from zaya_jax.train.setup import setup_training


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A finished 6-step run: (workdir, its final TrainState as numpy)."""
  workdir = tmp_path_factory.mktemp("source")
  state = run(tiny_run_config(), str(workdir))
  return workdir, jax.device_get(state)


def _initial(path, config=None):
  cfg = resolve(config or tiny_run_config())
  mesh = make_mesh(cfg.mesh)
  with use_mesh(mesh):
    built = setup_training(cfg.model, cfg.train, mesh, None)
    state, what = initial_state(str(path), cfg, built.tx, built.abstract_state, built.state_sharding)
  return jax.device_get(state), what


def _assert_fresh_from(state, want):
  for name in ("params", "model_state"):
    got_leaves = jax.tree_util.tree_leaves_with_path(getattr(state, name))
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(getattr(want, name)))
    assert len(got_leaves) == len(want_leaves) > 0
    for path, leaf in got_leaves:
      np.testing.assert_array_equal(leaf, want_leaves[path], err_msg=jax.tree_util.keystr(path))
  assert int(state.step) == 0 and int(state.skipped_steps) == 0
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert moments and all(not np.any(m) for m in moments)


@pytest.mark.slow
def test_from_run_dir_step_dir_and_drop_optimizer_copy(source, tmp_path):
  workdir, final = source
  state, what = _initial(workdir)
  assert what == f"checkpoint step {STEPS} of {workdir}/checkpoints"
  _assert_fresh_from(state, final)
  # The biases moved during training (so "equal" is not "equal to the initialisation").
  biases = np.asarray(nnx.to_pure_dict(final.model_state)["layers"]["mlp"]["router"]["balancing_biases"])
  assert np.any(biases[:, :-1] != 0)

  state, what = _initial(workdir / "checkpoints" / "3")
  assert what.startswith("checkpoint step 3 ")
  state6, _ = _initial(workdir / "checkpoints" / str(STEPS))
  _assert_fresh_from(state6, final)

  reshape(str(workdir), str(tmp_path / "slim"), drop_optimizer=True)
  state, _ = _initial(tmp_path / "slim" / "checkpoints" / str(STEPS))
  _assert_fresh_from(state, final)


def test_from_hf_dir(source, tmp_path):
  workdir, final = source
  cfg = resolve(tiny_run_config())
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg.model, rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, nnx.merge_state(final.params, final.model_state))
  save_pretrained(model, str(tmp_path / "hf"))
  state, what = _initial(tmp_path / "hf")
  assert what == f"HF directory {tmp_path / 'hf'}"
  _assert_fresh_from(state, final)


def test_refusals(source, tmp_path):
  workdir, _ = source
  other = tiny_run_config()
  other.model.router_hidden_size = 32
  with pytest.raises(ConfigError, match=r"train.init_from=.*model.router_hidden_size: 16 -> 32"):
    _initial(workdir, other)
  with pytest.raises(ConfigError, match=r"train.init_from=.*no such directory; expected a training"):
    _initial(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match=r"train.init_from=.*not a run, a checkpoint step or an HF"):
    _initial(tmp_path / "empty")


@pytest.mark.slow
def test_run_starts_from_it_then_resume_wins(source, tmp_path, caplog):
  workdir, _ = source
  new = tmp_path / "finetune"
  caplog.set_level(logging.INFO)
  state = run(tiny_run_config(init_from=str(workdir), num_steps=2, max_steps_per_run=1), str(new))
  assert int(state.step) == 1
  text = caplog.text
  assert (f"initialised from {workdir} (checkpoint step {STEPS} of {workdir}/checkpoints): "
          in text and "parameters; optimizer and step fresh" in text), text[-3000:]
  caplog.clear()
  state = run(tiny_run_config(init_from=str(workdir), num_steps=2), str(new))
  assert int(state.step) == 2
  assert f"train.init_from={workdir} ignored: resuming from checkpoint 1 in {new}/checkpoints" in caplog.text
  assert sorted(os.listdir(new / "checkpoints")) == ["1", "2"]
