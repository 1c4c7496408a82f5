"""`python -m mmsparse`: the seed example's float64 check and exit code, drawing any topology, tile pictures."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mmsparse.__main__ as cli
from mmsparse import TritonMBSAttnKernel, generate_interlaced_mask, tile_map, tile_picture
from mmsparse.mask.blocks import classify_blocks_from_mask
from mmsparse.mask.topology import count_allowed_pairs
from mmsparse.reference import reference_attention, reference_mask, reference_packed_mask
from tests.helpers import RING

# The seed example runs fp32 through the interpreter, bf16 on a GPU.
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
TOL = cli.TOLERANCE[DTYPE]


def test_seed_example_passes_and_states_its_tolerance(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"tolerance {TOL:.0e} for {str(DTYPE)[6:]}" in out and f"ok: every error within {TOL:.0e}" in out
    assert "block mask at " in out and "density 0.270 of token pairs" in out
    tile = out.split("block mask at ", 1)[1].split(" ", 1)[0]
    if tile != "64x32":  # the README's picture is at 64x32: a demo at another tile says so, and how to draw that
        assert f"tiles: {tile}, this device's forward tile" in out and "--tile 64x32 draws that" in out


def test_seed_example_fails_on_a_wrong_kernel(monkeypatch, capsys):
    """A kernel off by 3x the tolerance exits 1: CI cannot pass a wrong kernel with exit 0."""
    # The wrong kernel: the seed's dense attention in float32 (its autograd gives the gradients), off by 3x the
    # tolerance. Dense, not the real kernels: the test above runs those through the same check, and their second
    # run here only doubled the interpreter's time.
    mask = reference_mask(cli.CYCLIC, cli.SEED_LENS, sum(cli.SEED_LENS))

    def wrong(self, q, k, v):
        out = reference_attention(q, k, v, mask.to(q.device), dtype=torch.float32).to(q.dtype)
        return out * (1 + 3 * TOL)

    monkeypatch.setattr(TritonMBSAttnKernel, "forward", wrong)
    assert cli.main([]) == 1
    captured = capsys.readouterr()
    assert "out: " in captured.out and "> tolerance" in captured.out
    assert "FAILED: out" in captured.err


def test_help_names_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "mmsparse", "--help"], capture_output=True, text=True, check=True)
    assert proc.stdout.startswith("usage: python -m mmsparse ")
    assert "--topology" in proc.stdout and "--seg-lens" in proc.stdout


def test_draws_a_user_topology_without_running(monkeypatch, capsys):
    def no_kernels(*args, **kwargs):
        raise AssertionError("drawing must not run attention")

    monkeypatch.setattr(TritonMBSAttnKernel, "forward", no_kernels)  # the drawing alone passes; attention fails it
    argv = ["--topology", "[[1,1,0],[0,1,1],[1,0,1]]", "--seg-lens", "1024,8192,4096", "--causal", "--tile", "128"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    tiles = tile_map(RING, (1024, 8192, 4096), 128, causal=True)
    counts = tiles.counts()
    assert lines[0] == (
        "topology [[1, 1, 0], [0, 1, 1], [1, 0, 1]], seg_lens (1024, 8192, 4096) (S = 13312), causal=True"
    )
    assert lines[1].startswith("block mask at 128x128 tiles, 2x2 tiles per character")
    assert all(len(line) == 52 for line in lines[2:-1]) and len(lines) == 2 + 52 + 1
    assert lines[-1] == tiles.summary()
    assert f"{counts['skipped']} skipped" in lines[-1] and sum(counts.values()) == 104 * 104
    density = count_allowed_pairs(RING, (1024, 8192, 4096), causal=True) / 13312**2
    assert f"density {density:.3f}" in lines[-1]


@pytest.mark.parametrize("argv, message", [
    (["--topology", "[[1,1],[0,1]]"], "go together"),
    (["--seg-lens", "4,5"], "go together"),
    (["--topology", "[[1,1],[0,1]", "--seg-lens", "4,5"], "nested list"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,x"], "comma-separated"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,5,6"], "2 segments"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,5", "--tile", "0"], "positive"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,5", "--tile", "big"], "128x64"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "0,0"], "nothing to draw"),
    (["--tile", "12x"], "128x64"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,5;6,7"], "add --packed"),
    (["--topology", "[[1,1],[0,1]]", "--seg-lens", "4,5;6", "--packed"], "seg_lens[1]"),
    (["--topology", "[[1,3],[0,1]]", "--seg-lens", "4,5"], "2 (causal)"),
    (["--packed"], "--packed goes with --topology"),
], ids=["topology-alone", "lens-alone", "bad-list", "bad-lens", "lens-count", "tile-0", "tile-word", "empty",
        "seed-bad-tile", "rows-unpacked", "packed-row-count", "bad-pair-type", "packed-alone"])
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


EYE40 = torch.eye(40, dtype=torch.int).tolist()  # 40 segments: past the 32 of the bit vectors
TRANSFUSION = [[2, 0, 0], [1, 1, 0], [1, 1, 2]]  # text causal, an image full, text causal over all before it


@pytest.mark.parametrize(
    "topology, lens, tile, causal",
    [(RING, (9, 21, 14), (32, 16), False), (RING, (9, 21, 14), (16, 32), True), ([[0, 1], [1, 1]], (0, 37), 8, True),
     ([[1, 0, 1], [0, 0, 1], [1, 1, 0]], (33, 0, 31), 16, False), ([[2, 0], [1, 2]], (40, 40), 16, False),
     (TRANSFUSION, (13, 30, 9), (16, 8), True), (EYE40, [4] * 40, 16, False),
     ([[2 if r == c else int(c < r) for c in range(40)] for r in range(40)], [3, 0, 5, 1] * 10, (8, 16), False)],
    ids=["hub-32x16", "hub-16x32-causal", "empty-segment-causal", "zero-length-middle", "pair-types",
         "pair-types-causal", "40-segments", "40-segments-pair-types"],
)
def test_tile_map_matches_the_dense_mask(topology, lens, tile, causal):
    """The tile classes and density from the segment boundaries equal those reduced from the dense S x S mask."""
    tiles = tile_map(topology, lens, tile, causal)
    bm, bn = (tile, tile) if isinstance(tile, int) else tile
    dense = generate_interlaced_mask(topology, lens)
    live, full = classify_blocks_from_mask(dense[None], bm, bn, causal, 0)
    assert torch.equal(tiles.live, live[0]) and torch.equal(tiles.full, full[0])
    if causal:
        dense &= torch.ones_like(dense).tril()
    assert tiles.density == dense.sum().item() / dense.numel()


def test_causal_pair_draws_its_diagonal_as_partial_tiles():
    """The newcomer's command: a CAUSAL pair's diagonal tiles are partial, the tiles below full, above skipped."""
    rows = tile_picture([[2, 0], [1, 2]], (40, 40), tile=16).splitlines()
    assert rows[1:6] == ["+....", "#+...", "##+..", "###+.", "####+"]
    assert tile_picture(EYE40, [4] * 40, tile=16).splitlines()[1:11] == [
        "." * i + "+" + "." * (9 - i) for i in range(10)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_tile_map_matches_the_dense_mask(causal):
    """Samples packed end to end see only themselves: the tiles and density of the dense packed mask."""
    rows = [(10, 20, 5), (12, 30, 0), (0, 3, 1)]
    tiles = tile_map(TRANSFUSION, rows, (16, 8), causal, packed=True)
    dense = reference_packed_mask(TRANSFUSION, rows, causal)
    live, full = classify_blocks_from_mask(dense, 16, 8, False, 0)
    assert torch.equal(tiles.live, live[0]) and torch.equal(tiles.full, full[0])
    assert tiles.seq_len == 81 and tiles.density == dense.sum().item() / 81**2
    with pytest.raises(ValueError, match="packed=True"):
        tile_map(TRANSFUSION, rows, 16)
    with pytest.raises(ValueError, match=r"seg_lens\[1\]\[2\] = -1 is negative"):
        tile_map(TRANSFUSION, [(1, 2, 3), (1, 2, -1)], 16, packed=True)


def test_draws_a_pack_of_pair_types(capsys):
    argv = ["--topology", "[[2,0,0],[1,1,0],[1,1,2]]", "--seg-lens", "10,20,5;12,30,0", "--packed", "--tile", "16"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    tiles = tile_map(TRANSFUSION, [(10, 20, 5), (12, 30, 0)], 16, packed=True)
    assert lines[0] == ("topology [[2, 0, 0], [1, 1, 0], [1, 1, 2]], packed seg_lens [(10, 20, 5), (12, 30, 0)] "
                        "(S = 77), causal=False")
    assert lines[2:-1] == tiles.picture().splitlines()[1:] and lines[-1] == tiles.summary()


def test_draws_many_segments(capsys):
    argv = ["--topology", str(EYE40), "--seg-lens", ",".join(["4"] * 40), "--tile", "16"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "topology of 40 x 40 pair types, 40 segments (S = 160), causal=False"
    assert lines[-1] == tile_map(EYE40, [4] * 40, 16).summary()


def test_picture_characters_and_downsampling():
    tiles = tile_map(RING, (9, 21, 14), (16, 16))  # 3 x 3 tiles
    rows = tiles.picture().splitlines()
    assert rows[0] == "block mask at 16x16 tiles ('#' full, '+' partial, '.' skipped):"
    expected = [["#" if f else "+" if lv else "." for lv, f in zip(lr, fr)]
                for lr, fr in zip(tiles.live.tolist(), tiles.full.tolist())]
    assert rows[1:] == ["".join(r) for r in expected]
    # width 2: 2x2 tiles per character, the ragged edge judged by the tiles it has
    small = tiles.picture(width=2).splitlines()
    assert "2x2 tiles per character" in small[0] and [len(r) for r in small[1:]] == [2, 2]
    for i in range(2):
        for j in range(2):
            live = tiles.live[2 * i : 2 * i + 2, 2 * j : 2 * j + 2]
            full = tiles.full[2 * i : 2 * i + 2, 2 * j : 2 * j + 2]
            assert small[1 + i][j] == ("#" if full.all() else "+" if live.any() else ".")
    with pytest.raises(ValueError, match="width"):
        tiles.picture(width=0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tile_map(RING, (9, 21, 14), causal="yes")


def test_large_lengths_draw_at_a_readable_width():
    text = tile_picture(RING, (20_000, 80_000, 50_000), tile=128, width=64)
    lines = text.splitlines()
    assert max(len(line) for line in lines[1:-1]) <= 64 and len(lines) <= 66
    assert lines[-1].startswith("density ")


def test_png(tmp_path):
    tiles = tile_map(RING, (9, 21, 14), 16)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            tiles.save_png(tmp_path / "t.png")
        return
    path = tiles.save_png(tmp_path / "sub" / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["--topology", str(RING), "--seg-lens", "9,21,14", "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").exists()


def test_draws_a_window(capsys):
    """--window draws the mask under a sliding window: the band's tiles only, its density counted exactly."""
    assert cli.main(["--topology", "[[1]]", "--seg-lens", "1000", "--causal", "--tile", "64", "--window", "200"]) == 0
    out = capsys.readouterr().out
    assert "window=200" in out and "density 0.180 of token pairs" in out  # sum_i min(i + 1, 200) / 1000^2
    rows = [line for line in out.splitlines() if set(line) <= set("#+.") and line]
    assert rows[-1] == "." * 11 + "++##+"  # the last query tile reaches 200 positions back, no further
    with pytest.raises(SystemExit):
        cli.main(["--window", "5"])


def test_png_without_matplotlib_fails_before_drawing(monkeypatch, tmp_path, capsys):
    """--png checks for matplotlib first: a usage error naming the fix, and no picture printed before it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(
        name, *a))
    with pytest.raises(SystemExit) as e:
        cli.main(["--topology", str(RING), "--seg-lens", "9,21,14", "--png", str(tmp_path / "c.png")])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert "--png needs matplotlib: pip install matplotlib" in captured.err and captured.out == ""
