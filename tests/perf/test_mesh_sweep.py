"""`launch.mesh_sweep` on 8 fake CPU devices, and the HLO collective parser on hand-written HLO.

The sweep runs in subprocesses: JAX fixes its device count when the backend starts, and
pytest has already started it with one CPU device. Two CLI runs go in parallel on a shrunken
tiny config (2 layers, T = 32): mesh 1,1,8 with `all_to_all`, compile-only, and mesh 2,1,4
with `allgather`, measured for 2 steps. About 60 s of CPU time for the two compiles;
marked `slow` (wall time grows with the host's load).
"""

import csv
import dataclasses
import os
import subprocess
import sys

import pytest

from zaya_jax.perf import hlo, mesh_sweep
from zaya_jax.config.mesh import parse_meshes
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.context import CONTEXT_SCOPE
from tests.helpers import subprocess_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Post-optimisation spelling: `%` names, a scanned body with a known trip count of 3.
HLO_COMPILED = """HloModule jit_step, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %a2a = f32[8,16]{1,0} all-to-all(%v), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/while/body/shard_map/all_to_all"}
  %rs = f32[2,16]{1,0} reduce-scatter(%a2a), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %w = f32[16,4]{1,0} parameter(1)
  %d = f32[8,4]{1,0} dot(%a2a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%next, %a2a)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[1,16], init: (s32[], f32[8,16])) -> f32[8,16] {
  %x = f32[1,16]{1,0} parameter(0)
  %ag = f32[8,16]{1,0} all-gather(%x), channel_id=3, replica_groups=mesh['data'=2,'expert'=4] {'data','expert'}, dimensions={0}
  %ar1 = f32[8,16]{1,0} all-reduce(%ag), channel_id=4, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %ar = (f32[8,16]{1,0}, bf16[4]{0}) all-reduce(%ar1, %x), channel_id=5, replica_groups={}, to_apply=%add
  %init = (s32[], f32[8,16]{1,0}) parameter(1)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collective_bytes_counts_each_kind_and_loop_trips():
  got = hlo.collective_bytes(HLO_COMPILED)
  assert got == {
      "all-gather": 8 * 16 * 4,  # result bytes
      "all-reduce": 8 * 16 * 4 + 16 * 4,  # operands (f32[8,16] + the second operand f32[1,16]);
      # the singleton-group all-reduce moves nothing and is left out
      "all-to-all": 3 * 8 * 16 * 4,  # operand bytes x trip count 3
      "reduce-scatter": 3 * 8 * 16 * 4,  # operand bytes x 3
      "collective-permute": 0,
      "ragged-all-to-all": 0,
  }
  ops = {o.name: o for o in hlo.collective_ops(HLO_COMPILED)}
  assert (ops["a2a"].group_size, ops["rs"].group_size, ops["ag"].group_size, ops["ar"].group_size) == (4, 4, 8, 8)
  assert ops["a2a"].off_shard_bytes == 3 * 8 * 16 * 4 * 3 / 4
  # Only shard_map collectives of the exchange kinds count as MoE token exchange.
  assert hlo.moe_exchange_bytes(list(ops.values())) == ops["a2a"].off_shard_bytes
  assert hlo.dot_flops(HLO_COMPILED) == 3 * 2 * 8 * 4 * 16


def test_collective_bytes_pre_optimisation_hlo_reads_trip_count_from_condition():
  # Pre-optimisation spelling: no `%`, no backend_config; the trip count is the condition's
  # constant. Ragged all-to-all counts the smaller of its send and receive buffers.
  text = (HLO_COMPILED.replace("%", "").replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
          .replace("all-to-all(v), channel_id=1",
                   "ragged-all-to-all(v, big, o, s, o, s), channel_id=1")
          .replace("  %w = ".replace("%", ""), "  big = f32[32,16]{1,0} parameter(2)\n  o = s32[4]{0} "
                   "parameter(3)\n  s = s32[4]{0} parameter(4)\n  w = "))
  got = hlo.collective_bytes(text)
  assert got["ragged-all-to-all"] == 3 * 8 * 16 * 4
  assert got["all-to-all"] == 0 and got["reduce-scatter"] == 3 * 8 * 16 * 4


def test_analytic_all_to_all_bytes():
  assert mesh_sweep.analytic_all_to_all_bytes(256, 128, 4, 8) == 256 * 128 * 4 * 2 * 7 / 8
  assert mesh_sweep.analytic_all_to_all_bytes(256, 128, 4, 1) == 0


def test_analytic_context_bytes_by_hand():
  """Tiny shapes (N 4, K 2, H 32, widths 2 / 2: halo 2 conv rows + 1 value row), 2 layers,
  3 sequences of T 64 per device on C = 4, float32; and with remat (2 forwards)."""
  cfg = ModelConfig(num_layers=2, layer_types=("hybrid",) * 2, num_heads=4, num_kv_heads=2,
                    head_dim=32, cca_time0=2, cca_time1=2, hidden_size=64)
  kv = 3 / 4 * 3 * 64 * 2 * 2 * 32 * 4  # (C-1)/C x seqs x T x (k, v) x K x H x bytes
  send = 3 * 32 * (2 * (4 + 2) + 1 * 1) * 4  # seqs x H x (conv rows x (N + K) + value row x K/2)
  seg = 3 / 4 * 3 * 64 * 4 + 2 * 3 * 2 * 4  # key segment ids gathered; halo segment ids
  for remat, forwards in ((False, 1), (True, 2)):
    got = mesh_sweep.analytic_context_bytes(dataclasses.replace(cfg, remat=remat), 3, 64, 4, 4)
    assert got == pytest.approx({
        "all-gather": 2 * forwards * kv + 3 / 4 * 3 * 64 * 4,
        "reduce-scatter": 2 * kv,
        "collective-permute": 2 * (forwards + 1) * 2 * send + 2 * 3 * 2 * 4})
    assert sum(got.values()) == pytest.approx(2 * (forwards + 1) * kv + 2 * (forwards + 1) * 2 * send + seg)


def test_context_and_moe_exchange_are_told_apart_by_scope():
  """Ops in CCA's context shard_map (`CONTEXT_SCOPE` in op_name) count as the context exchange
  only; other shard_map ops as the MoE's; FSDP's gathers (no shard_map) as neither."""
  ops = [hlo.CollectiveOp("all-gather", "a", 100, 2, 4, f"jit(f)/while/body/{CONTEXT_SCOPE}/shard_map/all_gather"),
         hlo.CollectiveOp("collective-permute", "b", 10, None, 8, f"jit(f)/{CONTEXT_SCOPE}/shard_map/ppermute"),
         hlo.CollectiveOp("all-gather", "c", 300, 4, 2, "jit(f)/while/body/shard_map/all_gather"),
         hlo.CollectiveOp("all-gather", "d", 1000, 8, 1, "jit(f)/while/body/dot_general")]
  assert hlo.context_exchange_bytes(ops) == {"all-gather": 200.0, "reduce-scatter": 0.0,
                                             "collective-permute": 80.0}
  assert hlo.moe_exchange_bytes(ops) == 300 * 2 * 3 / 4


def test_parse_meshes():
  assert [(m.data, m.fsdp, m.expert) for m in parse_meshes("1,1,8; 2,1,4")] == [
      (1, 1, 8), (2, 1, 4)]
  with pytest.raises(ValueError, match="three integers"):
    parse_meshes("1,8")


def _sweep_cmd(out, meshes, dispatch, *extra):
  return [sys.executable, "-m", "launch.mesh_sweep", "--config=configs/zaya1_tiny.py",
          "--config.model.num_layers=2", "--config.model.layer_types=('hybrid','hybrid_sliding')",
          f"--meshes={meshes}", f"--dispatches={dispatch}", "--batch_size=8", "--seq_len=32",
          f"--out={out}", *extra]


def _read(out):
  with open(os.path.join(out, "mesh_sweep.csv"), encoding="utf-8") as f:
    return list(csv.DictReader(f))


@pytest.mark.slow
def test_mesh_sweep_cli_on_8_fake_devices(tmp_path):
  env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags(8),
         "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  a2a, ag = str(tmp_path / "a2a"), str(tmp_path / "ag")
  procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
           for cmd in (_sweep_cmd(a2a, "1,1,8;1,1,4,2", "all_to_all", "--compile_only"),
                       _sweep_cmd(ag, "2,1,4", "allgather", "--steps=2"))]
  logs = [p.communicate(timeout=240)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
    assert "fake XLA:CPU devices" in log

  (row_a2a, row_cp), (row_ag,) = _read(a2a), _read(ag)
  assert tuple(row_a2a) == mesh_sweep.CSV_COLUMNS
  for row in (row_a2a, row_ag):
    for col in ("arg_bytes", "temp_bytes", "total_bytes", "flops", "dot_flops"):
      assert float(row[col]) > 0, (col, row)
  assert (row_a2a["dispatch"], row_ag["dispatch"]) == ("all_to_all", "allgather")
  assert float(row_a2a["all_to_all_bytes"]) > 0 and row_a2a["step_s"] == ""
  assert float(row_ag["all_gather_bytes"]) > 0 and float(row_ag["reduce_scatter_bytes"]) > 0
  assert float(row_ag["step_s"]) > 0 and float(row_ag["tokens_per_s"]) > 0
  # Context parallelism (mesh 1,1,4,2): CCA's halo is a collective-permute and its K/V an
  # all-gather over `context`; the 2,1,4 row has neither the axis nor a halo.
  assert (row_cp["context"], row_a2a["context"], row_ag["context"]) == ("2", "1", "1")
  assert float(row_cp["collective_permute_bytes"]) > 0 and float(row_cp["all_gather_bytes"]) > 0
  assert float(row_ag["collective_permute_bytes"]) == 0
  # ... and the ops inside CCA's shard_map (its named scope) move exactly the analytic bytes
  # of each kind; the MoE exchange of that row leaves them out (ratio as for 1,1,8 below).
  for kind in mesh_sweep.CP_KINDS:
    assert float(row_cp[f"cp_{kind}_bytes"]) > 0, kind
    assert float(row_cp[f"cp_{kind}_bytes"]) == pytest.approx(
        float(row_cp[f"cp_{kind}_analytic_bytes"]), rel=1e-9), kind
  assert row_a2a["cp_exchange_bytes"] == ""
  assert 1.0 <= float(row_cp["moe_exchange_bytes"]) / float(row_cp["a2a_analytic_bytes"]) <= 1.5
  # all_to_all with capacity 1.25 moves about 1.25x the analytic minimum; allgather n/2 x more.
  ratio = float(row_a2a["moe_exchange_bytes"]) / float(row_a2a["a2a_analytic_bytes"])
  assert 1.0 <= ratio <= 1.5, ratio
  assert os.path.getsize(os.path.join(a2a, "mesh_sweep.png")) > 0
