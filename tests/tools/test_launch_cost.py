"""tools.launch_cost: a step's direct launches captured, each replayed with its tensors and with their addresses, and a
one-line refusal where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from mmsparse.runtime import launch
from tools import launch_cost


class _RecordingKernel:
    """A compiled kernel's stand-in: its launcher records the runtime arguments it is called with."""

    function, packed_metadata, name = 7, None, "recording"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, *args) -> None:
        self.calls.append(args[9:])  # after the grid, stream, function, metadata and hooks


def test_each_captured_launch_is_replayed_with_tensors_and_with_addresses(monkeypatch):
    monkeypatch.setattr(launch, "_current_stream", lambda device: 0)
    kernel, a, b = _RecordingKernel(), torch.zeros(4), torch.zeros(2, dtype=torch.int32)
    args = (a, 5, b)
    entry = (kernel, (), None, launch._pointer_positions(args))
    captured = launch_cost.capture(lambda: launch._run_direct(entry, (1, 1, 1), 0, args))
    assert launch._run_direct.__name__ == "_run_direct"  # put back after the step
    assert [c[:4] for c in captured] == [(entry, (1, 1, 1), 0, args)] and len(kernel.calls) == 1
    rows = launch_cost.replay_costs(captured, reps=20, rounds=2, sync=lambda: None)
    assert [(r["kernel"], r["pointers"], r["descriptors"]) for r in rows] == [("recording", 2, 0)]
    assert all(r[key] > 0 for r in rows for key in ("tensors_us", "addresses_us"))
    forms = {tuple(type(x) for x in call) for call in kernel.calls[1:]}
    assert forms == {(torch.Tensor, int, torch.Tensor), (int, int, int)}
    assert (a.data_ptr(), 5, b.data_ptr()) in kernel.calls
    table = launch_cost.markdown({"shape": "seed", "reps": 20, "rounds": 2, "gpu": "g", "torch": "t", "triton": "x",
                                  "commit": "c", "rows": rows})
    assert "| recording | 2 | 0 |" in table and "1 launches a step" in table


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    assert launch_cost.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
