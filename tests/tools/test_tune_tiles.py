"""tools/tune_tiles.py on a machine without CUDA: one line that says it needs a GPU and a non-zero status, not a
traceback; ``--help`` still works, and an unknown ``--sweep`` is argparse's error."""

from __future__ import annotations

import pytest
import torch

from tools import tune_tiles


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine


def test_without_a_gpu_it_says_so_in_one_line(no_gpu, capsys):
    assert tune_tiles.main(["--sweep", "dkdv"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "needs a CUDA GPU" in err, err


def test_help_works_without_a_gpu(no_gpu, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune_tiles.main(["--help"])
    assert exit_.value.code == 0
    assert "--sweep {fwd,dkdv,dq,one_pass,none}" in " ".join(capsys.readouterr().out.split())


def test_an_unknown_sweep_is_refused(no_gpu, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune_tiles.main(["--sweep", "dkvd"])
    assert exit_.value.code == 2
    assert "invalid choice: 'dkvd'" in capsys.readouterr().err


def test_a_config_it_would_time_on_another_mask_is_refused(no_gpu, capsys):
    """Windowed and packed configs: the tool's calls take neither, so it refuses them instead of timing another mask."""
    with pytest.raises(SystemExit) as exit_:
        tune_tiles.main(["--configs", "mm13k_hub,vlm32k_window4k,pack_64k_x512"])
    assert exit_.value.code == 2
    assert "--configs vlm32k_window4k,pack_64k_x512: a sliding window or packed samples" in capsys.readouterr().err
