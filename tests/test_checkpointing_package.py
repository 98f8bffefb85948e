"""The checkpointing package's contract (trainer/checkpointing/__init__.py): its on-disk side
imports without torch (tasks read checkpoints in light processes: validation's gather, pull,
export), and the ranks' agreement on a save in flight is read by name."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from tests.helpers import REPO
from trainer.checkpointing.async_commit import SaveFlags


def test_the_on_disk_side_imports_without_torch():
    code = (
        "import sys, trainer.checkpointing as c; "
        "print('torch' in sys.modules, sum(not n.startswith('_') for n in vars(c)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    loaded, exported = out.stdout.split()
    assert loaded == "False" and int(exported) > 30


@pytest.mark.parametrize(
    ("shares", "summed"),
    [
        # nothing in flight anywhere
        ([SaveFlags(), SaveFlags()], SaveFlags()),
        # one rank's writer still writing, the other done
        ([SaveFlags(not_done=1), SaveFlags()], SaveFlags(not_done=1)),
        # a writer died with the save pending, on one rank of three
        (
            [SaveFlags(not_done=1, writer_dead=1), SaveFlags(not_done=1), SaveFlags()],
            SaveFlags(not_done=2, writer_dead=1),
        ),
        # the coordinator's commit failed: only the coordinator knows, everyone learns it
        ([SaveFlags(commit_failed=1), SaveFlags()], SaveFlags(commit_failed=1)),
    ],
)
def test_the_ranks_agree_by_summing_their_shares(shares, summed):
    total = torch.stack([s.to_tensor() for s in shares]).sum(0)  # what all_reduce computes
    assert SaveFlags.from_tensor(total) == summed
    names = tuple(f.name for f in fields(SaveFlags))
    assert names == ("not_done", "writer_dead", "commit_running", "commit_failed")


def test_flags_of_another_length_are_refused():
    with pytest.raises(ValueError, match="save flags have 4 values, got 5"):
        SaveFlags.from_tensor(torch.zeros(5))


def test_the_process_copy_is_trusted_only_whole_and_finite():
    """The last save's snapshot (trainer.checkpointing.process_copy): what makes it unusable,
    its size, and the restore into a live state dict of the same structure."""
    from trainer.checkpointing.process_copy import ProcessCopy

    staged = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"step": torch.tensor(4)}}
    good = ProcessCopy(10, staged, {"loss": 1.5, "data_loader": {"step": 10}})
    assert good.problem() is None and good.nbytes() == 6 * 4 + 8
    assert ProcessCopy(-1, staged, good.info).problem() == "no save of a training step"
    assert "position was not recorded" in (ProcessCopy(10, staged, {}).problem() or "")
    poisoned = {"model": {"w": torch.tensor([1.0, float("nan")])}}
    assert ProcessCopy(10, poisoned, good.info).problem() == "it holds values that are not finite"
    live = {"model": {"w": torch.zeros(2, 3)}, "optim": {"step": torch.tensor(0)}}
    good.restore_into(live)
    assert torch.equal(live["model"]["w"], staged["model"]["w"])
    assert int(live["optim"]["step"]) == 4
