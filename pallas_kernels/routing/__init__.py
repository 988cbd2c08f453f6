"""Top-1 routing + stable grouping of tokens by class (Pallas, Triton lowering).

`route(logits_MX, balancing_biases_X) -> Routing` replaces the softmax/bias/argmax/gate tail
of the ZAYA1 router and the argsort + bincount of the MoE's local dispatch. `top1` (in
reference.py) is the one definition of the top-1 rule; `zaya_jax.ops.route` uses it.
"""

from pallas_kernels.routing.ops import RoutingBlockSizes, permute, route, unpermute
from pallas_kernels.routing.reference import Routing, gate_of, route_reference, top1

__all__ = ["Routing", "RoutingBlockSizes", "gate_of", "permute", "route", "route_reference", "top1",
           "unpermute"]
