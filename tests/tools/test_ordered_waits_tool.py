"""``tools.ordered_waits``, the CPU model of the ordered dQ writer's waits: its times on a case worked by hand, a wait
that never ends where the ranks' groups do not follow the heads' sections (the hazard the backward's groups avoid),
and a run of the command."""

from __future__ import annotations

import pytest
import torch

from mmsparse.mask.add_order import dq_add_ranks
from mmsparse.mask.blocks import lists_from_classes
from tools import ordered_waits
from tools.ordered_waits import Launch, Timing, launch_of, modelled_us


def _lists(live_rows, full_rows):
    return lists_from_classes(torch.tensor([live_rows]), torch.tensor([full_rows]))


def test_two_programs_adding_into_one_block():
    """Two programs, one entry each in the same query block, both started at once: the second's add waits for the
    first's to land. Start 2 µs, a step 2.5, an add 2, an end 1: 7.5 µs unordered, 9.5 ordered."""
    lists = _lists([[True], [True]], [[True], [True]])
    timing = Timing(step_us=2.5, add_us=2.0, start_us=2.0, end_us=1.0)
    unordered = launch_of(lists, 1, 1, 1, sms=2, section=1, shortest_first=False, ordered=False)
    ordered = launch_of(lists, 1, 1, 1, sms=2, section=1, shortest_first=False, ordered=True)
    assert modelled_us(unordered, 2, timing) == pytest.approx(7.5)
    assert modelled_us(ordered, 2, timing) == pytest.approx(9.5)
    # a GQA group of 2 heads: each entry is two steps' matmuls
    assert modelled_us(Launch(unordered.programs, unordered.blocks, None, 2), 2, timing) == pytest.approx(10.0)


def test_rank_groups_must_follow_the_heads_sections():
    """Row A (launched first) reaches query block 0 at its second step, row B at its first. Ranked in one group, B
    adds there first; with two heads a section on two multiprocessors both heads' A run first and wait for B's,
    which cannot start: the model reports the wait that never ends. Ranked in groups of one row (two
    multiprocessors over two heads, as the backward ranks them), A adds first and every program ends."""
    lists = _lists([[True, True], [True, False]], [[False, True], [True, False]])
    a_block0 = int(lists.counts[0, 0, 2]) + 1  # A's list: its full entry (block 1) first, then block 0
    assert int(lists.indices[0, a_block0]) == 0
    assert int(dq_add_ranks(lists, 2, 2, False)[0, a_block0]) == 1  # one group: after B's
    assert int(dq_add_ranks(lists, 2, 1, False)[0, a_block0]) == 0
    good = launch_of(lists, 2, heads=2, group=1, sms=2, section=2, shortest_first=False, ordered=True)
    assert modelled_us(good, 2, Timing()) > 0
    bad = Launch(good.programs, good.blocks, dq_add_ranks(lists, 2, 2, False)[0].tolist(), 1)
    with pytest.raises(RuntimeError, match="never ended"):
        modelled_us(bad, 2, Timing())


def test_the_command_models_a_config(tmp_path, capsys):
    out = tmp_path / "waits.json"
    assert ordered_waits.main(["--configs", "seed", "--sections", "1,2", "--sms", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| seed | longest first |" in printed
    assert '"sections_2"' in out.read_text()
    with pytest.raises(SystemExit):
        ordered_waits.main(["--configs", "seed", "--sections", "0"])
