"""ContextParallel: one multimodal sequence over the ranks of a process group.

    cp = ContextParallel(topology, seg_lens, causal=False, group=None, window=None)  # group: ProcessGroup/DeviceMesh
    ids_l = cp.shard(input_ids, seq_dim=1)     # this rank's tokens of any tensor with a sequence dim
    o_l = cp.attention(q_l, k_l, v_l)          # [B, Hq, S_local, D], differentiable in q_l, k_l, v_l
    o = cp.unshard(o_l, seq_dim=2)             # the whole sequence on every rank, differentiable

Which tokens a rank holds is the plan's choice (:mod:`.plan`): chunks balanced by live pairs. ``shard`` and
``unshard`` hide it. The attention fetches the K/V chunks its queries see from their owners (:mod:`.exchange`:
point to point, or copies straight out of the peers' memory on GPUs of one host),
runs the pieces of :mod:`.pieces` (those over its own chunks while the fetch is in flight; :mod:`.local` builds
and runs them, for any rank), and merges them by log-sum-exp in a fixed order; the backward sends each dK/dV
contribution to the chunk's owner, which sums them in a fixed order (its own while the peers' are in flight,
then the peers' in rank order): deterministic, no atomics. Only O(S / P) state
is saved per rank where the sequence is long: fetched K/V is fetched again in the backward there; below
:data:`KEEP_FETCHED_MAX_BYTES` of gathered K/V a call keeps it for the backward (``keep_fetched_kv``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..attention.config import current_settings
from ..attention.dropout import new_dropout_seed
from ..attention.first_order import first_order_gradients
from ..checks import check_dropout, check_qkv, check_softmax_scale, count
from .exchange import TRANSPORTS, return_kv_grads, start_fetch, start_return
from .fetch import Fetch
from .local import RankProblem, backward_pieces, check_causal, forward_pieces
from .one_thread import one_thread_on
from .pieces import PiecesCall, piece_seeds

# The most gathered K/V (the largest rank's, one call) that ``keep_fetched_kv="auto"`` holds from forward to
# backward. At 43k tokens on 4 H200s (168 MiB) keeping it makes the step 1.18x faster, on 2 1.02x; at 256k (500 MiB)
# the attention hides the second fetch and keeping gains nothing (benchmarks/results/h200/cp_nccl.md).
KEEP_FETCHED_MAX_BYTES = 256 * 2**20


class ContextParallel(RankProblem):
    """Context parallelism for one topology and set of lengths over a process group.

    Args:
        topology: k x k pair types ``NONE``/``FULL``/``CAUSAL`` (0/1/2), any number of segments, or a
            :class:`~mmsparse.Topology`, as for ``mbs_attention``.
        seg_lens: k lengths, or ``[B, k]`` per sample (a sample's tail past its total is padding).
        causal: the global causal flag.
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (the context-parallel dim of a larger mesh: pass
            ``mesh["cp"]``), or None for the default group.
        chunk: tokens per chunk (default: the plan's, about 16 chunks a rank).
        window: a sliding window, as in ``mbs_attention`` (key position > query position - window): a rank
            fetches and runs only the key chunks its queries' windows reach.
        keep_fetched_kv: keep the K/V fetched in the forward until the backward instead of fetching it again
            there: one exchange fewer per step, for the gathered keys' memory (``[B, 2 Hkv, S_gathered, D]`` per
            call, up to the whole sequence's K/V) held from forward to backward. ``"auto"`` (default) keeps it
            where the largest rank's gathered K/V of the call is at most :data:`KEEP_FETCHED_MAX_BYTES` (256
            MiB), where the exchange, not the attention, bounds the step (tens of thousands of tokens: at 43k on
            4 H200s the step is 1.18x faster kept); past it the attention hides the second fetch and the saved
            state stays O(S / P). True or False decides alone.
        transport: how the exchange moves K/V and dK/dV: ``"p2p"``, the group's point to point (NCCL, gloo);
            ``"peer_copy"``, each rank copying what it needs straight out of its peers' memory (CUDA IPC and copy
            engines between the GPUs of one host, no SMs; shared memory between CPU processes of one host), which
            keeps two slots a rank, as large as the largest exchange it has run, until ``release_peer_memory``
            (a collective); ``"auto"``
            (default): ``peer_copy`` on GPUs that reach each other where a slot stays within 128 MiB, else
            ``p2p``. Both move the same bytes and give the same bits.
    """

    def __init__(self, topology: Any, seg_lens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
                 causal: bool = False, group: Any = None, chunk: int | None = None,
                 window: int | None = None, keep_fetched_kv: bool | str = "auto",
                 transport: str = "auto") -> None:
        check_causal(causal)
        if not isinstance(keep_fetched_kv, bool) and keep_fetched_kv != "auto":
            raise TypeError(f"keep_fetched_kv must be True, False or 'auto'; got {keep_fetched_kv!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; got {transport!r}")
        self.keep_fetched_kv, self.transport = keep_fetched_kv, transport
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed initialised (init_process_group) first")
        self._group = _process_group(group)
        # The plan, tokens and pieces of this rank: RankProblem builds them for any rank, without a group.
        super().__init__(topology, seg_lens, dist.get_rank(self._group), dist.get_world_size(self._group), causal,
                         chunk, window=window)
        # Bytes this rank has sent and received point to point (K/V fetches, dK/dV returns), so that a benchmark
        # can hold them against the plan's prediction.
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def group(self) -> Any:
        """The process group. After unpickling, the default group when this one spanned all of its ranks;
        any other group must be given again (``cp.group = group``): a process group does not pickle."""
        if self._group is None:
            self._group = _group_of_ranks(self._group_ranks)
        return self._group

    @group.setter
    def group(self, group: Any) -> None:
        group = _process_group(group)
        if dist.get_world_size(group) != self.world_size:
            raise ValueError(f"this ContextParallel is planned for {self.world_size} ranks; the group has "
                             f"{dist.get_world_size(group)}")
        self._group = group

    def __getstate__(self) -> dict[str, Any]:
        # A process group does not pickle: keep its global ranks and find the group again on first use.
        state = super().__getstate__()
        state["_group_ranks"] = dist.get_process_group_ranks(self._group) if self._group is not None else (
            state.get("_group_ranks"))
        state["_group"] = None
        return state

    def keeps_fetched_kv(self, k: torch.Tensor) -> bool:
        """Whether a call on keys like ``k`` (this rank's, ``[B, Hkv, S_local, D]``) keeps its fetched K/V for the
        backward. Every rank answers alike, or a rank would wait in a fetch that its peers skip: the rule reads
        the largest rank's gathered K/V, never this rank's own."""
        if self.keep_fetched_kv != "auto":
            return self.keep_fetched_kv
        return self.most_gathered_kv_bytes(k) <= KEEP_FETCHED_MAX_BYTES

    def shard(self, x: torch.Tensor, seq_dim: int = 2) -> torch.Tensor:
        """This rank's tokens of ``x``, a tensor whose dim ``seq_dim`` is the whole sequence (every rank holds
        the same ``x``): differentiable, a gather along that dim."""
        seq_dim = _checked_dim("x", x, seq_dim)
        if x.shape[seq_dim] != self.seq_len:
            raise ValueError(f"x has {x.shape[seq_dim]} positions along dim {seq_dim}; expected the whole sequence "
                             f"({self.seq_len}) to shard")
        return x.index_select(seq_dim, self._index.to(x.device))

    def unshard(self, x_local: torch.Tensor, seq_dim: int = 2) -> torch.Tensor:
        """The whole sequence from every rank's shard, on every rank, in sequence order; differentiable (the
        gradient of each rank's copy flows back to the rank that holds the token, summed over ranks)."""
        seq_dim = _checked_dim("x_local", x_local, seq_dim)
        if x_local.shape[seq_dim] != self.local_len:
            raise ValueError(f"x_local has {x_local.shape[seq_dim]} positions along dim {seq_dim}; this rank holds "
                             f"{self.local_len}")
        return _Unshard.apply(x_local, seq_dim, self)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  softmax_scale: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries over every key its topology lets them see. Its backward is always the
        deterministic two-pass one: ``deterministic=False`` and ``use_config(deterministic=False)`` do not reach
        the pieces (their dK/dV are summed by the owners in a fixed order, and dQ stays bitwise repeatable too).

        Args:
            q: ``[B, Hq, S_local, D]``; k, v: ``[B, Hkv, S_local, D]``: this rank's tokens (from ``shard``).
        Returns:
            ``[B, Hq, S_local, D]``.
        """
        dropout_p = check_dropout(dropout_p, "dropout_p")
        check_qkv(q, k, v)  # as mbs_attention checks them: types, dtypes, head dims, GQA groups
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[2] != self.local_len:
                raise ValueError(f"{name} must be [B, H, S_local={self.local_len}, D] (this rank's tokens); got "
                                 f"{tuple(t.shape)}")
        if self._lens.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"seg_lens has {count(self._lens.shape[0], 'row')} but the batch has "
                             f"{count(q.shape[0], 'sample')}")
        softmax_scale = check_softmax_scale(softmax_scale)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        with one_thread_on(self.group):
            seed = None
            if dropout_p > 0:  # drawn as a single-GPU call draws it, and rank 0's for all: one mask over the ranks
                seed = new_dropout_seed(q.device)
                dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
            return _Attention.apply(q, k, v, self, scale, dropout_p, seed)

    def fetch_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exchange of the attention alone, for timing it: the K and V of every chunk this rank's queries see,
        fetched from their owners point to point (this rank serving its own to the others), in the order of
        ``gathered_chunks()`` (``gathered_positions()`` gives their positions).

        Args:
            k, v: ``[B, Hkv, S_local, D]``, this rank's tokens. Every rank of the group must call it.
        Returns:
            ``(k_gathered, v_gathered)``, ``[B, Hkv, S_gathered, D]`` each.
        """
        with one_thread_on(self.group):
            return start_fetch(self, k, v)()

    def return_kv_grads(self, dkv_gathered: torch.Tensor, dkv_local: torch.Tensor | None) -> torch.Tensor:
        """The backward's return of dK/dV alone, for timing it: each fetched chunk's gradient goes to its owner,
        which sums the contributions to its chunks in float32, its own first, then the peers' in rank order.

        Args:
            dkv_gathered: ``[B, 2 Hkv, S_gathered, D]`` (K's heads, then V's) of the fetched keys, in
                ``kv_grad_dtype(dtype)`` as the attention's backward has it: the inputs' dtype where the rank's
                attention is one piece (then sent as it is), else float32;
            dkv_local: float32 ``[B, 2 Hkv, S_local, D]`` of this rank's own keys, or None (no piece reads
                them). Every rank must call it, with the same dtype.
        Returns:
            The summed dK/dV of this rank's keys, float32 ``[B, 2 Hkv, S_local, D]``.
        """
        with one_thread_on(self.group):
            return return_kv_grads(self, dkv_gathered, dkv_local, self.kv_grad_dtype(dkv_gathered.dtype))


def _checked_dim(name: str, x: Any, dim: Any) -> int:
    """``dim`` as a non-negative dim of the tensor ``x``, or a TypeError/ValueError that names ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"seq_dim must be an int (the dim of {name} that holds the sequence); got "
                        f"{type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"seq_dim {dim} is not a dim of {name}, which has shape {tuple(x.shape)}")
    return dim % x.dim()


def _process_group(group: Any) -> Any:
    if group is None:
        return dist.group.WORLD
    get_group = getattr(group, "get_group", None)  # a DeviceMesh
    if get_group is not None:
        if group.ndim != 1:
            raise ValueError(f"pass the context-parallel dim of the mesh (mesh['cp']), not a {group.ndim}-D mesh")
        return get_group()
    return group


def _group_of_ranks(ranks: list[int]) -> Any:
    """The process group over these global ranks in this process: the default group when they are all of it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ContextParallel needs torch.distributed initialised (init_process_group) first")
    if list(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    raise RuntimeError(f"this ContextParallel was unpickled from a process group over the ranks {list(ranks)}, not "
                       "the default group: give it that group again with cp.group = group")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, scale: float, dropout_p: float,  # type: ignore[override]
                seed: torch.Tensor | None):
        pieces = cp.pieces(q.device, by_position=seed is not None)
        seeds = [None] * len(pieces) if seed is None else piece_seeds(pieces, seed)
        finish, fetched = start_fetch(cp, k, v, seed is not None), []

        def gather() -> tuple[torch.Tensor, torch.Tensor]:
            fetched.extend(finish())
            return fetched[0], fetched[1]

        # The settings are read once, here, and the pieces' launches kept, for the backward (ctx.call).
        call = PiecesCall(current_settings())
        # The pieces over this rank's own keys run while the exchange is in flight; the others after it.
        out, lse = forward_pieces(q, k, v, pieces, seeds, scale, dropout_p, gather, call)
        ctx.save_for_backward(q, k, v, out, lse, *(fetched if cp.keeps_fetched_kv(k) else ()))
        ctx.cp, ctx.scale, ctx.dropout_p, ctx.pieces, ctx.seeds = cp, scale, dropout_p, pieces, seeds
        ctx.by_position = seed is not None
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        with one_thread_on(ctx.cp.group):
            return _Attention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse, *fetched = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        # Fetched again unless the forward kept it (its state is then O(S / P)).
        finish = (lambda: tuple(fetched)) if fetched else start_fetch(cp, k, v, ctx.by_position)
        returned: list[Callable[[], torch.Tensor]] = []

        def start(dkv_l: torch.Tensor | None, dkv_g: torch.Tensor) -> None:
            # summed in float32 and written in the inputs' dtype in the sum's last pass
            returned.append(start_return(cp, dkv_g, dkv_l, cp.kv_grad_dtype(k.dtype, ctx.by_position),
                                         ctx.by_position, k.dtype if k.dtype == v.dtype else torch.float32))

        # A one-piece rank starts the return once its dK/dV pass is queued: the transfer runs beside its dQ pass.
        # A fetch by peer copies lets the dK/dV pass start on the rank's own keys while the others land.
        arriving = finish.arriving if isinstance(finish, Fetch) else None
        dq, _, _ = backward_pieces(grad_out, q, k, v, out, lse, ctx.pieces, ctx.seeds, ctx.scale, ctx.dropout_p,
                                   finish, ctx.call, on_kv_grads=start, arriving=arriving)
        dkv = returned[0]()
        hkv = k.shape[1]
        grads = first_order_gradients("ContextParallel.attention", (
            dq.to(q.dtype), dkv[:, :hkv].to(k.dtype), dkv[:, hkv:].to(v.dtype)), grad_out, q, k, v)
        return *grads, None, None, None, None


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, seq_dim: int, cp: ContextParallel):  # type: ignore[override]
        ctx.seq_dim, ctx.cp = seq_dim, cp
        with one_thread_on(cp.group):
            return _Unshard._gather(x_local, seq_dim, cp)

    @staticmethod
    def _gather(x_local: torch.Tensor, seq_dim: int, cp: ContextParallel) -> torch.Tensor:
        moved = x_local.movedim(seq_dim, 0).contiguous()
        longest = max(len(cp.plan.token_index(r)) for r in range(cp.world_size))
        padded = moved.new_zeros((longest, *moved.shape[1:]))
        padded[: moved.shape[0]] = moved
        shards = [torch.empty_like(padded) for _ in range(cp.world_size)]
        dist.all_gather(shards, padded, group=cp.group)
        full = moved.new_empty((cp.seq_len, *moved.shape[1:]))
        for r, shard in enumerate(shards):
            index = cp.plan.token_index(r).to(full.device)
            full[index] = shard[: index.numel()]
        return full.movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cp: ContextParallel = ctx.cp
        moved = grad.movedim(ctx.seq_dim, 0).contiguous()
        total = moved.clone()
        with one_thread_on(cp.group):
            dist.all_reduce(total, group=cp.group)  # every rank's use of every token
        local = total[cp._index.to(total.device)]
        return *first_order_gradients("ContextParallel.unshard", (local.movedim(0, ctx.seq_dim),), grad), None, None
