"""The hot ops of the model, each with one `IMPLS` table and an `impl` string argument.

  attention.py       CCA's softmax attention: "xla" (causal block triangle) | "pallas"
  route.py           ZAYA1's top-1 choice and gate: "xla" | "pallas"
  grouped_matmul.py  the experts' grouped matmul: "auto" | "ragged_dot" | "tiled" | "looped" | "fused" | "pallas"
  fused_experts.py   the experts' SwiGLU fused per row tile (the "fused" impl); row_tiles.py its tiles
  cross_entropy.py   the fused LM head + cross-entropy of the training loss
  sharding.py        running a Pallas call per batch shard under a device mesh

Ops take impl strings, never a config: `zaya_jax.config.ModelConfig` validates its
`attention_impl` / `routing_impl` / `gmm_impl` fields from these tables and the model passes
them through. The "pallas" impls call pallas_kernels/ (Triton lowering: ROCm and CUDA; on a
CPU backend they run in Pallas interpret mode: correct, slow, for tests).
"""
