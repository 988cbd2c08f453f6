"""Context extension: a run resumes with other RoPE bases and a longer sequence, and the 32K
recipe (configs/zaya1_base_32k.py) validates and builds.

- `check_resumable` accepts a checkpoint whose model differs only in `rope_theta` /
  `rope_theta_sliding` (`RESUME_CHANGEABLE_MODEL_FIELDS`, logged) with a longer
  `train.seq_len` and another `mesh.context`; any other model change is still refused;
- the recipe: seq_len 32768 on mesh.context=2, RoPE base 1M, the same tokens per step as
  zaya1_base.py; its mesh checks pass on 8 devices; ZAYA1-base builds abstractly.
"""

from __future__ import annotations

import dataclasses

import pytest
from absl import logging

from configs import zaya1_base, zaya1_base_32k, zaya1_tiny
from zaya_jax.checkpoint.compat import check_resumable
from zaya_jax.config import (COMPUTE_ONLY_MODEL_FIELDS, RESUME_CHANGEABLE_MODEL_FIELDS,
                             ConfigError, resolve, synthetic_configs)
from zaya_jax.config.mesh import MeshConfig, check_context


def _saved(cfg) -> dict:
  return {**cfg.to_dict(), "runtime": {"process_count": 1}}


def test_resume_accepts_other_rope_bases_longer_sequences_and_context(monkeypatch):
  base = resolve(zaya1_tiny.get_config())
  longer = dataclasses.replace(
      base, model=base.model.replace(rope_theta=1e6, rope_theta_sliding=2e4),
      train=dataclasses.replace(base.train, seq_len=base.train.seq_len * 8),
      mesh=MeshConfig(fsdp=1, context=2))
  warnings = []
  monkeypatch.setattr(logging, "warning", lambda msg, *a: warnings.append(msg % a))
  check_resumable("ckpt/10", _saved(base), longer, {"opt_state": True})
  assert any("rope_theta" in w and "context extension" in w for w in warnings), warnings
  assert not set(RESUME_CHANGEABLE_MODEL_FIELDS) & set(COMPUTE_ONLY_MODEL_FIELDS)
  other = dataclasses.replace(longer, model=longer.model.replace(hidden_size=64))
  with pytest.raises(ConfigError, match=r"another model: model\.hidden_size"):
    check_resumable("ckpt/10", _saved(base), other, {"opt_state": True})


def test_32k_recipe_validates_and_builds():
  from zaya_jax.train.state import abstract_model  # pylint: disable=import-outside-toplevel

  model, train, mesh, _ = synthetic_configs(zaya1_base_32k.get_config())
  base_model, base_train, _, _ = synthetic_configs(zaya1_base.get_config())
  assert (train.seq_len, mesh.context, model.rope_theta) == (32_768, 2, 1e6)
  assert train.seq_len * train.batch_size == base_train.seq_len * base_train.batch_size
  # Only the RoPE base (and compute-only fields) differ from the 4K model: it resumes.
  changed = {f.name for f in dataclasses.fields(model)
             if getattr(model, f.name) != getattr(base_model, f.name)}
  assert changed <= set(RESUME_CHANGEABLE_MODEL_FIELDS) | set(COMPUTE_ONLY_MODEL_FIELDS), changed
  check_context(mesh.context, train.seq_len, max(model.context_halo), model.attention_impl)
  assert mesh.shape(8) == {"data": 1, "fsdp": 4, "expert": 1, "context": 2}
  _, params, _ = abstract_model(model, train.seed)  # nnx.eval_shape: nothing allocated
  assert params["embed_tokens"].shape == (model.vocab_size, model.hidden_size)
