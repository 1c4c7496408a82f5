"""The segment-code mask of the kernels by key block from the key block's runs (mmsparse/kernels/gluon/key_runs.py):
the two-pass dK/dV kernel, the dQ writer and its ordered adds, against the float64 reference on an sm_90 GPU.

A key block whose keys meet at most ``RUN_SLOTS`` runs takes its partial steps' mask from the rows' words; one
that meets more keeps the pair-table lookup, in a loop of its own. Each mask here puts both kinds of key block in
one launch: the first 128 keys hold exactly ``RUN_SLOTS`` runs, the next 128 one more, then long segments; pair
types none, full and causal; docs that differ where the segment index repeats (a pack); the causal flag and a
window on top; keys and queries past the end of a block."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, mbs_attention, mbs_attention_varlen
from mmsparse.reference import reference_mask, reference_packed_mask
from mmsparse.tuning import use_tuning
from tests.helpers import check_outputs, make_qkv, ordered_config, spy_on_gluon_launchers, writer_config

CUDA = torch.device("cuda")
KEYS = 128  # keys a program of the kernels by key block takes
RUNS_BLOCKS_END = 31  # run_lengths' segments of its first two key blocks: 15 + 16


def run_lengths(extra: int) -> list[int]:
    """Segment lengths whose first key block holds exactly RUN_SLOTS runs and whose second holds RUN_SLOTS + 1,
    then ``extra`` tokens in segments longer than a block."""
    from mmsparse.kernels.gluon.key_runs import RUN_SLOTS  # Gluon: not in every Triton the tests collect under

    first = [8] * (RUN_SLOTS.value - 1) + [KEYS - 8 * (RUN_SLOTS.value - 1)]
    second = [8] * (RUN_SLOTS.value + 1)
    rest, left = [], extra
    while left > 0:
        rest.append(min(left, 300))
        left -= rest[-1]
    lens = first + second + rest
    assert sum(first) == KEYS and sum(second) == KEYS
    return lens


def types(k: int, seed: int) -> list[list[int]]:
    """Random pair types, the first segment causal within itself (a segment-code mask, not bits)."""
    rng = random.Random(seed)
    topology = [[rng.choice((NONE, FULL, CAUSAL, FULL)) for _ in range(k)] for _ in range(k)]
    topology[0][0] = CAUSAL
    return topology


@pytest.fixture
def by_key_calls(monkeypatch):
    """The by-key Gluon kernels that ran ("dkdv", "bwd_dq_writer")."""
    return spy_on_gluon_launchers(monkeypatch, ("dkdv", "bwd_dq_writer"))


BACKWARDS = {
    # name: (config of the head dim, deterministic, the by-key kernel that runs)
    "two-pass": (lambda d: dataclasses.replace(writer_config(d), ordered_max_keys=0, ordered_samples=0), True,
                 "dkdv"),
    "dq-writer": (writer_config, False, "bwd_dq_writer"),
    "ordered-writer": (ordered_config, True, "bwd_dq_writer"),
}


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("head_dim, causal, window, heads, kv_heads, extra", [
    (128, False, None, 4, 2, 700), (128, True, None, 2, 1, 700), (64, False, 200, 2, 2, 700),
    (64, True, None, 4, 1, 2000)])
def test_runs_and_pair_table_in_one_launch(backward, head_dim, causal, window, heads, kv_heads, extra, by_key_calls):
    """Output and all three gradients against float64 where key blocks of both kinds share a launch; past
    ``short_keys`` (2,048) keys at D=64 the dQ writer takes 128 query rows a step (its halved steps)."""
    make_config, deterministic, kernel = BACKWARDS[backward]
    lens = run_lengths(extra)
    topology = types(len(lens), seed=head_dim + heads)
    seq = sum(lens)
    q, k, v = make_qkv(1, heads, kv_heads, seq, seq, head_dim, torch.bfloat16, CUDA)
    with use_tuning(make_config(head_dim)):
        out = mbs_attention(q, k, v, topology, lens, causal=causal, window=window, deterministic=deterministic)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert kernel in by_key_calls
    check_outputs(q, k, v, out, grad_out, reference_mask(topology, lens, seq, causal=causal, window=window))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("backward", list(BACKWARDS))
def test_pack_with_doc_boundaries_inside_key_blocks(backward, by_key_calls):
    """A pack whose samples end inside key blocks, some of them short enough that a block meets more than
    RUN_SLOTS runs: a run of one segment index in another sample is another doc (no pair)."""
    make_config, deterministic, kernel = BACKWARDS[backward]
    topology = [[CAUSAL, NONE, FULL], [FULL, FULL, NONE], [FULL, CAUSAL, CAUSAL]]
    rng = random.Random(7)
    lens = [[rng.randint(1, 9), rng.choice((0, 3, 40)), rng.randint(0, 200)] for _ in range(40)]
    total = sum(map(sum, lens))
    q, k, v = make_qkv(1, 4, 2, total, total, 128, torch.bfloat16, CUDA)
    with use_tuning(make_config(128)):
        out = mbs_attention_varlen(q, k, v, topology, torch.tensor(lens, device=CUDA), causal=False,
                                   deterministic=deterministic)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert kernel in by_key_calls
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topology, lens, False))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("backward", list(BACKWARDS))
def test_runs_with_fewer_queries_empty_rows_and_a_padded_head_dim(backward, by_key_calls):
    """Both kinds of key block with fewer queries than keys (the queries are the last Sq positions: the causal pair
    types compare against their offset), a segment that sees nothing (its rows fully masked: zero output and
    gradients), a zero-length segment, D=96 (padded to 128) and GQA 4:2."""
    make_config, deterministic, kernel = BACKWARDS[backward]
    lens = run_lengths(700)
    lens.insert(RUNS_BLOCKS_END, 0)  # a zero-length segment where the two kinds of key block end
    topology = types(len(lens), seed=96)
    topology[20] = [NONE] * len(lens)  # a segment of the second key block sees no key
    seq = sum(lens)
    seq_q = seq - 100
    q, k, v = make_qkv(1, 4, 2, seq_q, seq, 96, torch.bfloat16, CUDA)
    with use_tuning(make_config(96)):
        out = mbs_attention(q, k, v, topology, lens, deterministic=deterministic)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert kernel in by_key_calls
    check_outputs(q, k, v, out, grad_out, reference_mask(topology, lens, seq, seq_q))
