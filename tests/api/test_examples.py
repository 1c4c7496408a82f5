"""The examples leave the checkout alone (results go to a temporary or given directory) and their --help is whole."""

from __future__ import annotations

import tempfile

import pytest

from tests.helpers import run_example


def test_results_go_to_a_new_temporary_directory_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp creates its directory
    run_example("train_multimodal", ["--tiny", "--steps", "1"])
    written = list(tmp_path.glob("mmsparse-train_multimodal-*/train_multimodal_tiny.json"))
    assert len(written) == 1
    assert f"numbers: {written[0]}" in capsys.readouterr().out


@pytest.mark.parametrize("name, ending", [
    ("train_multimodal", "with mmsparse attention and with dense masked SDPA."),
    ("train_varying_lengths", "under torch.compile(fullgraph=True), with no recompiles after warm-up."),
])
def test_help_describes_the_example_in_whole_sentences(name, ending, capsys):
    with pytest.raises(SystemExit) as e:
        run_example(name, ["--help"])
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    assert "".join(ending.split()) in text
    assert "(default:anewtemporarydirectory)" in text
