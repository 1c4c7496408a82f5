"""Modules and plans pickle, deepcopy and torch.save at any time, after forwards too, and run the same after."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mmsparse import CAUSAL, FULL, NONE, Topology, TritonMBSAttnKernel
from mmsparse.distributed.local import RankProblem, forward_pieces
from mmsparse.nn import MultimodalSelfAttention, replace_attention
from tests.helpers import RING

SEG = (10, 20, 18)
PAIR_TYPES = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"pickle": lambda m: pickle.loads(pickle.dumps(m)), "deepcopy": copy.deepcopy, "torch.save": _saved}


def _copies_run_the_same(make, run) -> None:
    """Each copy of a module that has run gives the output of the original, also after the original is gone."""
    module = make()
    expected = run(module)
    for name, copy_of in COPIES.items():
        twin = copy_of(module)
        assert torch.equal(run(twin), expected), f"{name}: a different output after copying"
    twin = copy.deepcopy(module)
    del module
    gc.collect()
    assert torch.equal(run(twin), expected), "the copy depended on the original's caches"


@pytest.mark.parametrize("topology", [RING, PAIR_TYPES], ids=["bits", "pair-types"])
def test_qkv_module(topology, device):
    q, k, v = (torch.randn(1, 2, 48, 16, generator=torch.Generator().manual_seed(i)).to(device) for i in range(3))
    _copies_run_the_same(lambda: TritonMBSAttnKernel(topology, SEG), lambda m: m(q, k, v))


def test_layers(device):
    x = torch.randn(2, 48, 32, generator=torch.Generator().manual_seed(0)).to(device)
    torch.manual_seed(0)
    _copies_run_the_same(lambda: MultimodalSelfAttention(32, 2, PAIR_TYPES, SEG).to(device), lambda m: m(x))

    def encoder():
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True).to(device)
        replace_attention(layer, RING, SEG, causal=True)
        return layer.eval()

    _copies_run_the_same(encoder, lambda m: m(x))


@pytest.mark.parametrize("topology", [RING, PAIR_TYPES], ids=["bits", "pair-types"])
def test_context_parallel_rank(topology, device):
    """A rank's share (the plan, its tokens and pieces) pickles after running; ContextParallel is that share."""
    gen = torch.Generator().manual_seed(0)

    def run(rank: RankProblem) -> torch.Tensor:
        pieces = rank.pieces(device)
        q = torch.randn(1, 1, rank.local_len, 16, generator=gen.manual_seed(1)).to(device)
        kv = torch.randn(1, 1, rank.gathered_positions().numel(), 16, generator=gen.manual_seed(2)).to(device)
        return forward_pieces(q, q, q, pieces, [None] * len(pieces), 0.25, 0.0, lambda: (kv, kv))[0]

    _copies_run_the_same(lambda: RankProblem(topology, SEG, 1, 2, causal=True), run)


def test_context_parallel_finds_its_group_again(tmp_path, device):
    """After unpickling, a ContextParallel over the default group runs with that group."""
    from mmsparse.distributed import ContextParallel

    owned = not dist.is_initialized()  # the README's block leaves a group of one behind in this process
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cp = ContextParallel(PAIR_TYPES, SEG)
        q = torch.randn(1, 2, cp.local_len, 16, generator=torch.Generator().manual_seed(0)).to(device)
        expected = cp.attention(q, q, q)
        for name, copy_of in COPIES.items():
            twin = copy_of(cp)
            assert twin.group is dist.group.WORLD, name
            assert torch.equal(twin.attention(q, q, q), expected), f"{name}: a different output after copying"
    finally:
        if owned:
            dist.destroy_process_group()


def test_topology_hash_is_rebuilt(tmp_path):
    """A large topology hashes its bytes, whose hash differs between processes: unpickled in another process,
    it hashes as a topology built there."""
    path = tmp_path / "topology.pkl"
    path.write_bytes(pickle.dumps(Topology(torch.eye(70, dtype=torch.int8))))
    check = ("import pickle, sys, torch; from mmsparse import Topology; "
             "t = pickle.loads(open(sys.argv[1], 'rb').read()); fresh = Topology(torch.eye(70, dtype=torch.int8)); "
             "assert t == fresh and hash(t) == hash(fresh) and {fresh: 1}[t] == 1 and not t._pair_tables")
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # another seed than this process's
    proc = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_hf_model(device):
    transformers = pytest.importorskip("transformers")
    from mmsparse.integrations import hf

    hf.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    ids = torch.randint(0, 64, (1, sum(SEG)), generator=torch.Generator().manual_seed(0)).to(device)

    def model():
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="mmsparse").to(device).eval()
        m.config.mm_topology, m.config.mm_seg_lens, m.config.mm_causal = PAIR_TYPES, SEG, False
        return m

    def run(m):
        with torch.no_grad():
            return m(ids).logits

    _copies_run_the_same(model, run)
