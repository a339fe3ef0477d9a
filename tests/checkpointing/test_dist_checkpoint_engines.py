"""`--ckpt-format torch_dist` on DeepSpeed's engine: the same tensors under the same names as
the plain engine's (fp32 master weights and Adam's state assembled by DeepSpeed's per-parameter
accessors), so a run moves between engines, ZeRO stages and layouts with its optimizer state,
and Megatron-LM's `--ckpt-convert-format` turns DeepSpeed's own checkpoints into torch_dist and
back.

The tiny LLaMA-style model of `llama_runs`, fp32, dropout 0, global batch 8, 2 ranks:

- a ZeRO-1 run (DP=2) saves DeepSpeed's own checkpoint at 3 and trains to 6 (the reference);
  converted to torch_dist at its layout, it resumes on the plain engine at TP=2 and logs
  iterations 4-6; converted from that torch_dist into DeepSpeed's own layout by a ZeRO-3 TP=2
  run, DeepSpeed resumes from it with the same losses;
- DeepSpeed-MoE (4 experts, top-2 without random sampling) saves torch_dist at EP=2 and
  resumes at EP=1 with the same losses; with `--no-load-optim` they differ after the first
  update: the experts' Adam state came along.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.checkpointing.compare import rolled_back
from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.training.llama_runs import argv, assert_same, run

FLAGS = dict(global_batch_size=8, make_vocab_size_divisible_by=64)
MOE = "--num-experts 4 --expert-interval 1 --topk 2 --disable-moe-top2-2nd-expert-sampling"


def _deepspeed(tmp_path, stage: int) -> dict:
    """The flags of a DeepSpeed run at ZeRO `stage` (its engine without the pipeline)."""
    config = tmp_path / f"ds_zero{stage}.json"
    config.write_text(
        json.dumps({
            "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
        })
    )  # fmt: skip
    return dict(deepspeed=True, deepspeed_config=str(config), zero_stage=stage,
                no_pipeline_parallel=True)  # fmt: skip


def _converted(dataset: str, format_: str, load: str, into: str, **flags: object) -> str:
    """`--ckpt-convert-format` of `load` at the layout of `flags`; the directory written."""
    converted = _launch("torchrun", argv(dataset, load=load, ckpt_convert_format=format_,
                                         ckpt_convert_save=into, **flags, **FLAGS))  # fmt: skip
    assert converted.returncode == 0, converted.stdout[-3000:]
    assert "lm loss" not in converted.stdout  # nothing trained
    return os.path.join(into, format_)


@pytest.mark.slow
def test_deepspeed_checkpoints_move_to_the_plain_engine_and_back(
    stdlib_dataset: str, tmp_path
) -> None:
    zero1, zero3 = _deepspeed(tmp_path, 1), _deepspeed(tmp_path, 3)
    saved = str(tmp_path / "zero1")
    straight = run(stdlib_dataset, 2, save=saved, save_interval=3, **zero1, **FLAGS)
    assert os.path.isdir(os.path.join(saved, "global_step3"))  # DeepSpeed's own layout
    at_3 = rolled_back(saved, 3, str(tmp_path / "zero1_at_3"))

    dist = _converted(stdlib_dataset, "torch_dist", at_3, str(tmp_path / "dist"), **zero1)
    assert os.path.isfile(os.path.join(dist, "iter_0000003", ".metadata"))
    plain = run(stdlib_dataset, 2, load=dist, tensor_model_parallel_size=2, **FLAGS)
    assert_same(plain, straight[3:])

    tp2 = dict(tensor_model_parallel_size=2, **zero3)
    back = _converted(stdlib_dataset, "torch", dist, str(tmp_path / "back"), **tp2)
    assert os.path.isdir(os.path.join(back, "global_step3"))  # DeepSpeed's own layout again
    assert_same(run(stdlib_dataset, 2, load=back, **tp2, **FLAGS), straight[3:])


def _moe_run(dataset: str, ep: int, **flags: object) -> list[dict]:
    tokens = argv(dataset, ckpt_format="torch_dist", **flags, **FLAGS)
    tokens += f"{MOE} --moe-expert-parallel-size {ep}".split()
    logged = _launch("deepspeed", tokens)
    assert logged.returncode == 0, logged.stdout[-3000:]
    return _iteration_lines(logged.stdout)


@pytest.mark.slow
def test_a_moe_checkpoint_resumes_at_another_expert_parallel_size(
    stdlib_dataset: str, tmp_path
) -> None:
    zero0 = _deepspeed(tmp_path, 0)
    saved = str(tmp_path / "ep2")
    straight = _moe_run(stdlib_dataset, 2, save=saved, save_interval=3, **zero0)
    at_3 = rolled_back(saved, 3, str(tmp_path / "ep2_at_3"))
    assert_same(_moe_run(stdlib_dataset, 1, load=at_3, **zero0), straight[3:])
    fresh = _moe_run(stdlib_dataset, 1, load=at_3, no_load_optim=True, exit_interval=5, **zero0)
    assert_same(fresh[:1], straight[3:4])  # the same weights
    assert abs(fresh[1]["lm loss"] - straight[4]["lm loss"]) > 1e-3  # another update
