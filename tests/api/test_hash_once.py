"""Plans, tiles and configs hashed once per object (runtime/hash_once.py): the kept hash is the hash of the fields'
values, as a frozen dataclass's own; equal values hash alike; and the kept hash never leaves the process (a
string's hash differs from one process to the next), so an unpickled plan finds its launches by value."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys

import torch

from mmsparse.attention.call import frozen_plan
from mmsparse.attention.config import Settings, Tile, kernel_config
from mmsparse.attention.plan import AttentionPlan, BackwardPass, CallPlan, ForwardPass, plan_attention
from mmsparse.mask.build import build_mask_info

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]


def _objects() -> list:
    cfg = kernel_config(64, torch.float32, torch.device("cpu"))
    plan = plan_attention(cfg, 2, 4, 2, 96, 96, torch.device("cpu"))
    info = build_mask_info(CYCLIC, (24, 40, 32), 96, 96, False, torch.device("cpu"))
    objects = [cfg, plan, plan.forward, plan.dkdv, frozen_plan(plan, info, cfg, False), Settings(),
               Tile(64, 32, turns="named_release")]
    assert {type(o) for o in objects} >= {AttentionPlan, BackwardPass, CallPlan, ForwardPass, Settings, Tile}
    return objects


def _field_hash(obj) -> int:
    return hash(tuple(getattr(obj, f.name) for f in dataclasses.fields(obj)))


def test_the_kept_hash_is_the_fields_hash_and_equal_values_hash_alike():
    for obj in _objects():
        assert hash(obj) == _field_hash(obj) == hash(obj)  # the second hash is the kept one
        twin = dataclasses.replace(obj)
        assert twin is not obj and twin == obj and hash(twin) == hash(obj)
        assert {obj: 1}[twin] == 1


def test_copies_and_pickles_carry_no_kept_hash():
    for obj in _objects():
        hash(obj)
        for made in (copy.copy(obj), copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))):
            assert made == obj and hash(made) == hash(obj)
        assert b"_kept_hash" not in pickle.dumps(obj)


def test_a_plan_pickled_in_another_process_hashes_as_this_process_hashes_it():
    """Tile.turns is a string: its hash is another one in a process of another hash seed."""
    tile = Tile(64, 32, turns="named_release")
    code = ("import pickle, sys; from mmsparse.attention.config import Tile; t = Tile(64, 32, turns='named_release');"
            " hash(t); sys.stdout.buffer.write(pickle.dumps(t))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    made = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    loaded = pickle.loads(made)
    assert loaded == tile and hash(loaded) == _field_hash(tile) == hash(tile)
