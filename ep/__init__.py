"""onegemm.ep: expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPU).

ep_moe_ffn (moe_ffn with this rank's share of the experts) and EPMoEFFN (the sharded
MoEFFN layer), in moe.py; the collectives with gradients in comm.py. docs/ep.md says how
the two strategies work and when "auto" takes which.
"""

from .moe import ALLGATHER_MAX_TOKENS, STRATEGIES, EPMoEFFN, choose_strategy, ep_moe_ffn

# The top-level API; the strategy constants and choose_strategy stay under onegemm.ep.
__all__ = ["ep_moe_ffn", "EPMoEFFN"]
