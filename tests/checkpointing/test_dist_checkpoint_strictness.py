"""`--dist-ckpt-strictness` (Megatron-LM's `StrictHandling`) on torch_dist checkpoints: a
pretrained tiny LLaMA-style model (2 iterations, saved) goes on with one multi-token
prediction module added, as a user extends a checkpoint (issue 57).

- By default (assume_ok_unexpected) the load ends in one line naming the first tensor the
  checkpoint lacks, and the flag that keeps this model's values; nothing is written.
- With `log_all` the run lists what it lacks (the MTP module's tensors), keeps their fresh
  values, loads the rest: its first 'lm loss' is the one a run resumed without MTP logs (the
  main model's forward is the same), and it logs 'mtp_1 loss'.
- The MTP run's checkpoint loaded by the model without MTP: `log_unexpected` lists the extra
  tensors and goes on; `raise_unexpected` ends in one line naming the first.
"""

from __future__ import annotations

import os

import pytest

from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.one_line_errors import assert_one_line_error
from tests.training.llama_runs import argv

FLAGS = dict(global_batch_size=4, ckpt_format="torch_dist", make_vocab_size_divisible_by=64)
MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1)


def _run(dataset: str, **flags: object):
    """One process; a loading run takes the checkpoint's schedule (its run was shorter)."""
    if "load" in flags:
        flags["use_checkpoint_lr_scheduler"] = True
    return _launch("torchrun", argv(dataset, **FLAGS, **flags), ranks=1)


@pytest.mark.slow
def test_strictness_when_the_checkpoint_and_the_model_differ(stdlib_dataset, tmp_path) -> None:
    pretrained, extended = str(tmp_path / "pretrained"), str(tmp_path / "extended")
    first = _run(stdlib_dataset, train_iters=2, save=pretrained, save_interval=2)
    assert first.returncode == 0, first.stdout[-3000:]

    refused = _run(
        stdlib_dataset, train_iters=3, load=pretrained, save=extended, save_interval=3, **MTP
    )
    assert_one_line_error(
        refused.returncode,
        refused.stderr or refused.stdout,
        "has no tensor mtp.layers.0.",
    )
    assert "--dist-ckpt-strictness log_all" in (refused.stderr or refused.stdout)
    assert not os.path.exists(os.path.join(extended, "iter_0000003"))

    plain = _run(stdlib_dataset, train_iters=3, load=pretrained)
    assert plain.returncode == 0, plain.stdout[-3000:]
    logged = _run(
        stdlib_dataset, train_iters=3, load=pretrained, save=extended, save_interval=3,
        dist_ckpt_strictness="log_all", **MTP,
    )  # fmt: skip
    assert logged.returncode == 0, logged.stdout[-3000:]
    assert "lacks" in logged.stdout and "mtp.layers.0.eh_proj.weight" in logged.stdout
    (with_mtp,), (without,) = _iteration_lines(logged.stdout), _iteration_lines(plain.stdout)
    assert with_mtp["iteration"] == without["iteration"] == 3
    assert with_mtp["lm loss"] == without["lm loss"] and "mtp_1 loss" in with_mtp

    listed = _run(
        stdlib_dataset, train_iters=4, load=extended, dist_ckpt_strictness="log_unexpected"
    )
    assert listed.returncode == 0, listed.stdout[-3000:]
    assert "tensors this model has not, ignored" in listed.stdout
    assert "mtp.layers.0.eh_proj.weight" in listed.stdout
    raised = _run(
        stdlib_dataset, train_iters=4, load=extended, dist_ckpt_strictness="raise_unexpected"
    )
    assert_one_line_error(
        raised.returncode, raised.stderr or raised.stdout, "tensors this model has not"
    )
