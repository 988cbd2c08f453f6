"""Peak memory of `launch.convert_from_hf` on a mid-sized random HF model (a measurement, not a test).

  python -m tests.convert.measure_import_memory [--hf_dir=/tmp/zaya_mem_hf] [--rebuild]   # Linux

Builds (once, cached in --hf_dir) a random `transformers.ZayaForCausalLM` of hidden 512,
8 layers, 16 experts of width 256 and vocab 32768 (~290 MB of float32 parameters), then runs
the real CLI in a subprocess on a fresh workdir and samples its /proc status every 5 ms:
VmRSS (all resident pages), RssAnon (heap: arrays, Python) and RssFile (file pages, e.g.
mmapped safetensors, reclaimable). It also runs a process that only imports the launcher and
starts the JAX CPU backend, as the fixed overhead. Prints, in MB (10^6 bytes): the parameter
bytes P, each peak, the ratios (peak - overhead) / P, and the launcher's own "peak RSS so
far" log lines after loading the parameters and after building the optimizer state (the
rest of the peak is the checkpoint write). For scale: holding the parameters and separate
Adam moments mu and nu is 3P; `launch.convert_from_hf` shares one zeros buffer between the
all-zero moments, so its floor is about 2P.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_experts=16, moe_intermediate_size=256,
             router_hidden_size=64, sliding_window=64,
             layer_types=["hybrid", "hybrid_sliding"] + ["hybrid"] * 6,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # byte tokenizer ids
# The same architecture as `--config.*` overrides of configs/zaya1_tiny.py.
OVERRIDES = [
    "--config.model.vocab_size=32768", "--config.model.hidden_size=512",
    "--config.model.num_layers=8",
    "--config.model.layer_types=('hybrid','hybrid_sliding'," + "'hybrid'," * 6 + ")",
    "--config.model.sliding_window=64", "--config.model.num_heads=8",
    "--config.model.num_kv_heads=2", "--config.model.head_dim=64",
    "--config.model.num_experts=16", "--config.model.moe_intermediate_size=256",
    "--config.model.router_hidden_size=64", "--config.model.skip_mode=zero",
]


def build(hf_dir: str) -> None:
  """Writes a random `ZayaForCausalLM` of `SIZES` (float32) to `hf_dir`."""
  import torch
  from transformers import ZayaConfig, ZayaForCausalLM

  torch.manual_seed(0)
  model = ZayaForCausalLM(ZayaConfig(**SIZES))
  model.save_pretrained(hf_dir)


def param_bytes(hf_dir: str) -> int:
  """float32 bytes of every tensor in the checkpoint (read from the safetensors headers)."""
  from safetensors import safe_open

  files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
  total = 0
  for name in files:
    with safe_open(os.path.join(hf_dir, name), framework="np") as f:
      for k in f.keys():
        n = 1
        for d in f.get_slice(k).get_shape():
          n *= d
        total += 4 * n
  return total


def _status_kb(pid: int) -> dict[str, int]:
  with open(f"/proc/{pid}/status") as f:
    rows = [line.split() for line in f]
  return {r[0][:-1]: int(r[1]) for r in rows if r and r[0] in ("VmRSS:", "RssAnon:", "RssFile:")}


def run_sampled(cmd: list[str]) -> tuple[dict[str, int], int, str]:
  """Runs `cmd` from the repo root; returns ({field: peak kB}, exit code, its output)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
  out: list[str] = []
  reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
  reader.start()
  while proc.poll() is None:
    try:
      for k, v in _status_kb(proc.pid).items():
        peaks[k] = max(peaks[k], v)
    except (FileNotFoundError, ProcessLookupError):
      break
    time.sleep(0.005)
  proc.wait()
  reader.join()
  return peaks, proc.returncode, "".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hf_dir", default="/tmp/zaya_mem_hf")
  parser.add_argument("--rebuild", action="store_true", help="rebuild the random HF model")
  args = parser.parse_args()
  if args.rebuild or not os.path.exists(os.path.join(args.hf_dir, "config.json")):
    build(args.hf_dir)
  p = param_bytes(args.hf_dir)
  mb = lambda kb: kb * 1024 / 1e6

  base, rc, out = run_sampled([sys.executable, "-c",
                               "import launch.convert_from_hf, jax; jax.devices()"])
  assert rc == 0, out[-3000:]
  workdir = tempfile.mkdtemp(prefix="zaya_mem_run_")
  try:
    t0 = time.time()
    peaks, rc, out = run_sampled([
        sys.executable, "-m", "launch.convert_from_hf", f"--hf_dir={args.hf_dir}",
        f"--workdir={workdir}", "--config=configs/zaya1_tiny.py", *OVERRIDES])
    seconds = time.time() - t0
    maxrss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over both children
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if rc != 0:
    sys.exit(f"convert_from_hf failed (exit {rc}):\n{out[-3000:]}")
  over = base["VmRSS"]
  phases = re.findall(r"memory: (.*?); peak RSS so far ([0-9.]+) GB", out)
  report = {
      "param_MB": round(p / 1e6, 1),
      "params_plus_two_moments_MB": round(3 * p / 1e6, 1),
      "overhead_imports_MB": round(mb(over), 1),
      "peak_VmRSS_MB": round(mb(peaks["VmRSS"]), 1),
      "peak_RssAnon_MB": round(mb(peaks["RssAnon"]), 1),
      "peak_RssFile_MB": round(mb(peaks["RssFile"]), 1),
      "ru_maxrss_MB": round(mb(maxrss_kb), 1),
      "(peak_VmRSS - overhead) / P": round((mb(peaks["VmRSS"]) - mb(over)) * 1e6 / p, 2),
      "(peak_RssAnon - overhead_anon) / P": round(
          (mb(peaks["RssAnon"]) - mb(base["RssAnon"])) * 1e6 / p, 2),
      "seconds": round(seconds, 1),
  }
  for name, (_, gb) in zip(("peak_after_load_MB", "peak_after_optimizer_state_MB"), phases):
    report[name] = round(float(gb) * 1e3, 1)  # the rest of the peak: the checkpoint write
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
