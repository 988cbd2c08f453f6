"""Base config: ZAYA1-base model sizes with generic training defaults.

Every field carries a comment with its unit. Variants (`zaya1_base.py`, `zaya1_tiny.py`)
import this file and override fields; they never copy it. `zaya_jax.config.resolve` validates
the result once and turns each group into a frozen dataclass.

Override any field from the command line:
  python -m launch.train --config=configs/zaya1_tiny.py --config.train.lr=1e-3 --workdir=DIR
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the base ConfigDict with groups `model`, `data`, `train`, `checkpoint`, `mesh`,
  `balance`."""
  config = ml_collections.ConfigDict()

  # --- model: one field per zaya_jax.config.model.ModelConfig field, same names -------------
  m = config.model = ml_collections.ConfigDict()
  m.vocab_size = 262272  # V, tokens in the embedding/LM head; >= tokenizer vocab (a multiple of 64 is faster on GPUs)
  m.hidden_size = 2048  # D, width of the residual stream
  m.num_layers = 40  # L, layers (each = CCA attention block + MoE block)
  m.num_heads = 8  # N, query heads
  m.num_kv_heads = 2  # K, key/value heads (GQA); divides num_heads, even (current|delayed halves)
  m.head_dim = 128  # H, channels per attention head
  m.num_experts = 16  # E, routed experts; the router has E+1 classes (last = skip)
  m.moe_intermediate_size = 2048  # F, SwiGLU hidden width of one expert
  m.router_hidden_size = 256  # R, width of the router's down-projection / MLP
  m.cca_time0 = 2  # tokens, kernel width of CCA's depthwise conv over time
  m.cca_time1 = 2  # tokens, kernel width of CCA's grouped (per-head) conv over time
  m.layer_types = ("hybrid",) * 40  # tuple, one per layer: "hybrid" (full) | "hybrid_sliding"
  # Tokens a "hybrid_sliding" query sees (itself included); None = no sliding layers.
  m.sliding_window = ml_collections.FieldReference(None, field_type=int)
  m.rope_theta = 5_000_000.0  # RoPE base of "hybrid" layers
  m.rope_theta_sliding = 10_000.0  # RoPE base of "hybrid_sliding" layers
  m.partial_rotary_factor = 0.5  # fraction of head_dim that RoPE rotates
  m.rms_norm_eps = 1e-5  # epsilon inside every RMSNorm
  m.attention_bias = False  # biases on the q/k/v/o projections
  m.lm_head_bias = False  # bias on the (tied) LM head
  m.initializer_range = 0.02  # std of the normal init of weight matrices
  # Router MLP init: "fan_in" (std 1/sqrt(R): fresh logits differ between tokens, so the
  # balancing biases can split them from step 0) | "normal" (initializer_range, as HF).
  m.router_init = "fan_in"
  m.skip_mode = "scaled_identity"  # skip-class output: "scaled_identity" (gate * x, Zyphra) | "zero" (HF)
  m.dtype = "float32"  # matmul compute dtype: "float32" | "bfloat16" (params, residual stay f32)
  m.scan_layers = True  # run layers with nnx.scan: compile time independent of depth
  m.remat = False  # rematerialise each layer in the backward pass (less memory, ~1/3 more FLOPs)
  m.moe_dispatch = "auto"  # EP token dispatch: "auto" (ragged_all_to_all on GPU, allgather on CPU) | "allgather" | "all_to_all" | "ragged_all_to_all" | "local"
  m.capacity_factor = 1.25  # "all_to_all" only: slots per expert per shard = factor * tokens / E
  m.force_balanced_routing = False  # debug: round-robin tokens over experts (throughput/memory runs)
  # One impl per hot op (zaya_jax/ops/). "pallas" = the Pallas kernel (Triton lowering: ROCm
  # and CUDA; interpret mode on CPU, slow), e.g. --config.model.attention_impl=pallas.
  m.attention_impl = "xla"  # CCA attention: "xla" (causal block triangle) | "pallas" (flash kernel)
  m.attention_backward = "autodiff"  # "xla" attention's backward: "autodiff" (saves every block's probabilities) | "recompute" (flash-style: saves a log-sum-exp per query, recomputes them)
  m.routing_impl = "xla"  # top-1 routing: "xla" | "pallas"
  # Experts' grouped matmul: "auto" (fused on CPU, ragged_dot on GPU) | "ragged_dot" | "tiled" |
  # "looped" | "fused" (the SwiGLU in one pass per row tile; fastest on CPU, with or without
  # expert parallelism) | "pallas".
  m.gmm_impl = "auto"
  m.pad_token_id = 0  # token id of padding; must equal the tokenizer's pad id
  m.bos_token_id = 2  # token id of beginning-of-sequence; must equal the tokenizer's bos id
  m.eos_token_id = 106  # token id of end-of-sequence; must equal the tokenizer's eos id

  # --- data: zaya_jax.data.DataConfig -------------------------------------------------------
  d = config.data = ml_collections.ConfigDict()
  d.source = "stdlib"  # corpus: "stdlib" (built-in demo text) or a path to your own data
  d.text_field = "text"  # name of the text column/key in each record of `source`
  d.tokenizer = "byte"  # "byte" (vocab 259: pad 0, bos 1, eos 2) or a path to a tokenizer file
  d.eval_fraction = 0.02  # fraction of documents held out for evaluation, in [0, 1)
  d.shuffle_seed = 0  # seed of the document shuffle (independent of train.seed)
  d.shuffle_rows = True  # a batch takes rows from a seeded permutation of each shuffle_window packed rows (not consecutive cuts of one document)
  d.shuffle_window = 10_000  # rows per row-shuffle window; raw text buffers it (shuffle_window*seq_len*16 bytes per process)
  d.num_workers = 0  # grain worker processes; 0 = read in the training process
  d.add_bos = True  # prepend bos_token_id to every document
  d.add_eos = True  # append eos_token_id to every document
  d.bad_records = "error"  # a .jsonl line that is not a record with text: "error" (stop, naming file:line) | "skip" (warn, leave it out)
  d.mixture = ""  # prepared dirs with weights, "DIR_A:0.7,DIR_B:0.3"; when set, `source` is ignored; "" = `source` alone
  d.packing = "concat"  # prepared dirs: "concat" (documents cut at row ends) | "best_fit" (whole documents, padded rows)
  d.best_fit_window = 1024  # best_fit: documents per packing window
  d.long_documents = "truncate"  # best_fit: a document over seq_len+1 tokens is "truncate"d | "drop"ped
  d.verify_checksums = False  # prepared dirs: check every shard's sha256 at start (reads all shards)
  d.v1_state = "refuse"  # prepared dirs: a data position saved before the bounded-memory index (zaya-global-v1): "refuse" | "restart" (data order from row 0)

  # --- train --------------------------------------------------------------------------------
  t = config.train = ml_collections.ConfigDict()
  t.seed = 0  # seed of parameter init, the training RNG key and the data order
  t.num_steps = 100_000  # optimizer steps in the whole run (defines the LR schedule's length)
  t.max_steps_per_run = 0  # leave (after a checkpoint) once this process ran this many steps; 0 = run to num_steps
  t.batch_size = 256  # sequences per step, global (over all processes)
  t.grad_accum_steps = 1  # micro-batches per step: gradients summed, activations of one micro-batch
  t.seq_len = 4096  # tokens per sequence (packed documents)
  t.lr = 3e-4  # peak learning rate, reached at the end of warmup
  t.warmup_steps = 2_000  # steps of linear warmup from 0 to lr; longer than the run: clamped to it, with a warning
  t.min_lr_ratio = 0.1  # cosine decay ends at lr * min_lr_ratio at num_steps, in [0, 1]
  t.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only, not norms/scales/biases)
  t.b1 = 0.9  # AdamW first-moment decay
  t.b2 = 0.95  # AdamW second-moment decay
  t.eps = 1e-8  # AdamW epsilon
  t.grad_clip_norm = 1.0  # clip gradients to this global L2 norm; 0 = no clipping
  # Optimizer (zaya_jax/train/optim.py). "adamw": AdamW on every parameter. "muon": Muon on the
  # hidden weight matrices (attention q/k/v/o projections, expert w_gate/w_up/w_down, one
  # orthogonalised matrix per layer and expert; router matrices with muon_router), AdamW with
  # lr / weight_decay / b1 / b2 / eps above on the rest (embeddings, norms, biases, scales,
  # conv filters, temp). The schedule shape is shared, each group scaled to its own peak lr.
  t.optimizer = "adamw"  # "adamw" | "muon"
  t.schedule = "cosine"  # "cosine": warmup, cosine to lr*min_lr_ratio | "wsd": warmup, constant, decay at the end
  t.decay_fraction = 0.2  # "wsd": fraction of num_steps at the end that decays to lr*min_lr_ratio, in [0, 1]
  t.decay_shape = "linear"  # "wsd" decay shape: "linear" | "1-sqrt" (lr falls as 1 - sqrt(fraction of decay done))
  t.muon_lr = 0.02  # Muon group's peak learning rate (with the default width scaling)
  t.muon_weight_decay = 0.0  # Muon group's decoupled weight decay, multiplied by its lr per step
  t.muon_momentum = 0.95  # Muon's Nesterov momentum decay, in [0, 1)
  t.muon_ns_steps = 5  # Newton-Schulz iterations orthogonalising each Muon update
  t.muon_router = False  # also put the router matrices (down_proj, fc1, fc2, out_proj) on Muon
  t.muon_consistent_rms = 0.0  # > 0: scale Muon updates to this RMS (0.2 ~ AdamW's, then muon_lr ~ lr); 0 = sqrt(max(1, fan_out/fan_in))
  t.router_lr_scale = 0.1  # router parameters (layers/mlp/router/*) at this multiple of their lr: a router 10x slower than the experts, which the lag-one balancing follows (README "Load balancing"); 1.0 = ZAYA1's plain recipe
  t.expert_lr_scale = 1.0  # routed experts' weights (layers/mlp/experts/w_gate, w_up, w_down) at this multiple of their lr
  t.log_every = 50  # steps between train log lines / metrics.jsonl records
  t.eval_every = 1_000  # steps between evaluations (and one at the end); 0 = only at the end
  t.eval_batches = 16  # batches of `batch_size` sequences in each evaluation
  # Fault tolerance (zaya_jax/train/loop.py). An update whose loss or gradient is not finite is
  # skipped (counted in metrics as skipped_steps); after this many in a row the run restores
  # the last checkpoint. 0 = keep skipping, never roll back.
  t.max_consecutive_skips = 10
  t.skip_data_on_rollback = True  # after a rollback, continue with the batches after the bad ones
  # Watchdog (zaya_jax/train/fault.py), on by default: from a run's second step on, a train step
  # (data fetch included), metrics fetch, stop-signal agreement, save or restore slower than
  # max(step_timeout_s, step_timeout_factor x the median step time so far) (an evaluation: x its
  # batches) dumps every thread's stack and exits 3, so the scheduler restarts the run, which
  # resumes from its last checkpoint. A hung collective, a dead host or a stuck data loader would
  # otherwise hold every device of the job until someone noticed.
  t.step_timeout_s = 600.0  # seconds; the watchdog's floor (the whole bound when step_timeout_factor = 0); 0 = watchdog off
  t.step_timeout_factor = 20.0  # multiple of the median step time a region may take (when above step_timeout_s); 0 = fixed step_timeout_s
  t.inject_nan_at_steps = ml_collections.FieldReference((), field_type=tuple)  # TEST ONLY: NaN loss/grads at these steps
  # Starting and extending runs (zaya_jax/train/init_from.py, schedule_extend.py).
  t.init_from = ""  # path; a run with no checkpoint yet starts from its weights (fresh optimizer, step 0): a run's workdir, WORKDIR/checkpoints/<step>, or an HF dir (config.json + *.safetensors); "" = random init
  t.schedule_steps = 0  # steps over which the lr schedule runs (constant final lr after); 0 = num_steps
  t.schedule_extend = "refuse"  # resuming with another num_steps that would change the lr: "refuse" (error) | "constant" (keep the old schedule, then its final lr) | "stretch" (recompute over the new num_steps)

  # --- checkpoint ---------------------------------------------------------------------------
  c = config.checkpoint = ml_collections.ConfigDict()
  c.every_steps = 1_000  # steps between checkpoints (one is always written at the end); 0 = only at the end
  c.max_to_keep = 3  # most recent checkpoints kept on disk; older ones are removed by Orbax
  c.async_save = True  # write checkpoints in a background thread (`async` is a Python keyword)

  # --- mesh: zaya_jax.parallel.mesh.MeshConfig (devices per axis; one axis may be -1) --------
  mesh = config.mesh = ml_collections.ConfigDict()
  mesh.data = 1  # pure data-parallel replicas
  mesh.fsdp = -1  # FSDP shards (params sharded on hidden dim); -1 = all remaining devices
  mesh.expert = 1  # expert-parallel shards; must divide model.num_experts
  mesh.context = 1  # context-parallel shards: every sequence split over this many devices in zigzag order (2 x context chunks of train.seq_len / (2 x context) tokens; device r holds chunks r and 2C-1-r; CCA: halo ppermutes + K/V all-gather); 2 x context must divide train.seq_len

  # --- balance: zaya_jax.config.BalanceConfig, the router balancing biases ------------------
  # Aux-loss-free balancing (zaya_jax/train/balance.py): the router picks argmax(softmax + b);
  # after every step the biases b [E+1] of each layer move from that step's global-batch
  # routing so that the next steps route evenly over the experts (target: 1/E of the
  # expert-routed tokens each). Bias units are probability units (added to the softmax).
  b = config.balance = ml_collections.ConfigDict()
  b.enabled = True  # update the biases every step; False = they keep their values
  # "quantile": every class's bias moves to the quantile of its tokens' score gaps that would
  #   have routed this step's batch evenly, for the next steps (quantile_apply) | "adamw": AdamW on the biases with gradient
  #   (routed share - 1/E) (ZAYA1-8B report) | "pid": bias += kp*e + ki*integral(e) +
  #   kd*(e - e_prev), e = 1/E - share | "sign": bias += rate*sign(e) (DeepSeek-V3)
  b.mode = "quantile"
  b.kp = 0.02  # "pid": bias per unit error per step (acts as the integral gain on the bias)
  b.ki = 0.0  # "pid": bias per unit accumulated error per step (a second integrator; keep small)
  b.kd = 0.0  # "pid": bias per unit error change per step (acts as a proportional term on the bias)
  b.integral_clamp = 1.0  # "pid" anti-windup: the accumulated error stays in [-this, this] (error-steps)
  b.rate = 1e-3  # "sign": bias change per step
  b.adamw_lr = 1e-2  # "adamw": learning rate of the biases' own AdamW (probability units per step)
  b.adamw_b1 = 0.9  # "adamw": first-moment decay
  b.adamw_b2 = 0.99  # "adamw": second-moment decay
  b.adamw_eps = 1e-8  # "adamw": epsilon of the denominator (units of a token share)
  b.adamw_weight_decay = 0.0  # "adamw": decoupled weight decay on the controlled biases
  # "quantile": "next" (default, causal) = after each step, move every class's bias by the
  #   quantile of its tokens' score gaps (read from one all-reduced histogram [L, X, 162]) that
  #   would have given it its share of this step's batch; the next steps are routed with the
  #   result, so no token's route depends on its own batch | "current" (opt-in, NOT causal)
  #   = each layer solves exact biases from the batch it routes and routes that batch with
  #   them (even to a token every step, but a token's expert then depends on later tokens and
  #   other sequences, evaluation routes differently, and the solve costs ~35 sequential
  #   all-reduces per class and sweep per layer: ~10^5 per step at ZAYA1-base scale)
  b.quantile_apply = "next"
  b.quantile_ema = 0.5  # "quantile": b <- ema*b + (1-ema)*solved each step; 0.5 halves the simultaneous step ("next": it may overshoot 2x otherwise)
  b.quantile_iters = 1  # "quantile" "next": histogram steps per train step, each one all-reduce of [L, X, 162]
  b.quantile_step = 1.0  # "quantile" "next": fraction of each histogram step taken
  b.quantile_integral = 0.0  # "quantile" "next": b += ki * (running sum of the solved shifts) on top of the EMA step (removes its lag behind a drifting router; 0.15 without quantile_reroute, README "Load balancing"); 0 = the EMA step alone
  b.quantile_reroute = True  # "quantile" "next": re-score this step's router inputs with the router after the optimizer update before the histogram step (the biases then do not lag the router's own step; the router MLP over [L, B*T, D] stored inputs, no extra collective)
  b.rate_lr_power = 0.0  # every rule: after warm-up, scale each bias update by (lr(step) / train.lr) ** this; 0 = the whole update every step (README "Load balancing")
  b.quantile_sweeps = 64  # "quantile" with "current": most coordinate sweeps of the exact solve (it stops once every class is within 1 token)
  b.exclude_layers = ()  # layer indices whose biases no rule moves (their routing is free, as with balancing off); a diagnostic, e.g. (0,)
  b.bias_clamp = 0.0  # controlled biases stay in [-this, this]; 0 = no clamp
  # Target fraction of tokens routed to the skip class; None (or < 0) = off: the skip bias
  # keeps its initial value (-1, so the skip class practically never wins).
  b.skip_target = ml_collections.FieldReference(None, field_type=float)
  b.router_z_loss = 0.0  # coefficient of the router z-loss (mean logsumexp(logits)^2) in the loss; 0 = off
  b.load_balance_loss = 0.0  # coefficient of the switch-style balance loss E*sum(f*P) in the loss; 0 = off

  return config
