"""Megatron-LM's own torch_dist checkpoints, written and read by the released megatron-core
(tests/oracle/megatron_core_checkpoints.py, in its own environment on CPU), against ours.

A GPT-2-shaped model (LayerNorm, tanh GeLU as Megatron-LM's default fused bias-GeLU computes,
learned positions, biases, tied output layer; 2 layers, h 64, the GPT-2 vocabulary padded to
50304) saved by megatron-core as Megatron-LM's training loop saves it:
- our readers take it as it is: its logits equal megatron-core's; `convert_to_hf.py` exports
  it and `generate_samples_gpt.py` samples from it; `pretrain_gpt.py --load` refuses it in one
  line naming `reshard.py`, whose output (here at TP=2) is ours;
- `convert_to_megatron_core.py` writes that TP=2 checkpoint back in megatron-core's layout,
  and megatron-core's `dist_checkpointing.load` gives its model the same logits.
"""

from __future__ import annotations

import json
import os

import numpy
import pytest
import torch

from megatron.checkpointing.shards import load_dense_checkpoint
from tests.conftest import MERGE_FILE, VOCAB_FILE, run_cli, run_oracle
from tests.distributed import free_port
from tests.pretrain_runs import launch
from tests.tools.test_hf_conversion import our_logits
from tools.checkpoint import convert_to_hf, convert_to_megatron_core, reshard

ORACLE = os.path.join(os.path.dirname(__file__), "megatron_core_checkpoints.py")
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=50304,
             max_position_embeddings=32)  # fmt: skip
TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8], [50256, 11, 12, 13, 14, 15, 16, 17]]
GPT2_VOCAB = 50257


def _oracle(tmp_path, kind: str, directory: str) -> torch.Tensor:
    """megatron-core's logits on TOKENS after saving (kind "save") or loading `directory`."""
    logits = str(tmp_path / f"{kind}_logits.npy")
    job = dict(MODEL, kind=kind, dir=directory, iteration=10, seed=3, tokens=TOKENS,
               logits=logits, port=free_port())  # fmt: skip
    job_file = tmp_path / f"{kind}.json"
    job_file.write_text(json.dumps(job))
    run_oracle(ORACLE, str(job_file))
    return torch.from_numpy(numpy.load(logits))[..., :GPT2_VOCAB]


@pytest.mark.slow
def test_megatron_core_checkpoints_load_here_and_ours_load_there(
    stdlib_dataset: str, tmp_path
) -> None:
    theirs = str(tmp_path / "megatron_core")
    saved_logits = _oracle(tmp_path, "save", theirs)

    dense = load_dense_checkpoint(theirs, true_vocab_size=GPT2_VOCAB)
    assert dense.iteration == 10
    tokens = torch.tensor(TOKENS)
    torch.testing.assert_close(
        our_logits(dense.state_dict, dense.args, tokens), saved_logits, rtol=0, atol=1e-4
    )

    hf = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", theirs, "--save", hf, "--true-vocab-size",
                               str(GPT2_VOCAB), "--vocab-file", VOCAB_FILE,
                               "--merge-file", MERGE_FILE]) == 0  # fmt: skip
    assert os.path.isfile(os.path.join(hf, "model.safetensors"))
    sampled = run_cli("tools/generate_samples_gpt.py", "--load", theirs, "--prompt", "def",
                      "--greedy", "--out-seq-length", "4", "--vocab-file", VOCAB_FILE,
                      "--merge-file", MERGE_FILE)  # fmt: skip
    assert sampled.returncode == 0, sampled.stdout[-2000:] + sampled.stderr[-2000:]

    refused = launch(1, ["--load", theirs, "--num-layers", "2", "--hidden-size", "64",
                         "--num-attention-heads", "4", "--seq-length", "32",
                         "--max-position-embeddings", "32", "--micro-batch-size", "1",
                         "--train-iters", "1", "--lr", "1e-4", "--data-path", stdlib_dataset,
                         "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE])  # fmt: skip
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.stdout[-3000:]
    assert "megatron-core's) torch_dist checkpoint" in errors[0] and "reshard.py" in errors[0]

    ours = str(tmp_path / "ours_tp2")
    assert reshard.main(["--load", theirs, "--save", ours, "--target-tensor-parallel-size", "2",
                         "--true-vocab-size", str(GPT2_VOCAB)]) == 0  # fmt: skip
    back = str(tmp_path / "back")
    assert convert_to_megatron_core.main(["--load", ours, "--save", back]) == 0
    torch.testing.assert_close(_oracle(tmp_path, "load", back), saved_logits, rtol=0, atol=1e-5)
