"""`launch.train` overrides shared by the CLI tests: a 2-layer model (one sliding layer, 4
experts) small enough that each subprocess compiles and trains in seconds."""

MODEL_OVERRIDES = [
    "--config.model.hidden_size=32",
    "--config.model.num_layers=2",
    "--config.model.layer_types=('hybrid','hybrid_sliding')",
    "--config.model.sliding_window=8",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=16",
    "--config.model.num_experts=4",
    "--config.model.moe_intermediate_size=32",
    "--config.model.router_hidden_size=16",
]
