"""`--ckpt-format torch_dist` (torch.distributed.checkpoint): a checkpoint saved at one parallel
layout resumes at others with the optimizer state kept.

The tiny LLaMA-style model of `llama_runs` (SwiGLU, 2 key/value heads, untied output layer),
fp32, dropout 0, global batch 8, the vocabulary padded to 50304 rows at TP 1 and 2. A TP=2 run
saves at iterations 3 and 6 in the background (`--async-save`) and is killed committing 6's
(before its directory is renamed into place): 3's is the newest checkpoint. From it:

- at the same layout, iterations 4-6 are the run's bit for bit (weights, Adam's moments and
  step, scheduler, random generators, data position);
- at PP=2 (each stage one layer) and at TP=1 x DP=2 they are the same up to fp32 sums in
  other orders;
- at DP=4 sharded by FSDP2 (its shards gathered per tensor-parallel rank on saving) iteration
  4 is, and its own torch_dist checkpoint resumes with the distributed optimizer at DP=2 for
  iterations 5-6;
- with `--no-load-optim` the losses after the first update differ: Adam's state mattered;
- `--ckpt-convert-format torch` at TP=1 (one process) writes Megatron's per-rank files, and
  `--ckpt-convert-format torch_dist` from those gives back the saved tensors bit for bit
  (weights, Adam's moments and step): both conversions keep the optimizer state;
- a torn shard file (cut short) ends a resume in one line naming it, before anything loads.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron.checkpointing.commit import FAULT_ENV
from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.one_line_errors import assert_one_line_error
from tests.pretrain_runs import launch
from tests.training.llama_runs import argv, assert_same, run

FLAGS = dict(global_batch_size=8, make_vocab_size_divisible_by=64, ckpt_format="torch_dist")


def _losses(logs: list[dict]) -> list[tuple[float, float]]:
    return [(log["lm loss"], log["grad norm"]) for log in logs]


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_at_other_layouts_with_its_optimizer(
    stdlib_dataset: str, tmp_path
) -> None:
    tp2 = dict(tensor_model_parallel_size=2)
    saved = str(tmp_path / "tp2")
    # Saves in the background at 3 and 6; rank 0 is killed committing 6's (before its rename).
    killed = _launch(
        "torchrun",
        argv(stdlib_dataset, save=saved, save_interval=3, async_save=True, **tp2, **FLAGS),
        env={FAULT_ENV: "before-rename:2"},
    )
    assert killed.returncode != 0
    straight = _iteration_lines(killed.stdout)
    assert [log["iteration"] for log in straight] == [1, 2, 3, 4, 5, 6], killed.stdout[-3000:]
    assert os.path.isfile(os.path.join(saved, "iter_0000003", ".metadata"))
    assert os.path.isfile(os.path.join(saved, "iter_0000003", "common.pt"))
    assert not os.path.exists(os.path.join(saved, "iter_0000006"))  # never published
    with open(os.path.join(saved, "latest_checkpointed_iteration.txt")) as tracker:
        assert tracker.read().strip() == "3"

    same = run(stdlib_dataset, 2, load=saved, **tp2, **FLAGS)
    assert _losses(same) == _losses(straight[3:])  # bit for bit, as printed

    assert_same(run(stdlib_dataset, 2, load=saved, pipeline_model_parallel_size=2, **FLAGS),
                straight[3:])  # fmt: skip
    assert_same(run(stdlib_dataset, 2, load=saved, **FLAGS), straight[3:])  # TP=1 x DP=2

    fsdp = str(tmp_path / "fsdp_dp4")
    first = run(stdlib_dataset, 4, load=saved, save=fsdp, save_interval=100, exit_interval=4,
                use_torch_fsdp2=True, **FLAGS)  # fmt: skip
    assert_same(first, straight[3:4])
    back = run(stdlib_dataset, 2, load=fsdp, use_distributed_optimizer=True, **FLAGS)
    assert_same(back, straight[4:])

    fresh = run(stdlib_dataset, 2, load=saved, no_load_optim=True, exit_interval=5, **FLAGS)
    assert_same(fresh[:1], straight[3:4])  # the same weights
    assert abs(fresh[1]["lm loss"] - straight[4]["lm loss"]) > 1e-3  # another update

    _assert_conversions_round_trip(stdlib_dataset, saved, tmp_path)

    torn = str(tmp_path / "torn")
    shutil.copytree(saved, torn)
    shard = os.path.join(torn, "iter_0000003", "__1_0.distcp")
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    failed = launch(1, argv(stdlib_dataset, load=torn, **FLAGS))
    assert_one_line_error(failed.returncode, failed.stdout, shard, "torn write")


def _dcp_tensors(directory: str) -> dict:
    """Every tensor of a torch_dist checkpoint directory but the per-rank random generators."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = os.path.join(directory, "whole.pt")
    dcp_to_torch_save(directory, whole)
    tensors = torch.load(whole, weights_only=True)
    os.remove(whole)
    return {key: value for key, value in tensors.items() if not key.startswith("rng_state")}


def _assert_conversions_round_trip(dataset: str, saved: str, tmp_path) -> None:
    """torch_dist (TP=2) -> torch (TP=1) -> torch_dist: the same tensors, bit for bit."""
    torch_files = str(tmp_path / "as_torch")
    back = str(tmp_path / "back")
    steps = ((saved, "torch", torch_files),
             (os.path.join(torch_files, "torch"), "torch_dist", back))  # fmt: skip
    for source, format_, destination in steps:
        converted = launch(1, argv(dataset, load=source, ckpt_convert_format=format_,
                                   ckpt_convert_save=destination, **FLAGS))  # fmt: skip
        assert converted.returncode == 0, converted.stdout[-3000:]
        assert f"-> {format_} in {destination}/{format_} (iteration 3" in converted.stdout
        assert "lm loss" not in converted.stdout  # no training step
    assert os.path.isfile(os.path.join(torch_files, "torch", "iter_0000003", "mp_rank_00",
                                       "model_optim_rng.pt"))  # fmt: skip
    original = _dcp_tensors(os.path.join(saved, "iter_0000003"))
    round_trip = _dcp_tensors(os.path.join(back, "torch_dist", "iter_0000003"))
    assert sorted(round_trip) == sorted(original)
    assert any(".exp_avg_sq" in key for key in original)
    for key, tensor in original.items():
        assert torch.equal(round_trip[key], tensor), key


class _Payload:
    """A pickle that would run code when loaded."""

    def __reduce__(self):
        return (os.makedirs, ("/tmp/never_made_by_a_checkpoint",))


def test_metadata_that_would_run_code_is_refused(tmp_path) -> None:
    """DCP unpickles `.metadata`; ours allows DCP's metadata classes, sizes and dtypes only."""
    import pickle

    from megatron.checkpointing.dist_checkpoint import DistCheckpointError, _checked_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(DistCheckpointError, match=r"\.metadata cannot be read .*not allowed"):
        _checked_metadata(str(tmp_path))
    assert not os.path.exists("/tmp/never_made_by_a_checkpoint")
