"""Checkpointer: round trip, integrity on restore, fallback from corrupt steps, data position.

Every test starts from the session's three checkpoints (conftest.py, steps 1-3 of a 2-layer,
4-expert model) or a private copy of them. Covered:
- a restore returns exactly what was saved (params, balancing biases, optimizer state, step,
  rng, skip counters) and the data position (the next batch is the one drawn after the save);
  `restore(step, target, None, cfg)` leaves the iterator alone;
- one flipped bit in expert 2 of layer 1 written to disk fails the restore naming them;
- a deleted data file (step 3) and a truncated one (step 2): `restore_latest` falls back to
  step 1, moves 2 and 3 to `checkpoints_corrupt/`, and saving step 2 again works;
- every step corrupt: ValueError listing each step, nothing moved; a model config mismatch
  is a ConfigError and moves nothing; saving a step not after the newest one is an error
  (Orbax would skip it silently);
- another process count: state restored, data position not applied (data_restored False);
- a step without its integrity item is corrupt (Checkpointer and restore_model_state);
- Orbax refuses a target with fewer experts or an extra tensor (no zero fill, no truncation);
- a process killed mid-save leaves the previous step intact (max_to_keep=1) and a tmp
  directory that Orbax does not list and the next save removes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from tests.checkpoint.conftest import IGNORE_ABANDONED_READS, STEPS, largest_data_file
from zaya_jax.checkpoint import integrity
from zaya_jax.checkpoint import (CorruptCheckpointError, config_record, open_manager,
                                 restore_model_state)
from zaya_jax.config import ConfigError
from zaya_jax.parallel.mesh import abstract_with_shardings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERT_TENSOR = "layers.mlp.experts.w_up.value"
pytestmark = IGNORE_ABANDONED_READS


def assert_trees_equal(got, want):
  got_leaves, got_def = jax.tree.flatten(got)
  want_leaves, want_def = jax.tree.flatten(want)
  assert got_def == want_def
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def assert_state_equal(got, want):
  assert_trees_equal((got.params, got.model_state, got.opt_state),
                     (want.params, want.model_state, want.opt_state))
  for field in ("step", "rng", "skipped_steps", "consecutive_skips"):
    assert np.array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field))), field


@pytest.mark.slow
def test_roundtrip_restores_everything_and_the_data_position(tiny, saved):
  ckpt = tiny.checkpointer(saved.directory)
  it = tiny.iterator()
  restored = ckpt.restore_latest(tiny.target, it, tiny.cfg)
  assert (restored.step, restored.data_restored) == (3, True)
  assert_state_equal(restored.state, tiny.at_step(3))
  assert int(restored.state.skipped_steps) == 2
  assert np.array_equal(next(it)["inputs"], saved.batch_after[3])

  fresh = tiny.iterator()
  state = ckpt.restore(2, tiny.target, None, tiny.cfg)  # the NaN rollback: data stays put
  assert_state_equal(state, tiny.at_step(2))
  assert np.array_equal(next(fresh)["inputs"], next(tiny.iterator())["inputs"])
  assert ckpt.saved_config(2)["runtime"] == {"process_count": 1, "device_count": 1}
  ckpt.close()


@pytest.mark.slow
def test_flipped_expert_bit_on_disk_names_layer_and_expert(tiny, checkpoints_copy, tmp_path):
  state = tiny.at_step(3)

  def flip(path, x):
    if integrity.tensor_name(path) != EXPERT_TENSOR:
      return x
    y = np.array(x)
    y.view(np.uint32)[1, 2, 5, 7] ^= 1 << 30
    return y

  params = jax.tree_util.tree_map_with_path(flip, state.params)
  other = tiny.checkpointer(tmp_path / "other")
  other.save(state.replace(params=params), tiny.iterator(), tiny.cfg)
  other.close()
  # Step 3's model files replaced by the flipped ones; its checksums are of the original.
  shutil.rmtree(os.path.join(checkpoints_copy, "3", "model"))
  shutil.copytree(tmp_path / "other" / "3" / "model", os.path.join(checkpoints_copy, "3", "model"))

  ckpt = tiny.checkpointer(checkpoints_copy)
  with pytest.raises(CorruptCheckpointError) as e:
    ckpt.restore(3, tiny.target, None, tiny.cfg)
  assert f"{EXPERT_TENSOR}: 1 expert(s) differ: (layer 1, expert 2)" in str(e.value)
  assert "opt_state" not in str(e.value).split("fails", 1)[0]
  restored = ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg)
  assert restored.step == 2
  assert ckpt.all_steps() == [1, 2]
  assert os.listdir(checkpoints_copy + "_corrupt") == ["3"]
  ckpt.close()


@pytest.mark.slow
def test_fallback_from_deleted_and_truncated_files(tiny, saved, checkpoints_copy):
  os.remove(largest_data_file(os.path.join(checkpoints_copy, "3"), "opt_state"))
  victim = largest_data_file(os.path.join(checkpoints_copy, "2"), "model")
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)

  ckpt = tiny.checkpointer(checkpoints_copy)
  it = tiny.iterator()
  restored = ckpt.restore_latest(tiny.target, it, tiny.cfg)
  assert (restored.step, restored.data_restored) == (1, True)
  assert_state_equal(restored.state, tiny.at_step(1))
  assert np.array_equal(next(it)["inputs"], saved.batch_after[1])
  corrupt = checkpoints_copy + "_corrupt"
  assert sorted(os.listdir(corrupt)) == ["2", "3"]  # moved, not deleted
  assert os.path.exists(os.path.join(corrupt, "2", "model"))
  assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1

  ckpt.save(tiny.at_step(2), it, tiny.cfg)  # the run saves step 2 again
  ckpt.close()
  ckpt = tiny.checkpointer(checkpoints_copy)
  restored = ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg)
  assert restored.step == 2 and ckpt.all_steps() == [1, 2]
  assert_state_equal(restored.state, tiny.at_step(2))
  ckpt.close()


def test_every_step_corrupt_raises_and_moves_nothing(tiny, checkpoints_copy):
  for step in STEPS:
    os.remove(largest_data_file(os.path.join(checkpoints_copy, str(step)), "model"))
  ckpt = tiny.checkpointer(checkpoints_copy)
  with pytest.raises(ValueError, match="no checkpoint in .* can be restored") as e:
    ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg)
  for step in STEPS:
    assert f"  step {step}: cannot read the arrays of checkpoint" in str(e.value)
  assert sorted(os.listdir(checkpoints_copy)) == ["1", "2", "3"]
  assert not os.path.exists(checkpoints_copy + "_corrupt")
  ckpt.close()


def test_config_mismatch_is_a_user_error_not_corruption(tiny, checkpoints_copy):
  cfg = dataclasses.replace(tiny.cfg, model=dataclasses.replace(tiny.cfg.model, rms_norm_eps=1e-6))
  ckpt = tiny.checkpointer(checkpoints_copy)
  with pytest.raises(ConfigError, match="model.rms_norm_eps: 1e-05 -> 1e-06"):
    ckpt.restore_latest(tiny.target, tiny.iterator(), cfg)
  assert sorted(os.listdir(checkpoints_copy)) == ["1", "2", "3"]
  ckpt.close()


def test_saving_a_step_not_after_the_latest_is_refused(tiny, checkpoints_copy):
  ckpt = tiny.checkpointer(checkpoints_copy)
  with pytest.raises(ValueError, match="step 2 was not saved: .* already holds step 3"):
    ckpt.save(tiny.at_step(2), tiny.iterator(), tiny.cfg)  # Orbax would skip it silently
  assert sorted(os.listdir(checkpoints_copy)) == ["1", "2", "3"]
  ckpt.close()


@pytest.mark.slow
def test_other_process_count_restores_state_but_not_data(tiny, checkpoints_copy, caplog):
  path = os.path.join(checkpoints_copy, "3", "config", "metadata")
  with open(path) as f:
    record = json.load(f)
  record["runtime"]["process_count"] = 2
  with open(path, "w") as f:
    json.dump(record, f)
  ckpt = tiny.checkpointer(checkpoints_copy)
  it = tiny.iterator()
  with caplog.at_level("WARNING"):
    restored = ckpt.restore_latest(tiny.target, it, tiny.cfg)
  assert (restored.step, restored.data_restored) == (3, False)
  assert_state_equal(restored.state, tiny.at_step(3))
  assert np.array_equal(next(it)["inputs"], next(tiny.iterator())["inputs"])  # untouched
  assert "written by 2 process(es) and this run has 1" in caplog.text
  ckpt.close()


def test_checkpoint_without_checksums_is_corrupt(tiny, tmp_path):
  """A step lacking its integrity item is refused like any corrupt step: no format predates
  the checksums, so there is no unverified restore."""
  items = tiny.at_step(4).to_items()
  it = tiny.iterator()
  next(it)
  directory = tmp_path / "no_integrity"
  manager = open_manager(str(directory), read_only=False)
  manager.save(4, args=ocp.args.Composite(
      **{name: ocp.args.StandardSave(tree) for name, tree in items.items()},
      data_iter=grain.checkpoint.CheckpointSave(it),
      config=ocp.args.JsonSave(config_record(tiny.cfg))))
  manager.wait_until_finished()
  manager.close()
  ckpt = tiny.checkpointer(directory)
  with pytest.raises(CorruptCheckpointError,
                     match=r"step 4: checkpoint .*/4 lacks the item\(s\) \['integrity'\]"):
    ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg)
  assert sorted(os.listdir(directory)) == ["4"]  # nothing moved
  ckpt.close()
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  model = abstract_with_shardings(nnx.merge_state(tiny.target.params, tiny.target.model_state), cpu)
  with pytest.raises(CorruptCheckpointError, match=r"lacks the item\(s\) \['integrity'\]"):
    restore_model_state(str(directory), model)


def test_orbax_refuses_fewer_experts_and_extra_tensors(tiny, saved):
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  model = abstract_with_shardings(nnx.merge_state(tiny.target.params, tiny.target.model_state), cpu)
  got = restore_model_state(saved.directory, model, step=1)  # as saved: verified
  assert_trees_equal(got, nnx.merge_state(tiny.state.params, tiny.state.model_state))

  def fewer_experts(path, x):
    if integrity.tensor_name(path) != EXPERT_TENSOR:
      return x
    return jax.ShapeDtypeStruct((2, 3, 32, 32), x.dtype, sharding=cpu)

  with pytest.raises(ValueError, match=r"Requested shape: \(2, 3, 32, 32\) is not compatible "
                                       r"with the stored shape: \(2, 4, 32, 32\)"):
    restore_model_state(saved.directory, jax.tree_util.tree_map_with_path(fewer_experts, model), 1)
  extra = {"model": model, "new": jax.ShapeDtypeStruct((3,), np.float32, sharding=cpu)}
  manager = open_manager(saved.directory, read_only=True)
  with pytest.raises(ValueError, match="structures do not match"):
    manager.restore(1, args=ocp.args.Composite(model=ocp.args.StandardRestore(extra)))
  manager.close()


@pytest.mark.slow
def test_killed_mid_save_keeps_previous_step(tiny, tmp_path):
  directory = tmp_path / "killed"
  proc = subprocess.run([sys.executable, "-m", "tests.checkpoint.kill_mid_save", str(directory)],
                        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-4000:]
  # While step 2 was being written, step 1 (beyond max_to_keep=1) was still there.
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["1", "2.orbax-checkpoint-tmp"]
  assert sorted(os.listdir(directory)) == ["1", "2.orbax-checkpoint-tmp"]  # never committed

  manager = open_manager(str(directory), read_only=False, max_to_keep=1)
  assert manager.all_steps() == [1]  # the tmp directory is not a checkpoint
  manager.save(2, args=ocp.args.Composite(
      model=ocp.args.StandardSave({"w": np.full(4, 2.0, np.float32)})))
  manager.wait_until_finished()
  assert manager.all_steps() == [2]
  assert sorted(os.listdir(directory)) == ["2"]  # tmp removed; 1 deleted after 2 committed
  manager.close()


@pytest.mark.slow
def test_a_balance_mode_change_restarts_the_controller_state(tiny, tmp_path, caplog):
  """The controller state's leaves are shared by every balance.mode but mean other things
  ("pid" integrates load errors, "quantile" bias shifts): resuming in another mode restarts
  them from zero, with a warning, and keeps the biases; the same mode restores them as saved."""
  balance = jax.tree.map(lambda x: x + 1, tiny.state.balance)  # every leaf non-zero
  state = tiny.at_step(1).replace(balance=balance)
  ckpt = tiny.checkpointer(tmp_path / "checkpoints")
  ckpt.save(state, tiny.iterator(), tiny.cfg)  # tiny.cfg: balance.mode "quantile"
  ckpt.wait()
  same = ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg).state
  assert_trees_equal(same.balance, balance)
  pid = dataclasses.replace(tiny.cfg, balance=dataclasses.replace(tiny.cfg.balance, mode="pid"))
  with caplog.at_level("WARNING"):
    other = ckpt.restore_latest(tiny.target, tiny.iterator(), pid).state
  assert "balance.mode changed 'quantile' -> 'pid'" in caplog.text
  assert "changed router/balancing settings" not in caplog.text  # only the mode changed
  assert_trees_equal(other.balance, jax.tree.map(jnp.zeros_like, balance))
  assert_trees_equal(other.model_state, state.model_state)  # the biases are kept
  slower = dataclasses.replace(tiny.cfg, train=dataclasses.replace(
      tiny.cfg.train, router_lr_scale=tiny.cfg.train.router_lr_scale / 2))
  caplog.clear()
  with caplog.at_level("WARNING"):
    kept = ckpt.restore_latest(tiny.target, tiny.iterator(), slower).state
  assert (f"changed router/balancing settings: train.router_lr_scale "
          f"{tiny.cfg.train.router_lr_scale!r} -> {slower.train.router_lr_scale!r}") in caplog.text
  assert_trees_equal(kept.balance, balance)  # the same mode: the controller state is kept
  ckpt.close()


def test_changed_balancing_settings_are_named():
  """A resume under other router/balancing settings (e.g. a run saved before the 2026-12-03
  defaults) names each change; a saved config without a field stands for its old default."""
  import types
  from zaya_jax.checkpoint.compat import changed_balancing_settings
  from zaya_jax.config import BalanceConfig, TrainConfig
  # The defaults: router_lr_scale 0.1, quantile_integral 0, quantile_reroute True.
  cfg = types.SimpleNamespace(train=TrainConfig(), balance=BalanceConfig())
  saved = {"train": {"router_lr_scale": 0.1},
           "balance": {"quantile_integral": 0.0, "quantile_reroute": True}}
  assert changed_balancing_settings(saved, cfg) == []
  assert changed_balancing_settings({"train": {}, "balance": {}}, cfg) == [
      "train.router_lr_scale 1.0 -> 0.1", "balance.quantile_reroute False -> True"]
  # a tiny run saved before 2026-12-07 (no expert_lr_scale field: 1.0) resumed under the tiny
  # config's 0.5
  tiny = types.SimpleNamespace(train=TrainConfig(expert_lr_scale=0.5), balance=BalanceConfig())
  assert changed_balancing_settings(saved, tiny) == ["train.expert_lr_scale 1.0 -> 0.5"]
  # a run saved between 2026-12-03 and 2026-12-06 (integral 0.15, no reroute field)
  saved = {"train": {"router_lr_scale": 0.1}, "balance": {"quantile_integral": 0.15}}
  assert changed_balancing_settings(saved, cfg) == [
      "balance.quantile_integral 0.15 -> 0.0", "balance.quantile_reroute False -> True"]
  # balance.exclude_layers: JSON keeps the saved tuple as a list, which is no change
  excl = types.SimpleNamespace(train=TrainConfig(), balance=BalanceConfig(exclude_layers=(0,)))
  saved = {"train": {"router_lr_scale": 0.1},
           "balance": {"quantile_reroute": True, "exclude_layers": [0]}}
  assert changed_balancing_settings(saved, excl) == []
  assert changed_balancing_settings(saved, cfg) == ["balance.exclude_layers (0,) -> ()"]
