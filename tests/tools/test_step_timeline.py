"""The step timeline tool (tools/step_timeline.py): a CPU run writes the middle step's ops, nested, and a GPU-only
mode is refused with the reason."""

from __future__ import annotations

import pytest

from tools import step_timeline


@pytest.mark.interpreter  # the CPU run; on a GPU the timeline also holds the kernels
def test_a_cpu_run_writes_the_middle_steps_ops(tmp_path, capsys):
    assert step_timeline.main(["--step", "seed", "--device", "cpu", "--warmup", "1", "--steps", "3",
                               "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "step_timeline_seed.txt").read_text().splitlines()
    names = [line.split(maxsplit=4)[4].strip() for line in lines]
    assert names[0] == "STEP1" and "STEP0" not in names and "STEP2" not in names  # the middle step only
    starts = [float(line.split()[0]) for line in lines]
    assert starts[0] == 0.0 and starts == sorted(starts)  # relative to the step's start, in order

    def level(line: str) -> int:  # the indent after the thread column ("th" and 6 characters)
        rest = line[line.index(" th") + 9:]
        return len(rest) - len(rest.lstrip())

    function = next(line for line in lines if line.endswith("MBSAttentionFunction"))
    assert level(function) > level(lines[0])  # nested inside the step
    assert any(name.startswith("aten::") for name in names)
    assert "host_us" in capsys.readouterr().out


def test_compiled_modes_are_refused_off_the_gpu(tmp_path):
    with pytest.raises(SystemExit, match="runs on a GPU only"):
        step_timeline.main(["--step", "block", "--mode", "compile", "--device", "cpu", "--out", str(tmp_path)])
