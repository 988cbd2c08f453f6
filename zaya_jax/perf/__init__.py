"""Systems instruments from the paper's hardware half (arXiv 2511.17127 §3-4): accelerator
profiles, sizing and roofline estimates, collective / GEMM / memory micro-benchmarks, the
mesh-shape sweep and the training-step benchmark; `report` writes their CSV files, tables and
PNGs. Entry points: `python -m launch.{sizing,bench_collectives,benchmark,bench_gemm,
bench_memory,mesh_sweep,plot,balance_report}`."""
