"""With the Pallas impls on (`ModelConfig.*_impl="pallas"`), the full model equals the XLA path
(Pallas interpret mode).

One tiny model (2 layers, one sliding; 4 experts; T = 24, not a multiple of the kernels'
16-row blocks; packed documents and padding), float32. Logits and the gradient of the masked
next-token loss w.r.t. every parameter must match with the attention kernel alone and with
all three on (routing and gmm alone are covered op by op in their own tests). Balancing biases are set so that several experts and the skip class win tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import random_model
from tests.helpers import random_batch, tiny_model_config
from zaya_jax.train.step import cross_entropy


def loss_and_grads(model, batch):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p):
    m = nnx.merge(graphdef, p, rest, copy=True)
    logits, aux = m(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True)
    loss_sum, tokens = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss_sum / tokens, (logits, aux["expert_counts"])

  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)


@pytest.fixture(scope="module")
def setup():
  cfg = dataclasses.replace(tiny_model_config(), sliding_window=5)
  # Every parameter random at realistic scales, token-dependent routing; skip bias 0 (not the
  # init's -1) so the skip class wins some tokens too.
  model = random_model(cfg, seed=1)
  biases = model.layers.mlp.router.balancing_biases
  biases[...] = jnp.asarray(np.random.default_rng(0).uniform(-0.05, 0.05, biases[...].shape),
                            jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(2), b=2, t=24).items()}
  (loss, (logits, counts)), grads = loss_and_grads(model, batch)
  return cfg, model, batch, loss, logits, counts, grads


IMPL_FIELDS = {"attention": "attention_impl", "routing": "routing_impl", "gmm": "gmm_impl"}


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [("attention",),
                                     ("routing", "gmm", "attention")])
def test_kernels_match_xla_path(setup, kernels):
  cfg, model, batch, loss, logits, counts, grads = setup
  graphdef, state = nnx.split(model)
  kcfg = dataclasses.replace(cfg, **{IMPL_FIELDS[op]: "pallas" for op in kernels})
  kgraphdef, _ = nnx.split(random_model(kcfg, seed=1))
  kmodel = nnx.merge(kgraphdef, state)
  (kloss, (klogits, kcounts)), kgrads = loss_and_grads(kmodel, batch)
  # The kernels really run: the traced forward holds their pallas_calls by name.
  jaxpr = str(jax.make_jaxpr(lambda m: m(batch["inputs"], batch["segment_ids"]))(kmodel))
  names = {"attention": "cca_attention_fwd", "routing": "routing_classify", "gmm": "_gmm_vjp"}
  for op in kernels:
    assert names[op] in jaxpr, op
  for op in set(names) - set(kernels):
    assert names[op] not in jaxpr, op
  counts = np.asarray(counts)
  assert (counts[:, :-1] > 0).sum() >= 4 and counts[:, -1].sum() > 0  # experts and skip used
  np.testing.assert_array_equal(np.asarray(kcounts), counts)
  np.testing.assert_allclose(float(kloss), float(loss), rtol=1e-6)
  real = np.asarray(batch["segment_ids"]) > 0
  np.testing.assert_allclose(np.asarray(klogits)[real], np.asarray(logits)[real], atol=2e-5, rtol=1e-5)
  flat, kflat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(kgrads)
  for (path, g), kg in zip(flat, kflat):
    g, kg = np.asarray(g), np.asarray(kg)
    scale = max(np.abs(g).max(), 1e-12)
    assert np.abs(kg - g).max() <= 1e-4 * scale + 1e-7, (jax.tree_util.keystr(path), np.abs(kg - g).max(), scale)
