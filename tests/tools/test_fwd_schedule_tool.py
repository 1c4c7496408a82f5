"""``tools.fwd_schedule``, the CPU model of the forward's launch against a persistent forward: its times on a case
worked by hand, the forward's own lists, and a run of the command."""

from __future__ import annotations

import pytest
import torch

from benchmarks.configs import ALL_CONFIGS
from benchmarks.timing import Timing
from mmsparse.attention.config import cuda_kernel_config
from tools import fwd_schedule
from tools.fwd_schedule import launched_us, static_us, tile_lengths


def test_a_case_worked_by_hand():
    """Tiles of 3, 1, 1 and 1 key blocks on 2 SMs, 1 µs a block. Launched (1 µs a start): SM 0 ends its 3 at 4,
    SM 1 its tiles at 2 and 4, the last goes to the first free at 4 and ends at 6. Static (0.5 µs a tile): program
    0 takes tiles 0 and 2 (5 µs), program 1 tiles 1 and 3 (3 µs). Dynamic: SM 1 takes the three short ones, 4.5."""
    lengths = [3, 1, 1, 1]
    assert launched_us(lengths, 2, 1.0, 1.0) == pytest.approx(6.0)
    assert static_us(lengths, 2, 1.0, 0.5) == pytest.approx(5.0)
    assert launched_us(lengths, 2, 1.0, 0.5) == pytest.approx(4.5)
    assert launched_us([], 2, 1.0, 1.0) == 0.0 and static_us([], 2, 1.0, 1.0) == 0.0


def test_the_forward_lists_in_launch_order():
    """Every (batch, query head) has the query blocks of the seed's 925 tokens at its forward tile (few keys: 15 of
    64 rows), longest list first."""
    cfg = ALL_CONFIGS["seed"]
    lengths = tile_lengths(cfg)
    tile = cuda_kernel_config(cfg.head_dim, torch.bfloat16).forward_tile(cfg.seq_k, cfg.seq_k)
    rows = -(-cfg.seq_k // tile.block_m)
    assert rows == 15
    assert len(lengths) == cfg.batch * cfg.heads_q * rows
    head = lengths[:rows]
    assert head == sorted(head, reverse=True) and lengths == head * (cfg.batch * cfg.heads_q)


def test_the_command(capsys):
    assert fwd_schedule.main(["--configs", "seed", "--sms", "8", "--start-us", "4", "--tile-us", "1"]) == 0
    out = capsys.readouterr().out
    assert "| seed | 1920 |" in out  # 8 samples x 16 heads x 15 query blocks
    with pytest.raises(SystemExit):
        fwd_schedule.main(["--configs", "seed", "--sms", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where there is no GPU")
def test_measure_without_a_gpu_says_so(capsys):
    assert fwd_schedule.main(["--configs", "seed", "--measure"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_the_fit_of_the_launch_costs():
    """A line through µs a wave against key blocks a list: 2 µs a start and 1.5 a block, and refused from one
    list length."""
    start, block = fwd_schedule.fit_costs([(1, 3.5), (2, 5.0), (4, 8.0), (8, 14.0)])
    assert start == pytest.approx(2.0) and block == pytest.approx(1.5)
    with pytest.raises(ValueError, match="two list lengths"):
        fwd_schedule.fit_costs([(2, 5.0), (2, 5.1)])


@pytest.mark.interpreter  # the CPU forward in this process; on a GPU --measure runs it at full size
def test_the_measured_points_run_the_forward():
    """On the CPU (the interpreter, the CPU tile 32x16) the packs' forward runs: a point per sample length, lists
    of 2, 4 key blocks; tokens that do not fill the samples are refused."""
    device = torch.device("cpu")
    timing = Timing(device, warmup=0, rep=0, cpu_warmup=1, cpu_reps=1)
    points = fwd_schedule.measured_points(device, 128, 1, 16, 4, (1, 2), timing)
    assert [n for n, _ in points] == [2, 4] and all(t > 0 for _, t in points)
    with pytest.raises(ValueError, match="--tokens must be a multiple"):
        fwd_schedule.measured_points(device, 100, 1, 16, 4, (1, 2), timing)
