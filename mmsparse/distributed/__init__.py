"""Context parallelism: one multimodal sequence over the ranks of a process group, planned from the topology."""

from .context_parallel import ContextParallel
from .local import RankProblem
from .peer_memory import release_peer_memory
from .plan import ContextParallelPlan, chunk_pairs, plan_context_parallel

__all__ = ["ContextParallel", "ContextParallelPlan", "RankProblem", "chunk_pairs", "plan_context_parallel",
           "release_peer_memory"]
