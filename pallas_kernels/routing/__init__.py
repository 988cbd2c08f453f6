"""Top-1 routing + stable grouping of tokens by class (Pallas, Triton lowering).

`route(logits_MX, balancing_biases_X) -> Routing` replaces the softmax/bias/argmax/gate tail
of `zaya_jax.model.router.Router` and the argsort + bincount of `LocalDispatch`.
"""

from pallas_kernels.routing.ops import RoutingBlockSizes, permute, route, unpermute
from pallas_kernels.routing.reference import Routing, route_reference

__all__ = ["Routing", "RoutingBlockSizes", "permute", "route", "route_reference", "unpermute"]
