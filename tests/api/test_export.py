"""A program exported with ``torch.export`` carries the plan it was traced under by value: loaded in a fresh
process, one that has set other settings of its own, it plans nothing and runs with the exporter's tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from mmsparse import mbs_attention
from mmsparse.tuning import KernelConfig, Tile, use_tuning
from tests.helpers import REPO, checkout_pythonpath

TOPOLOGY, LENS = [[1, 1, 0], [0, 1, 1], [1, 0, 1]], (9, 20, 11)
# Tiles no default config has, so that the loaded program's plan tells whose settings it ran with.
ODD = KernelConfig(fwd=Tile(16, 16), bwd_dkdv=Tile(16, 16), bwd_dq=Tile(16, 16), decode=Tile(16, 16))


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return mbs_attention(q, k, v, TOPOLOGY, LENS)


# The fresh process: it sets and uses other settings first (a per-process handle would now name those), then
# loads the program, records every plan made and the tiles each launch runs, and compares with the float64
# reference.
CHILD = """
import json, sys
import torch
import mmsparse
from mmsparse.attention import call
from mmsparse.tuning import KernelConfig, Tile, use_tuning
from tests.helpers import TOPOLOGY_PLACEHOLDER

path, device = sys.argv[1], torch.device(sys.argv[2])
other = KernelConfig(fwd=Tile(32, 32), bwd_dkdv=Tile(32, 32), bwd_dq=Tile(32, 32), decode=Tile(16, 32))
with use_tuning(other, short_keys=7):
    q = torch.randn(1, 1, 40, 16, device=device)
    mmsparse.mbs_attention(q, q, q, [[1]], [40])
tiles, plans = [], []
original = call.attention_plan_of
def recording(*args, **kwargs):
    plan = original(*args, **kwargs)
    tiles.append([plan.forward.tile.block_m, plan.forward.tile.block_n, plan.dkdv.tile.block_m,
                  plan.dkdv.tile.block_n])
    return plan
call.attention_plan_of = recording
call.plan_attention = lambda *args, **kwargs: plans.append(args)
program = torch.export.load(path).module()
gen = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(device) for _ in range(3))
out = program(q, k, v)
mask = mmsparse.reference_mask(TOPOLOGY, LENS, 40)
ref = mmsparse.reference_attention(q.double(), k.double(), v.double(), mask, dtype=torch.float64)
print(json.dumps({"tiles": tiles, "plans": len(plans), "max_err": (out.double() - ref).abs().max().item()}))
""".replace("from tests.helpers import TOPOLOGY_PLACEHOLDER", f"TOPOLOGY, LENS = {TOPOLOGY!r}, {LENS!r}")


def test_an_exported_program_runs_with_its_settings_in_a_fresh_process(device, tmp_path):
    q, k, v = (torch.randn(1, 2, 40, 16, device=device) for _ in range(3))
    with use_tuning(ODD, short_keys=0):
        program = torch.export.export(Attention(), (q, k, v))
    path = tmp_path / "attention.pt2"
    torch.export.save(program, path)
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath()}
    result = subprocess.run([sys.executable, "-c", CHILD, str(path), str(device)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["plans"] == 0, "the loaded program planned again"
    assert record["tiles"] == [[16, 16, 16, 16]], f"the loaded program ran other tiles: {record['tiles']}"
    assert record["max_err"] < 1e-4, record
