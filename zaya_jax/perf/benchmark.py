# Shape letters: B T V (see zaya_jax/__init__.py).
"""Training-step benchmark: tokens/s, step time, achieved FLOP/s, MFU and peak memory.

`benchmark(config, ...)` builds the jitted training step exactly as `zaya_jax.train.loop`
does (`abstract_model` -> `make_optimizer` / `make_schedule` -> `train_state_shardings` ->
`make_train_step(..., balance=...)`, state from `init_train_state`), feeds it one synthetic
batch (`zaya_jax.perf.synthetic.synthetic_batch`: random token ids, one document per
row), runs `warmup` steps (the first compiles) and times `steps` more, each waited for.

Figures (one dict, `BenchResult`):
- `step_s`: median wall seconds per step; `tokens_per_s` = B x T / step_s.
- `flops_per_token`: training FLOPs per token (fwd + bwd) from
  `zaya_jax.model.sizing.train_flops_per_token` (the sizing command's count: matmuls,
  attention with causal halving, CCA convs, active experts only); `achieved_flops` =
  flops_per_token x tokens_per_s, FLOP/s.
- `peak_flops`: FLOP/s the MFU divides by. On CPU it is *measured* in the same run: the median
  time of a large float32 `[n, n] @ [n, n]` matmul (`accelerators.measure_matmul_peak`), so it
  describes this host's cores under the load they carry right now. On a GPU it is the
  detected accelerator profile's dense peak for the model dtype
  (`zaya_jax.parallel.accelerators`). `mfu` = achieved_flops / peak_flops.
- `peak_memory_bytes`: on an accelerator the device's `peak_bytes_in_use`; on CPU the
  process's peak resident set size (`resource.getrusage`, read before the transformers run).

`compare_transformers(...)` times `transformers`' `ZayaForCausalLM` (random init from
`ModelConfig.to_hf_dict()`, no download) on the same config and batch: forward with labels
(its shifted cross-entropy), backward, `torch.optim.AdamW` step, `zero_grad`. Torch gets as
many intra-op threads as JAX's CPU client uses: XLA:CPU sizes its thread pool to the cores
this process may run on (`os.sched_getaffinity`), so `torch.set_num_threads` gets that count.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable

import jax
import ml_collections

from zaya_jax.config import BalanceConfig, TrainConfig, synthetic_configs
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.mesh import MeshConfig, check_divisibility, make_mesh, use_mesh
from zaya_jax.perf.op_profile import op_profile
from zaya_jax.perf.synthetic import synthetic_batch
from pallas_kernels import timing
from zaya_jax.parallel import accelerators
from zaya_jax.model.sizing import train_flops_per_token
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import init_train_state


@dataclasses.dataclass(frozen=True)
class BenchConfigs:
  """The validated groups the benchmark uses (data and checkpoint are never read)."""

  model: ModelConfig
  train: TrainConfig
  mesh: MeshConfig
  balance: BalanceConfig


def bench_configs(config: ml_collections.ConfigDict) -> BenchConfigs:
  """Validates the `model`, `train`, `mesh` and `balance` groups of `config`.

  Batches are synthetic, so the data group and the tokenizer are not consulted (as in
  `zaya_jax.config.synthetic_configs`).

  Raises:
    ConfigError: naming the field, for an invalid value.
  """
  return BenchConfigs(*synthetic_configs(config))


def cpu_threads() -> int:
  """Cores XLA:CPU's thread pool uses: those this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def time_steps(step: Callable, state: Any, batch: Any, steps: int,
               warmup: int) -> tuple[list[float], Any]:
  """Wall seconds of each of `steps` calls `state, _ = step(state, batch)` after `warmup`
  untimed ones, every call waited for (`jax.block_until_ready`), and the last state (the
  step donates its input, so a caller that times again must continue from it)."""
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return times, state


def benchmark(cfgs: BenchConfigs, *, batch_size: int, seq_len: int, steps: int, warmup: int,
              matmul_size: int = 2048, profile_steps: int = 0,
              log: Callable[[str], None] = print) -> dict[str, Any]:
  """Times the training step of `cfgs` and derives throughput, MFU and memory.

  Args:
    cfgs: from `bench_configs`.
    batch_size: B, sequences per step (global).
    seq_len: T, tokens per sequence.
    steps: timed steps (>= 1).
    warmup: untimed steps before them (>= 1: the first call compiles).
    matmul_size: n of the CPU peak matmul `[n, n] @ [n, n]`.
    profile_steps: after the timed steps, this many more under the profiler
      (`zaya_jax.perf.op_profile`: op time per source function); 0 = none.
    log: progress lines.

  Returns:
    A flat dict: `host`, `backend`, `devices`, `threads`, `batch_size`, `seq_len`,
    `tokens_per_step`, `steps`, `warmup`, `compile_s` (first step, seconds, compile included),
    `step_s` (median, seconds), `step_s_min`, `step_s_max`, `tokens_per_s`, `flops_per_token`
    (FLOP), `achieved_flops` (FLOP/s), `peak_flops` (FLOP/s), `peak_source`, `mfu` (fraction),
    `peak_memory_bytes` (bytes), `memory_source`, `loss` (float32 loss of the last timed
    step); with `profile_steps`, `profile` (`op_profile`'s result).

  Raises:
    ValueError: for `steps` < 1 or `warmup` < 1, or a mesh that does not divide the config.
  """
  if steps < 1 or warmup < 1:
    raise ValueError(f"steps={steps} and warmup={warmup} must both be >= 1")
  mesh = make_mesh(cfgs.mesh)
  check_divisibility(mesh, num_experts=cfgs.model.num_experts,
                     hidden_size=cfgs.model.hidden_size, batch_size=batch_size,
                     grad_accum_steps=cfgs.train.grad_accum_steps)
  with use_mesh(mesh):
    built = setup_training(cfgs.model, cfgs.train, mesh, cfgs.balance)
    step, state = built.step, init_train_state(cfgs.model, built.tx, cfgs.train.seed, mesh)
    batch = synthetic_batch(cfgs.model, batch_size, seq_len, mesh)
    log(f"compiling and warming up ({warmup} step(s)) ...")
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times, state = time_steps(step, state, batch, steps, warmup - 1)
    op_times = None
    if profile_steps:
      log(f"profiling {profile_steps} step(s) ...")
      op_times = op_profile(step, (state, batch), steps=profile_steps,
                           feed=lambda out, args: (out[0], args[1]))
    state = None  # donated above; free nothing else
  step_s = statistics.median(times)
  tokens = batch_size * seq_len
  flops_per_token = float(train_flops_per_token(cfgs.model, seq_len))
  result: dict[str, Any] = {
      "host": timing.host_description(), "backend": jax.default_backend(),
      "devices": mesh.size, "threads": cpu_threads(), "batch_size": batch_size,
      "seq_len": seq_len, "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
      "compile_s": compile_s, "step_s": step_s, "step_s_min": min(times),
      "step_s_max": max(times), "tokens_per_s": tokens / step_s,
      "flops_per_token": flops_per_token,
      "achieved_flops": flops_per_token * tokens / step_s}
  result["peak_memory_bytes"], result["memory_source"] = accelerators.peak_memory_bytes()
  profile = accelerators.detect_profile()
  if jax.default_backend() == "cpu" or profile is None:
    log(f"measuring the float32 matmul peak ({matmul_size}^3) ...")
    result["peak_flops"] = accelerators.measure_matmul_peak(matmul_size)
    result["peak_source"] = f"measured float32 matmul {matmul_size}x{matmul_size}x{matmul_size}"
  else:
    result["peak_flops"] = profile.peak_flops(cfgs.model.dtype)
    result["peak_source"] = f"{profile.name} {cfgs.model.dtype} dense peak (profile)"
  result["mfu"] = result["achieved_flops"] / result["peak_flops"]
  result["loss"] = float(metrics["loss"])
  if op_times is not None:
    result["profile"] = op_times
  return result


def compare_transformers(model_cfg: ModelConfig, *, batch_size: int, seq_len: int, steps: int,
                         warmup: int, threads: int, seed: int = 0,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
  """Times `transformers.ZayaForCausalLM` forward + backward + AdamW on the same shapes.

  The model is built from `model_cfg.to_hf_dict()` with random init (float32; the dtype of
  `model_cfg` is ignored: transformers runs in float32 on CPU); the batch has the same
  shape and value range as `synthetic_batch`. Each step: `model(input_ids, labels=...)`,
  `loss.backward()`, `AdamW.step()`, `zero_grad(set_to_none=True)`.

  Args:
    threads: torch intra-op threads (`torch.set_num_threads`), set to JAX's CPU cores.

  Returns:
    `{"hf_threads", "hf_step_s" (median seconds), "hf_step_s_min", "hf_step_s_max",
    "hf_tokens_per_s"}`.

  Raises:
    ValueError: for `steps` < 1 or `warmup` < 0.
  """
  if steps < 1 or warmup < 0:
    raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
  import torch  # pylint: disable=import-outside-toplevel  (optional dependency)
  from transformers import ZayaConfig, ZayaForCausalLM  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(threads)
  torch.manual_seed(seed)
  hf = ZayaConfig(**{k: v for k, v in model_cfg.to_hf_dict().items()
                     if k not in ("model_type", "architectures")})
  model = ZayaForCausalLM(hf).float().train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
  g = torch.Generator().manual_seed(seed)
  ids = torch.randint(3, model_cfg.vocab_size, (batch_size, seq_len), generator=g)
  log(f"transformers reference: {warmup} warm-up + {steps} timed steps, {threads} threads ...")
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  return {"hf_threads": threads, "hf_step_s": step_s, "hf_step_s_min": min(times),
          "hf_step_s_max": max(times), "hf_tokens_per_s": batch_size * seq_len / step_s}


def run(cfgs: BenchConfigs, *, steps: int, warmup: int, compare: bool = False,
        matmul_size: int = 2048, profile_steps: int = 0,
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """`benchmark` at the config's batch (train.batch_size x train.seq_len) and, with `compare`,
  `compare_transformers` in the same process, adding `hf_*` figures, `hf_mfu` (the
  reference's MFU by the same FLOP count and peak) and `ratio` (our tokens/s over the
  reference's).

  Raises:
    ValueError: as `benchmark`.
  """
  batch, seq = cfgs.train.batch_size, cfgs.train.seq_len
  result = benchmark(cfgs, batch_size=batch, seq_len=seq, steps=steps, warmup=warmup,
                     matmul_size=matmul_size, profile_steps=profile_steps, log=log)
  if compare:
    result.update(compare_transformers(cfgs.model, batch_size=batch, seq_len=seq, steps=steps,
                                       warmup=warmup, threads=result["threads"],
                                       seed=cfgs.train.seed, log=log))
    result["hf_mfu"] = result["flops_per_token"] * result["hf_tokens_per_s"] / result["peak_flops"]
    result["ratio"] = result["tokens_per_s"] / result["hf_tokens_per_s"]
  return result


def balance_variant_name(cfg: BalanceConfig) -> str:
  """The `parse_balance_variant` name of a config's balancing: "none", the mode, or
  "quantile:next" / "quantile:reroute" / "quantile:current"."""
  if not cfg.enabled:
    return "none"
  if cfg.mode != "quantile":
    return cfg.mode
  return "quantile:" + ("reroute" if cfg.quantile_apply == "next" and cfg.quantile_reroute
                        else cfg.quantile_apply)


def parse_balance_variant(text: str, flag: str = "--compare_balance",
                          base: BalanceConfig | None = None) -> BalanceConfig:
  """`"none"`, a `balance.mode`, or `"quantile:next"` / `"quantile:reroute"` (next, with
  `quantile_reroute`) / `"quantile:current"` -> BalanceConfig: `base` (the run config's
  balance group, so its `--config.balance.*` settings hold in every variant; None = the
  defaults) with `enabled`, `mode` and the named quantile fields replaced.

  Raises:
    ValueError: an unknown variant, naming `flag` (the command-line flag that gave it) and the
      accepted variants.
  """
  base = BalanceConfig() if base is None else base
  if text == "none":
    return dataclasses.replace(base, enabled=False)
  mode, _, apply = text.partition(":")
  kw = {"quantile_apply": apply} if apply else {}
  if apply == "reroute":
    kw = {"quantile_apply": "next", "quantile_reroute": True}
  elif apply == "next":
    kw["quantile_reroute"] = False
  try:
    return dataclasses.replace(base, enabled=True, mode=mode, **kw)
  except ValueError as e:
    raise ValueError(f"{flag} entry {text!r}: {e} (e.g. none, pid, sign, adamw, "
                     "quantile:current, quantile:next, quantile:reroute)") from e


def compare_balance(cfgs: BenchConfigs, variants: list[str], *, steps: int, warmup: int,
                    rounds: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Median step time of the training step under each balancing variant, in one process.

  Each variant's step is compiled and warmed up, then the variants are timed in turn,
  `rounds` times `steps` steps each (interleaved, so a change of the machine's load hits them
  alike); `ratio` is each variant's median over the first variant's.

  Returns:
    `{"variants": [...], "step_s": {variant: median seconds}, "ratio": {variant: float},
    "tokens_per_step": int}`.

  Raises:
    ValueError: an unknown variant, or a mesh that does not divide the config.
  """
  balances = {v: parse_balance_variant(v, base=cfgs.balance) for v in variants}
  batch_size, seq_len = cfgs.train.batch_size, cfgs.train.seq_len
  mesh = make_mesh(cfgs.mesh)
  check_divisibility(mesh, num_experts=cfgs.model.num_experts,
                     hidden_size=cfgs.model.hidden_size, batch_size=batch_size,
                     grad_accum_steps=cfgs.train.grad_accum_steps)
  times: dict[str, list[float]] = {v: [] for v in variants}
  with use_mesh(mesh):
    batch = synthetic_batch(cfgs.model, batch_size, seq_len, mesh)
    runs = {}
    for v, bal in balances.items():
      log(f"compiling the train step with balancing {v} ...")
      built = setup_training(cfgs.model, cfgs.train, mesh, bal)
      state = init_train_state(cfgs.model, built.tx, cfgs.train.seed, mesh)
      state, metrics = built.step(state, batch)
      jax.block_until_ready(metrics)
      runs[v] = [built.step, state]
    for _ in range(rounds):
      for v in variants:
        step, state = runs[v]
        round_times, runs[v][1] = time_steps(step, state, batch, steps, warmup)
        times[v].extend(round_times)
  step_s = {v: statistics.median(t) for v, t in times.items()}
  return {"variants": variants, "step_s": step_s, "tokens_per_step": batch_size * seq_len,
          "ratio": {v: step_s[v] / step_s[variants[0]] for v in variants}}


def format_balance(r: dict[str, Any]) -> str:
  """A `compare_balance` result as one line per variant: ms/step, tokens/s, ratio to the first."""
  return "\n".join(f"{v:>18}: {1e3 * r['step_s'][v]:8.1f} ms/step  "
                   f"{r['tokens_per_step'] / r['step_s'][v]:8.0f} tokens/s  x{r['ratio'][v]:.3f}"
                   for v in r["variants"])


def format_report(r: dict[str, Any]) -> str:
  """The result as aligned `name: value unit` lines."""
  lines = [
      f"host: {r['host']}",
      f"batch: {r['batch_size']} x {r['seq_len']} = {r['tokens_per_step']} tokens/step, "
      f"{r['steps']} timed steps after {r['warmup']} warm-up",
      f"compile + first step: {r['compile_s']:.1f} s",
      f"step time (median): {r['step_s'] * 1e3:.1f} ms (min {r['step_s_min'] * 1e3:.1f}, "
      f"max {r['step_s_max'] * 1e3:.1f})",
      f"tokens/s: {r['tokens_per_s']:.1f}",
      f"training FLOPs/token: {r['flops_per_token'] / 1e6:.2f} MFLOP (sizing count, fwd+bwd)",
      f"achieved: {r['achieved_flops'] / 1e9:.2f} GFLOP/s",
      f"peak: {r['peak_flops'] / 1e9:.2f} GFLOP/s ({r['peak_source']})",
      f"MFU: {100 * r['mfu']:.1f}%",
      f"peak memory: {r['peak_memory_bytes'] / 2**20:.1f} MiB ({r['memory_source']})",
  ]
  if "hf_tokens_per_s" in r:
    lines += [
        f"transformers step time (median): {r['hf_step_s'] * 1e3:.1f} ms "
        f"({r['hf_threads']} torch threads)",
        f"transformers tokens/s: {r['hf_tokens_per_s']:.1f}",
        f"transformers MFU: {100 * r['hf_mfu']:.1f}%",
        f"speed-up vs transformers: {r['ratio']:.2f}x",
    ]
  return "\n".join(lines)
