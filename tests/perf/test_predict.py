"""`zaya_jax.perf.predict`: replica groups -> mesh axes, node placement, prices, and (8 fake
devices) the collectives of the tiny config's compiled step against a hand count from its
shapes."""

import collections
import math

import jax
import pytest

from configs import zaya1_tiny
from zaya_jax.config import synthetic_configs
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.parallel.mesh import make_mesh, use_mesh
from zaya_jax.perf import predict
from zaya_jax.perf.benchmark import balance_variant_name, parse_balance_variant
from zaya_jax.perf.mesh_sweep import compile_train_step

MESH = {"data": 2, "fsdp": 2, "expert": 2}  # device p = 4 data + 2 fsdp + expert
TARGET = {"data": 16, "fsdp": 8, "expert": 8}
NET = predict.Network(intra_bandwidth=400e9, inter_bandwidth=50e9, intra_latency=1e-5,
                      inter_latency=2e-5, devices_per_node=8)


@pytest.mark.parametrize("attrs, axes", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("expert",)),
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}", ("fsdp",)),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("data",)),
    ("replica_groups={{0,1,4,5},{2,3,6,7}}", ("data", "expert")),
    ("replica_groups=[4,2]<=[8]", ("expert",)),
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", ("fsdp",)),  # ids [[0,2],[1,3],[4,6],[5,7]]
    ("replica_groups=[2,4]<=[2,4]T(1,0)", ("data", "expert")),  # [[0,4,1,5],[2,6,3,7]]
    ("replica_groups={}", ("data", "fsdp", "expert")),
    ("replica_groups=mesh['data'=2,'fsdp'=2,'expert'=2] {'data','expert'}", ("data", "expert")),
    # XLA:CPU's spelling: the group's own mesh over device ids [0,1,4,5,2,3,6,7] as 2 x 4.
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}",
     ("fsdp",)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1'}",
     ("data", "expert")),
    ("source_target_pairs={{0,1},{1,0},{2,3},{3,2}}", ("expert",)),
    ("source_target_pairs={{0,4},{4,0}}", ("data",)),
])
def test_group_axes_reads_every_spelling(attrs, axes):
  assert predict.group_axes(attrs, MESH) == axes


def test_group_axes_without_groups_names_the_op():
  with pytest.raises(ValueError, match="no replica groups"):
    predict.group_axes("dimensions={0}", MESH)


def test_node_split_follows_the_device_order():
  # expert is innermost: 8 experts fill a node; fsdp and data span nodes one device each.
  assert predict.node_split(("expert",), TARGET, 8) == (8, 1)
  assert predict.node_split(("fsdp",), TARGET, 8) == (1, 8)
  assert predict.node_split(("data", "fsdp"), TARGET, 8) == (1, 128)
  assert predict.node_split(("data", "fsdp", "expert"), TARGET, 8) == (8, 128)
  # A 4-wide expert axis leaves room for 2 fsdp devices in the node.
  assert predict.node_split(("fsdp",), {"data": 2, "fsdp": 4, "expert": 4}, 8) == (2, 2)


def test_collective_time_is_the_ring_formula():
  s = 64 * 2**20
  # all-gather over 8 in one node: 7/8 of the buffer over the link, 7 steps.
  assert predict.collective_time("all-gather", s, 8, 8, NET) == pytest.approx(
      7 * 1e-5 + s * 7 / 8 / 400e9)
  # all-reduce over 16 nodes, one device each: twice (15/16 over one NIC + a tree's 8 steps).
  assert predict.collective_time("all-reduce", s, 16, 1, NET) == pytest.approx(
      2 * (8 * 2e-5 + s * 15 / 16 / 50e9))
  # over 2 nodes the ring's single step is the fewer.
  assert predict.collective_time("all-gather", s, 2, 1, NET) == pytest.approx(2e-5 + s / 2 / 50e9)
  # all-to-all over 8 x 2 nodes: 7/16 inside, 8/16 out through the NIC.
  assert predict.collective_time("all-to-all", s, 16, 8, NET) == pytest.approx(
      7 * 1e-5 + 1 * 2e-5 + s * 7 / 16 / 400e9 + s * 8 / 16 / 50e9)
  assert predict.collective_time("all-reduce", s, 1, 1, NET) == 0.0


def test_scaled_bytes_rules():
  small, big = MESH, TARGET
  # the MoE exchange: per-device input fixed; a gather grows with its group.
  assert predict.scaled_bytes("all-gather", 100, ("expert",), True, small, big) == 400
  assert predict.scaled_bytes("all-to-all", 100, ("expert",), True, small, big) == 100
  # outside it: an fsdp shard unless fsdp is among the group's axes.
  assert predict.scaled_bytes("all-reduce", 800, ("data",), False, small, big) == 200
  assert predict.scaled_bytes("all-gather", 800, ("fsdp",), False, small, big) == 800
  assert predict.scaled_bytes("all-reduce", 800, ("data", "fsdp", "expert"), False, small, big) == 800


def test_network_rejects_bad_figures():
  with pytest.raises(ValueError, match="Network.inter_bandwidth=0"):
    predict.Network(intra_bandwidth=1e9, inter_bandwidth=0)


@pytest.mark.multidevice
@pytest.mark.slow  # one compile of the tiny step on 8 fake devices: 80-250 s on this 2-core host
def test_tiny_step_collectives_match_a_hand_count_from_the_config():
  """Mesh data 2 x fsdp 2 x expert 2, the tiny widths at 2 layers, all_to_all dispatch, float32,
  batch 8 x 32, balancing off. Hand count from the config's shapes (not from the HLO):
  - MoE exchange: dispatch + combine forward and their transposes backward = 4 all-to-alls
    over `expert` per layer, each of the [E, C, D] f32 buffer, C = ceil(1.25 M / E), M = tokens
    per device;
  - the expert weights' gradient: one all-reduce over data + fsdp per layer (inside the
    shard_map) of this expert shard's gate, up and down weights, E/2 x 3 D F f32;
  - FSDP gathers in the forward layer scan: every matrix with a D (`embed`) axis once per
    layer, whole along fsdp: q [D,N,H], k [D,K,H], the two value halves [D,K/2,H], o [N,H,D],
    router down-proj [D,R], and w_gate, w_up, w_down of this expert shard [E/2, D, F].
  (The [D] vectors, norms and residual scales, are left out: XLA gathers only some of them.)"""
  cfg = zaya1_tiny.get_config()
  model, train, _, _ = synthetic_configs(cfg)
  model = model.replace(moe_dispatch="all_to_all", num_layers=2, layer_types=("hybrid", "hybrid"))
  mesh = make_mesh(MeshConfig(2, 2, 2), jax.devices()[:8])
  batch, seq = 8, 32
  with use_mesh(mesh):
    text = compile_train_step(model, train, mesh, batch, seq, parse_balance_variant("none")).as_text()
  check_hand_count(predict.price_ops(text, dict(mesh.shape), TARGET, NET), model, batch, seq)


def check_hand_count(ops, model, batch, seq):
  """The hand count of the test above against `ops` (mesh 2 x 2 x 2)."""
  L, E, D, F, N, K, H, R = (model.num_layers, model.num_experts, model.hidden_size,
                            model.moe_intermediate_size, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.router_hidden_size)
  f32, ep = 4, 2
  m = batch * seq // 8
  c = math.ceil(model.capacity_factor * m / E)

  a2a = [o for o in ops if o.kind == "all-to-all" and o.in_shard_map]
  assert [(o.axes, o.executions, o.compile_bytes) for o in a2a] == [(("expert",), L, E * c * D * f32)] * 4
  assert all(o.target_bytes == o.compile_bytes for o in a2a)  # tokens per device unchanged

  grads = [o for o in ops if o.kind == "all-reduce" and o.in_shard_map]
  assert [(o.axes, o.executions, o.compile_bytes) for o in grads] == [
      (("data", "fsdp"), L, E // ep * 3 * D * F * f32)]

  want = collections.Counter([D * N * H * f32] * 2 + [D * K * H * f32]  # q and o; k
                             + [D * K // 2 * H * f32] * 2 + [D * R * f32]  # v halves; router
                             + [E // ep * D * F * f32] * 3)  # this shard's experts
  forward = [o for o in ops if o.kind == "all-gather" and o.executions == L
             and "transpose" not in o.op_name and o.compile_bytes > D * f32]
  assert all(o.axes == ("fsdp",) and not o.in_shard_map for o in forward)
  assert collections.Counter(o.compile_bytes for o in forward) == want
  # On the target mesh a gather along fsdp is still the whole tensor; its time is the ring's.
  o = forward[0]
  assert o.target_bytes == o.compile_bytes and (o.n, o.g) == (8, 1)
  assert o.seconds == pytest.approx(L * predict.collective_time("all-gather", o.compile_bytes, 8, 1, NET))


def test_balance_variant_name_parses_back_to_the_config_balancing():
  """`launch.sizing --predict_step` prices the config's own balancing by default: its name,
  parsed back, is the same rule (mode, apply, reroute), also with the reroute off."""
  from zaya_jax.config import BalanceConfig
  for cfg, name in ((BalanceConfig(), "quantile:reroute"),
                    (BalanceConfig(quantile_reroute=False), "quantile:next"),
                    (BalanceConfig(quantile_apply="current"), "quantile:current"),
                    (BalanceConfig(mode="adamw"), "adamw"), (BalanceConfig(enabled=False), "none")):
    assert balance_variant_name(cfg) == name
    back = parse_balance_variant(name)
    assert (back.enabled, back.mode, back.quantile_apply) == (cfg.enabled, cfg.mode, cfg.quantile_apply)
    if cfg.enabled and cfg.mode == "quantile" and cfg.quantile_apply == "next":
      assert back.quantile_reroute == cfg.quantile_reroute


def test_balance_variants_keep_the_config_balance_settings():
  """Every variant of `launch.balance_cost`, `launch.benchmark --compare_balance` and
  `launch.sizing --predict_step` is the run config's balance group with the variant's mode:
  a `--config.balance.*` override holds in each (it was silently dropped before 2026-12-08)."""
  import dataclasses
  from zaya_jax.config import BalanceConfig
  base = BalanceConfig(rate_lr_power=0.5, quantile_ema=0.25, adamw_lr=0.03, exclude_layers=(0,))
  kept = ("rate_lr_power", "quantile_ema", "adamw_lr", "exclude_layers")
  for name, (enabled, mode, apply, reroute) in {
      "none": (False, "quantile", "next", True), "adamw": (True, "adamw", "next", True),
      "quantile:next": (True, "quantile", "next", False),
      "quantile:reroute": (True, "quantile", "next", True),
      "quantile:current": (True, "quantile", "current", True)}.items():
    v = parse_balance_variant(name, "variants", base)
    assert (v.enabled, v.mode, v.quantile_apply, v.quantile_reroute) == (enabled, mode, apply,
                                                                         reroute), name
    assert all(getattr(v, f) == getattr(base, f) for f in kept), name
    assert v == dataclasses.replace(base, enabled=enabled, mode=mode, quantile_apply=apply,
                                    quantile_reroute=reroute)
  assert parse_balance_variant("adamw").adamw_lr == BalanceConfig().adamw_lr  # no base: defaults


def test_predict_step_refuses_an_unknown_variant_before_compiling(monkeypatch):
  """Every variant is parsed before the first compile, and the error names the argument
  (`variants`): a bad last variant is found at once, not after compiling the others."""
  from zaya_jax.parallel.accelerators import get_profile
  monkeypatch.setattr(predict, "_compiled_text", lambda *a, **k: pytest.fail("compiled"))
  one = MeshConfig(data=1, fsdp=1, expert=1)
  model, train, _, _ = synthetic_configs(zaya1_tiny.get_config())
  with pytest.raises(ValueError, match=r"^variants entry 'bogus': "):
    predict.predict_step(model, train, get_profile("mi300x"),
                         NET, compile_mesh=one, target_mesh=one, target_devices=1,
                         seqs_per_device=1, seq_len=64, variants=["none", "bogus"])
