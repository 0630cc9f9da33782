"""onegemm.ep: expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPU).

ep_moe_ffn (moe_ffn with this rank's share of the experts), EPMoEFFN (the sharded MoEFFN
layer) and the all-to-all halves dispatch / combine, in moe.py; the collectives with
gradients in comm.py. docs/ep.md says how the two strategies work and when "auto" takes which.
"""

from .moe import (ALLGATHER_MAX_TOKENS, STRATEGIES, Dispatched, EPMoEFFN, choose_strategy, combine, dispatch,
                  ep_moe_ffn)

# The top-level API; dispatch / combine (the all-to-all halves, for experts of your own), the
# strategy constants and choose_strategy stay under onegemm.ep.
__all__ = ["ep_moe_ffn", "EPMoEFFN"]
