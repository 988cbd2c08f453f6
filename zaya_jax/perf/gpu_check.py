# Shape letters: B T N K H (attention), M K N E (grouped matmul), M X (routing); see
# zaya_jax/__init__.py. Here K is also gmm's contraction, as in pallas_kernels/gmm.
"""The GPU acceptance run (`python -m launch.gpu_check`): kernels, timings and a train step.

One pass over what must hold before a run on a lent GPU is worth anything:

1. parity: each Pallas kernel (routing, gmm, CCA attention), compiled for the local GPU (on a
   CPU: the same kernel bodies in Pallas interpret mode), against its jnp reference on values
   and on gradients (`jax.vjp` of both sides, the same cotangent), in float32 and bfloat16, at
   small shapes with the awkward cases (an empty expert group, two documents in a row, GQA);
   the Pallas gmm is also compared with `jax.lax.ragged_dot`;
2. timings of Pallas against XLA at ZAYA1-base per-device shapes: CCA attention forward and
   forward + backward at T = 4096, GQA 8/2, head dim 128 (XLA: the model's
   `zaya_jax.ops.attention` "xla" path); the grouped matmul at 16 experts with the 256 rows per
   expert of a 4096-token sequence, D = F = 2048 (XLA: `jax.lax.ragged_dot`); routing of 4096
   tokens over 17 classes (XLA: `route_reference`). On a CPU these run at tiny shapes in
   interpret mode and are marked so: they prove the wiring, not a speed;
3. one training step of a 2-layer ZAYA1-base-width model in bfloat16 with the kernels on and
   off (`zaya_jax.perf.benchmark.benchmark`: tokens/s, MFU against the detected accelerator's
   dense bfloat16 peak, `zaya_jax.parallel.accelerators`). On a CPU: the tiny config's widths
   (2 layers), MFU against a float32 matmul timed in the same run.

Everything skipped says why (`Report.skipped`). Nothing here needs a GPU to run; what runs on
a CPU is a real check of the same code paths.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cca_attention import attention_reference, cca_flash_attention
from pallas_kernels.gmm import gmm
from pallas_kernels.gmm.reference import gmm_reference
from pallas_kernels.routing import route, route_reference
from pallas_kernels.timing import median_seconds
from zaya_jax.ops.attention import attention, attention_mask
from zaya_jax.parallel import accelerators
from zaya_jax.perf.report import text_table
from zaya_jax.perf.benchmark import BenchConfigs, benchmark

DTYPES = ("float32", "bfloat16")
# (atol, rtol) of `|got - want| <= atol + rtol |want|` by dtype and what is compared: the
# kernels' parity tests' tolerances (tests/kernels/).
TOLERANCES = {("float32", "value"): (1e-5, 1e-5), ("float32", "grad"): (2e-5, 2e-5),
              ("bfloat16", "value"): (2e-2, 2e-2), ("bfloat16", "grad"): (5e-2, 5e-2)}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass
class Report:
  """What the run found; `as_dict()` is the JSON file.

  Attributes:
    device: platform, device_kind, device count, the matched accelerator profile and its
      dense peaks in FLOP/s (None on a CPU).
    parity: one dict per (kernel, dtype): `checks` [{name, max_abs_err, atol, rtol, ok}], `ok`.
    timings: one dict per (op, pass, impl): `seconds` (median), `ratio_xla_over_pallas` on the
      Pallas row, `shapes` ("zaya1_base" or "tiny"), `interpret`.
    train_step: one dict per kernel setting: tokens_per_s, step_s, mfu, peak_source, loss...
    skipped: [{what, why}] for everything not run.
  """

  device: dict[str, Any]
  parity: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  timings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  train_step: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
  wall_s: float = 0.0

  @property
  def ok(self) -> bool:
    """Every parity check passed (timings and the train step have no pass/fail)."""
    return all(p["ok"] for p in self.parity)

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "ok": self.ok}


def device_info() -> dict[str, Any]:
  """Platform, device kind and count of the default backend, and its accelerator profile."""
  d = jax.devices()[0]
  profile = accelerators.detect_profile(d)
  return {"platform": d.platform, "device_kind": d.device_kind, "device_count": jax.device_count(),
          "on_gpu": d.platform in GPU_PLATFORMS, "profile": profile.name if profile else None,
          "peak_bf16_flops": profile.bf16_flops if profile else None,
          "peak_fp32_flops": profile.fp32_flops if profile else None}


def compare(name: str, got: Any, want: Any, atol: float, rtol: float) -> dict[str, Any]:
  """`{name, max_abs_err, atol, rtol, ok}`: `|got - want| <= atol + rtol |want|` everywhere
  (both in float64; shapes must agree, else `ok` is False and the error is inf)."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if g.shape != w.shape:
    return {"name": name, "max_abs_err": float("inf"), "atol": atol, "rtol": rtol, "ok": False}
  diff = np.abs(g - w)
  ok = bool(np.all(diff <= atol + rtol * np.abs(w))) and bool(np.all(np.isfinite(g)))
  return {"name": name, "max_abs_err": float(diff.max()) if diff.size else 0.0, "atol": atol,
          "rtol": rtol, "ok": ok}


def _vjp(fn: Callable, args: tuple, ct: Any) -> tuple[Any, tuple]:
  out, pullback = jax.vjp(fn, *args)
  return out, pullback(ct)


# --------------------------------------------------------------------------------------------
# 1. Parity at small shapes (compiled on a GPU, interpreted on a CPU).
# --------------------------------------------------------------------------------------------


def parity_routing(dtype: str, interpret: bool) -> dict[str, Any]:
  """`route` vs `route_reference` on M = 256 tokens, X = 17 classes: every output, and the
  gradient of `sum(gate * ct)` in the logits. Logits in `dtype` (both sides upcast)."""
  m, x = 256, 17
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  logits = (3.0 * jax.random.normal(k1, (m, x), jnp.float32)).astype(dtype)
  biases = (0.05 * jax.random.normal(k2, (x,), jnp.float32)).at[-1].set(-1.0)
  ct = jax.random.normal(k3, (m,), jnp.float32)
  got = jax.jit(lambda l: route(l, biases, interpret=interpret))(logits)
  want = jax.jit(lambda l: route_reference(l, biases))(logits)
  gate = lambda f: (lambda l: f(l).gate_M)
  _, (g_got,) = _vjp(gate(lambda l: route(l, biases, interpret=interpret)), (logits,), ct)
  _, (g_want,) = _vjp(gate(lambda l: route_reference(l, biases)), (logits,), ct)
  checks = [compare(f, getattr(got, f), getattr(want, f), 0.0, 0.0)
            for f in ("class_M", "order_M", "inverse_M", "group_sizes_X", "group_offsets_X")]
  checks += [compare("gate_M", got.gate_M, want.gate_M, 1e-6, 1e-6),
             compare("d logits", g_got, g_want, 1e-6, 1e-6)]
  return {"kernel": "routing", "dtype": dtype, "shapes": f"M={m} X={x}", "checks": checks}


def parity_gmm(dtype: str, interpret: bool) -> dict[str, Any]:
  """`gmm` vs `gmm_reference` (and `jax.lax.ragged_dot`) on M = 200 rows, 4 groups of
  [64, 0, 100, 28] (an empty group, partial tiles, 8 rows past the groups), K = 64, N = 96:
  values and both gradients."""
  m, k, n = 200, 64, 96
  gs = jnp.array([64, 0, 100, 28], jnp.int32)
  k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(k2, (4, k, n), jnp.float32) / k**0.5).astype(dtype)
  ct = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
  kernel = jax.jit(lambda a, b: gmm(a, b, gs, interpret=interpret))
  out, (dl, dr) = _vjp(kernel, (lhs, rhs), ct)
  want, (wdl, wdr) = _vjp(lambda a, b: gmm_reference(a, b, gs), (lhs, rhs), ct)
  tol, gtol = TOLERANCES[dtype, "value"], TOLERANCES[dtype, "grad"]
  ragged = jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST)
  checks = [compare("out", out, want, *tol), compare("d lhs", dl, wdl, *gtol),
            compare("d rhs", dr, wdr, *gtol), compare("out vs ragged_dot", out, ragged, *tol)]
  return {"kernel": "gmm", "dtype": dtype, "shapes": f"M={m} K={k} N={n} E=4 sizes=64,0,100,28",
          "checks": checks}


def parity_attention(dtype: str, interpret: bool) -> dict[str, Any]:
  """`cca_flash_attention` vs `attention_reference`, B = 2, T = 96 (a partial tile), N = 4,
  K = 2, H = 32, row 0 two documents, row 1 one document then padding; values and dq, dk, dv."""
  b, t, n, kh, h = 2, 96, 4, 2, 32
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, kh, h), jnp.float32).astype(dtype)
  ct = jax.random.normal(keys[3], (b, t, n, h), jnp.float32).astype(dtype)
  pos = jnp.arange(t)
  seg = jnp.stack([jnp.where(pos < 40, 1, 2), jnp.where(pos < 70, 1, 0)]).astype(jnp.int32)
  scale = h**-0.5
  kernel = jax.jit(lambda q, k, v: cca_flash_attention(q, k, v, seg, scale=scale,
                                                       interpret=interpret))
  out, grads = _vjp(kernel, (q, k, v), ct)
  want, wgrads = _vjp(lambda q, k, v: attention_reference(q, k, v, seg, scale=scale), (q, k, v), ct)
  tol, gtol = TOLERANCES[dtype, "value"], TOLERANCES[dtype, "grad"]
  checks = [compare("out", out, want, *tol)]
  checks += [compare(f"d{name}", g, w, *gtol) for name, g, w in zip("qkv", grads, wgrads)]
  return {"kernel": "cca_attention", "dtype": dtype,
          "shapes": f"B={b} T={t} N={n} K={kh} H={h} (2 documents; padding)", "checks": checks}


PARITY = {"routing": parity_routing, "gmm": parity_gmm, "cca_attention": parity_attention}


# --------------------------------------------------------------------------------------------
# 2. Timings, Pallas vs XLA.
# --------------------------------------------------------------------------------------------

BASE_SHAPES = {"attention": dict(b=1, t=4096, n=8, k=2, h=128),
               "gmm": dict(m=4096, d=2048, f=2048, e=16), "routing": dict(m=4096, x=17)}
TINY_SHAPES = {"attention": dict(b=1, t=64, n=4, k=2, h=32),
               "gmm": dict(m=64, d=32, f=48, e=4), "routing": dict(m=256, x=17)}


def _fwd_bwd(fn: Callable, ct: Any) -> Callable:
  """jit of `args -> (fn(*args), vjp(ct))` over every argument."""
  return jax.jit(lambda *a: _vjp(fn, a, ct))


def _time_pair(op: str, impls: dict[str, Callable], args: tuple, ct: Any, repeats: int,
               shapes: str, interpret: bool, flops: float) -> list[dict[str, Any]]:
  """Forward and forward+backward median seconds of each impl; the Pallas rows carry the
  XLA / Pallas time ratio (> 1: the kernel is faster). `flops` of one forward (x 3 fwd+bwd)."""
  rows = []
  for label, wrap, mult in (("forward", jax.jit, 1), ("fwd+bwd", lambda f: _fwd_bwd(f, ct), 3)):
    secs = {name: median_seconds(wrap(fn), args, repeats, warmup=1) for name, fn in impls.items()}
    xla = [s for name, s in secs.items() if name != "pallas"][0]
    for name, s in secs.items():
      rows.append({"op": op, "pass": label, "impl": name, "seconds": s, "shapes": shapes,
                   "interpret": interpret and name == "pallas",
                   "tflops": mult * flops / s / 1e12 if flops else None,
                   "ratio_xla_over_pallas": xla / s if name == "pallas" else None})
  return rows


def time_attention(s: dict, dtype, repeats: int, interpret: bool, label: str) -> list[dict]:
  """CCA attention, one document per row: `cca_flash_attention` vs the XLA path."""
  keys = jax.random.split(jax.random.key(4), 4)
  q = jax.random.normal(keys[0], (s["b"], s["t"], s["n"], s["h"]), dtype)
  k = jax.random.normal(keys[1], (s["b"], s["t"], s["k"], s["h"]), dtype)
  v = jax.random.normal(keys[2], (s["b"], s["t"], s["k"], s["h"]), dtype)
  ct = jax.random.normal(keys[3], q.shape, dtype)
  seg = jnp.ones((s["b"], s["t"]), jnp.int32)
  mask, scale = attention_mask(seg), s["h"]**-0.5
  impls = {"pallas": lambda q, k, v: cca_flash_attention(q, k, v, seg, scale=scale,
                                                         interpret=interpret),
           "xla": lambda q, k, v: attention(q, k, v, seg, mask, scale=scale, window=None,
                                            sliding=False, impl="xla")}
  flops = 4 * s["b"] * s["n"] * s["h"] * s["t"] * (s["t"] + 1) / 2  # causal pairs
  shapes = f"{label}: B={s['b']} T={s['t']} N={s['n']} K={s['k']} H={s['h']}"
  return _time_pair("cca_attention", impls, (q, k, v), ct, repeats, shapes, interpret, flops)


def time_gmm(s: dict, dtype, repeats: int, interpret: bool, label: str) -> list[dict]:
  """Grouped matmul `[M, D] x [E, D, F]`, M/E rows per group: Pallas `gmm` vs `ragged_dot`."""
  k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
  lhs = jax.random.normal(k1, (s["m"], s["d"]), dtype)
  rhs = (jax.random.normal(k2, (s["e"], s["d"], s["f"]), jnp.float32) / s["d"]**0.5).astype(dtype)
  ct = jax.random.normal(k3, (s["m"], s["f"]), dtype)
  gs = jnp.full((s["e"],), s["m"] // s["e"], jnp.int32)
  impls = {"pallas": lambda a, b: gmm(a, b, gs, interpret=interpret),
           "ragged_dot": lambda a, b: jax.lax.ragged_dot(a, b, gs)}
  shapes = f"{label}: M={s['m']} D={s['d']} F={s['f']} E={s['e']} ({s['m'] // s['e']} rows each)"
  return _time_pair("gmm", impls, (lhs, rhs), ct, repeats, shapes, interpret,
                    2 * s["m"] * s["d"] * s["f"])


def time_routing(s: dict, repeats: int, interpret: bool, label: str) -> list[dict]:
  """Routing of M tokens over X classes: Pallas `route` vs `route_reference` (argsort)."""
  logits = jax.random.normal(jax.random.key(6), (s["m"], s["x"]), jnp.float32)
  biases = jnp.zeros((s["x"],), jnp.float32).at[-1].set(-1.0)
  ct = jnp.ones((s["m"],), jnp.float32)
  impls = {"pallas": lambda l: route(l, biases, interpret=interpret).gate_M,
           "xla": lambda l: route_reference(l, biases).gate_M}
  return _time_pair("routing", impls, (logits,), ct, repeats, f"{label}: M={s['m']} X={s['x']}",
                    interpret, 0.0)


# --------------------------------------------------------------------------------------------
# 3. The training step, kernels on and off.
# --------------------------------------------------------------------------------------------

KERNELS_ON = dict(attention_impl="pallas", routing_impl="pallas", gmm_impl="pallas")
KERNELS_OFF = dict(attention_impl="xla", routing_impl="xla", gmm_impl="auto")


def train_steps(cfgs: BenchConfigs, *, batch_size: int, seq_len: int, steps: int,
                label: str, matmul_size: int, log: Callable[[str], None]) -> list[dict]:
  """`benchmark` of `cfgs` (2 layers, bfloat16) with the kernels off, then on; without an
  accelerator profile both rows' MFU divide by the larger of their two measured matmul peaks."""
  model = cfgs.model.replace(num_layers=2, layer_types=("hybrid", "hybrid"), dtype="bfloat16")
  rows = []
  for setting, impls in (("off", KERNELS_OFF), ("on", KERNELS_ON)):
    log(f"train step, kernels {setting} ({label}) ...")
    run = dataclasses.replace(cfgs, model=model.replace(**impls))
    r = benchmark(run, batch_size=batch_size, seq_len=seq_len, steps=steps, warmup=1,
                  matmul_size=matmul_size, log=lambda _: None)
    rows.append({"kernels": setting, "model": label, **impls, "batch_size": batch_size,
                 "seq_len": seq_len, **{k: r[k] for k in (
                     "compile_s", "step_s", "tokens_per_s", "flops_per_token", "achieved_flops",
                     "peak_flops", "peak_source", "mfu", "loss")}})
  # On a host without a peak profile each benchmark timed its own matmul peak, and one timing
  # on shared cores can come out at half the other: both rows divide by the larger one, so
  # their MFUs compare as their tokens/s do.
  if all(r["peak_source"].startswith("measured") for r in rows):
    peak = max(r["peak_flops"] for r in rows)
    for r in rows:
      r["peak_flops"], r["mfu"] = peak, r["achieved_flops"] / peak
      r["peak_source"] += " (the larger of the two rows' timings)"
  return rows


SECTIONS = ("parity", "timings", "train_step")


def check_skip(skip: tuple[str, ...]) -> None:
  """Raises ValueError naming `--skip` and the sections, for a name not in `SECTIONS`."""
  bad = [s for s in skip if s not in SECTIONS]
  if bad:
    raise ValueError(f"--skip={','.join(bad)}: unknown section; choose from {', '.join(SECTIONS)}")


def run_all(base: BenchConfigs, tiny: BenchConfigs, *, skip: tuple[str, ...] = (),
            log: Callable[[str], None] = print) -> Report:
  """The whole check on the default backend (module docstring).

  Args:
    base: ZAYA1-base's groups (train step on a GPU: its widths at 2 layers, B=1, T=4096).
    tiny: the tiny config's groups (train step on a CPU: its widths at 2 layers, B=2, T=32).
    skip: sections not to run: any of "parity", "timings", "train_step" (named in `skipped`).
    log: progress lines.

  Returns:
    A `Report`.

  Raises:
    ValueError: an unknown name in `skip`.
  """
  check_skip(skip)
  start = time.perf_counter()
  report = Report(device_info())
  gpu = report.device["on_gpu"]
  interpret = not gpu
  for s in skip:
    report.skipped.append({"what": s, "why": "--skip"})
  where = f"{report.device['platform']} ({report.device['device_kind']})"
  if not gpu:
    report.skipped.append({"what": "compiled Triton kernels", "why": f"no GPU: backend is {where}; "
                           "the kernel bodies ran in Pallas interpret mode instead"})
  if "parity" not in skip:
    for kernel, fn in PARITY.items():
      for dtype in DTYPES:
        log(f"parity {kernel} {dtype} ({'interpret' if interpret else 'compiled'}) ...")
        p = fn(dtype, interpret)
        p["interpret"], p["ok"] = interpret, all(c["ok"] for c in p["checks"])
        report.parity.append(p)
  if "timings" not in skip:
    shapes, label, repeats = (BASE_SHAPES, "zaya1_base", 10) if gpu else (TINY_SHAPES, "tiny", 2)
    if not gpu:
      report.skipped.append({"what": "timings at ZAYA1-base shapes (attention T=4096 GQA 8/2 "
                             "H=128; gmm 16 experts x 256 rows, D=F=2048; routing 4096 x 17)",
                             "why": "no GPU: interpret-mode times mean nothing; ran tiny shapes "
                             "to check the wiring"})
    log(f"timings ({label} shapes) ...")
    report.timings += time_attention(shapes["attention"], jnp.bfloat16, repeats, interpret, label)
    report.timings += time_gmm(shapes["gmm"], jnp.bfloat16, repeats, interpret, label)
    report.timings += time_routing(shapes["routing"], repeats, interpret, label)
  if "train_step" not in skip:
    if gpu:
      report.train_step = train_steps(base, batch_size=1, seq_len=4096, steps=3,
                                      label="zaya1_base widths, 2 layers", matmul_size=4096, log=log)
    else:
      report.skipped.append({"what": "train step at ZAYA1-base widths (2 layers, B=1, T=4096)",
                             "why": "no GPU: ran the tiny config's widths (2 layers, B=2, T=32); "
                             "MFU against a float32 matmul timed in this run"})
      report.train_step = train_steps(tiny, batch_size=2, seq_len=32, steps=2,
                                      label="zaya1_tiny widths, 2 layers", matmul_size=512, log=log)
  report.wall_s = time.perf_counter() - start
  return report


def format_report(r: Report) -> str:
  """The report as text tables: device, parity, timings, train step, skipped."""
  d = r.device
  peak = f"{d['peak_bf16_flops'] / 1e12:.1f} TFLOP/s bf16" if d["peak_bf16_flops"] else "no profile"
  out = [f"device: {d['platform']} {d['device_kind']} x {d['device_count']} (profile "
         f"{d['profile'] or '-'}, {peak}); wall {r.wall_s:.1f} s; parity "
         f"{'ALL OK' if r.ok else 'FAILED'}"]
  if r.parity:
    lines = []
    for p in r.parity:
      worst = max(p["checks"], key=lambda c: c["max_abs_err"] / (c["atol"] or 1.0))
      bad = [c["name"] for c in p["checks"] if not c["ok"]]
      lines.append((p["kernel"], p["dtype"], "interpret" if p["interpret"] else "compiled",
                    str(len(p["checks"])), worst["name"], f"{worst['max_abs_err']:.2e}",
                    f"{worst['atol']:.0e}", "ok" if p["ok"] else "FAIL " + ",".join(bad), p["shapes"]))
    out += ["", "Parity against the jnp references (values and gradients):",
            text_table(("kernel", "dtype", "mode", "checks", "worst", "max|diff|", "atol",
                               "result", "shapes"), lines, left=(0, 1, 2, 4, 7, 8))]
  if r.timings:
    lines = [(t["op"], t["pass"], t["impl"], f"{t['seconds'] * 1e3:.3f}",
              "-" if t["tflops"] is None else f"{t['tflops']:.2f}",
              "-" if t["ratio_xla_over_pallas"] is None else f"{t['ratio_xla_over_pallas']:.2f}x",
              t["shapes"]) for t in r.timings]
    out += ["", "Timings (median; ratio = XLA time / Pallas time, > 1: the kernel is faster):",
            text_table(("op", "pass", "impl", "ms", "TFLOP/s", "xla/pallas", "shapes"),
                              lines, left=(0, 1, 2, 6))]
  if r.train_step:
    lines = [(t["kernels"], t["model"], f"{t['step_s'] * 1e3:.1f}", f"{t['tokens_per_s']:,.0f}",
              f"{100 * t['mfu']:.1f}%", f"{t['loss']:.4f}", f"{t['compile_s']:.1f}",
              t["peak_source"]) for t in r.train_step]
    out += ["", "Train step (bfloat16, one device; MFU = sizing FLOPs x tokens/s / peak):",
            text_table(("kernels", "model", "step ms", "tokens/s", "MFU", "loss",
                               "compile s", "peak"), lines, left=(0, 1, 7))]
  if r.skipped:
    out += ["", "Skipped:"] + [f"  - {s['what']}: {s['why']}" for s in r.skipped]
  return "\n".join(out)
