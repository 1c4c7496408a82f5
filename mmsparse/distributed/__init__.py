"""Context parallelism: one multimodal sequence over the ranks of a process group, planned from the topology."""

from .plan import ContextParallelPlan, chunk_pairs, plan_context_parallel

__all__ = ["ContextParallelPlan", "chunk_pairs", "plan_context_parallel"]
