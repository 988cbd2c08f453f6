"""Systems instruments from the paper's hardware half (arXiv 2511.17127 §3-4): accelerator
profiles, sizing and roofline estimates, collective / GEMM / memory micro-benchmarks and the
training-step benchmark. Entry points: `python -m launch.{sizing,bench_collectives,benchmark,
bench_gemm,bench_memory}`."""
