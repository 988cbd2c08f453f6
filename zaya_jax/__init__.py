"""zaya-jax: a JAX/Flax NNX training stack for ZAYA1 (arXiv 2511.17127).

Shape letters used in names (`x_BTD`), einsum strings and docstrings (`[B, T, D]`):

| letter | meaning                              | letter | meaning                                   |
|--------|--------------------------------------|--------|-------------------------------------------|
| B      | batch                                | E      | routed experts (16 in ZAYA1-base)         |
| T      | query positions                      | X      | router classes E+1 (last = skip)          |
| S      | key/value positions                  | F      | expert intermediate size                  |
| D      | hidden_size                          | R      | router_hidden_size                        |
| V      | vocab                                | M      | flattened tokens B*T                      |
| N      | query heads (spec Hq)                | L      | stacked layers                            |
| K      | kv heads (spec Hkv)                  | C      | CCA conv channels (N+K)*H                 |
| G      | query heads per kv head, N/K         | J      | CCA conv groups N+K (one per head)        |
| H      | head_dim (spec dh)                   | W      | conv width (cca_time0 / cca_time1)        |
"""
