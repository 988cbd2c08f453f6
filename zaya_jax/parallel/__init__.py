"""Device meshes, logical-axis sharding rules, and expert-parallel token dispatch."""
