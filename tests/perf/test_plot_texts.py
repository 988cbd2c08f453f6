"""Every plot's title, axis labels and tick labels fit inside its figure (issue 23 item 8:
expert_load.png's title was cut off on the left, "t load over 20 train records...").

Each plotting function runs on synthetic data under a title as long as the tools write (the
host description of the benchmarks, a long workdir name), and `report.overflowing_texts`
compares every text's bounding box with the figure's.
"""

from __future__ import annotations

import numpy as np
import pytest

from zaya_jax.perf import collectives, gemm, memory, mesh_sweep, report, run_plots

HOST = ("figures from 8 cpu devices (--xla_force_host_platform_device_count) on a 2-core "
        "AMD EPYC host: XLA:CPU's per-device program, step times share this host's cores, "
        "not GPUs; peaks measured in this run")
RUN = "quantile_current_2k_tokens_per_step_tiny_run"  # make_plots' titles use the workdir name


def _train_records(num_layers=4, num_classes=9, steps=range(10, 210, 10)):
  records = []
  for i, step in enumerate(steps):
    load = np.full((num_layers, num_classes), 1.0 / num_classes)
    records.append({"kind": "train", "step": step, "loss": 5.0 - 0.01 * step, "lr": 3e-3,
                    "grad_norm": 0.5 + 0.01 * i, "skipped_steps": int(i > 10),
                    "expert_load": load.tolist(),
                    "balance/max_over_mean": [1.0 + 0.1 * i] * num_layers,
                    "balance/load_entropy": [1.0 - 0.01 * i] * num_layers})
  return records + [{"kind": "eval", "step": 200, "loss": 2.9}]


def _figures(tmp_path):
  records = _train_records()
  load_LX, steps = np.asarray(records[0]["expert_load"]), [r["step"] for r in records[:-1]]
  yield "loss.png", run_plots.plot_loss(records, str(tmp_path / "loss.png"),
                                        f"{RUN}: 20 train records, last step 200")
  yield "expert_load.png", run_plots.plot_expert_load(load_LX, steps,
                                                      str(tmp_path / "expert_load.png"), RUN)
  yield "expert_load.png (2 classes)", run_plots.plot_expert_load(
      np.array([[0.9, 0.1]]), [200], str(tmp_path / "small.png"), RUN)
  yield "balance.png", run_plots.plot_balance(records, str(tmp_path / "balance.png"), RUN)
  rows = [{"collective": c, "lowering": "xla", "mesh": "2,1,4", "axes": "expert", "n": 4,
           "size_bytes": 2**k, "busbw_GBps": 0.1 * k, "correct": k != 12}
          for c in ("all-gather", "reduce-scatter", "all-to-all") for k in range(10, 25, 2)]
  yield "collectives.png", collectives.plot(rows, str(tmp_path / "coll.png"), HOST)
  results = [gemm.GemmResult(gemm.GemmShape(kind, f"{kind}{m}", m, m, m), "float32", 1e-3,
                             0.5 + 0.01 * m ** 0.5, 1.0, "measured: best square", 0.5, 0.9,
                             False)
             for kind in ("square", "m") for m in (128, 256, 512, 1024)]
  results += [gemm.GemmResult(gemm.GemmShape("grid", "g", m, n, 512), "float32", 1e-3, 0.3,
                              1.0, "measured: best square", 0.3, 0.5, True)
              for m in (256, 512) for n in (256, 512)]
  yield "bench_gemm.png", gemm.plot(results, str(tmp_path / "gemm.png"), HOST)
  streams = [memory.StreamResult(k, "float32", 2**s, 2**s // 4, 3 * 2**s, 1e-3, 10.0 + s, None,
                                 True) for k in ("copy", "triad") for s in range(14, 28, 2)]
  yield "bench_memory.png", memory.plot(streams, str(tmp_path / "mem.png"), HOST)
  sweep = [{"data": d, "fsdp": 8 // (d * e), "expert": e, "dispatch": "allgather",
            "compile_s": 1.0, "arg_bytes": 2**30, "out_bytes": 2**29, "alias_bytes": 2**28,
            "temp_bytes": 2**31, **{f"{k.replace('-', '_')}_bytes": 2**24
                                   for k in mesh_sweep.COLLECTIVES}}
           for d, e in ((1, 1), (2, 1), (1, 4), (2, 4))]
  yield "mesh_sweep.png", mesh_sweep.plot(sweep, str(tmp_path / "sweep.png"),
                                          f"4 layers, batch 16 x seq 256. {HOST}")


@pytest.mark.slow
def test_every_plot_keeps_its_texts_inside_the_figure(tmp_path):
  figures = list(_figures(tmp_path))
  assert len(figures) == 8
  outside = {name: report.overflowing_texts(fig) for name, fig in figures}
  assert not any(outside.values()), {k: v for k, v in outside.items() if v}


def test_a_title_wider_than_its_figure_is_wrapped_not_cut(tmp_path):
  fig = report.new_figure(5.0, 4.0)
  ax = fig.subplots()
  ax.plot([0, 1], [0, 1])
  long = "mean expert load over 20 train records (steps 10-200); " * 3
  ax.set_title(long.strip())
  ax.set_ylabel("fraction of the layer's tokens, skip class last (the balancing target: 1/E)")
  report.save_figure(fig, str(tmp_path / "t.png"), HOST, fontsize=9)
  assert report.overflowing_texts(fig) == []
  assert ax.get_title().replace("\n", " ") == long.strip()  # wrapped, every word kept
  assert ax.get_title().count("\n") >= 2


def test_overflowing_texts_sees_a_cut_title():
  fig = report.new_figure(3.0, 2.0)
  ax = fig.subplots()
  ax.set_title("x" * 200)
  fig.tight_layout()
  assert report.overflowing_texts(fig) == ["x" * 200]

