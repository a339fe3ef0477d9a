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

The same model trained 10 steps and saved as Megatron-LM's training loop saves it
(tests/oracle/megatron_lm_save.py: its whole `args`, optimizer, scheduler, rerun and random
states) holds megatron-core's enums in `common.pt`, which torch's weights_only loading refuses;
our readers take them as stand-ins: `--use-checkpoint-args` takes its model flags,
`convert_to_hf.py` exports a model with megatron-core's logits, `reshard.py` reads it, `--load`
refuses it in one line naming `reshard.py`.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import numpy
import pytest
import torch

from megatron.arguments import parse_args
from megatron.checkpointing.file_format import args_dict, load_file
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


def _oracle(tmp_path, kind: str, directory: str, **more) -> torch.Tensor:
    """megatron-core's logits on TOKENS after saving (kinds "save", "train_save") or loading
    `directory`; `more`: the job's other keys."""
    logits = str(tmp_path / f"{kind}_logits.npy")
    job = dict(MODEL, kind=kind, dir=directory, iteration=10, seed=3, tokens=TOKENS,
               logits=logits, port=free_port(), **more)  # fmt: skip
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


MEGATRON_LM_FOREIGN_TYPES = {
    "argparse.Namespace",  # args (allowed here)
    "signal.Signals",  # args.exit_signal (allowed here)
    "megatron.core.transformer.enums.AttnBackend",  # args.attention_backend
    "megatron.core.transformer.enums.CudaGraphScope",  # args.cuda_graph_scope
    "megatron.core.enums.ModelType",  # args.model_type
    "megatron.core.rerun_state_machine.RerunMode",  # rerun_state_machine.mode
    "megatron.core.rerun_state_machine.RerunState",  # rerun_state_machine.state
}


def _refusal(theirs: str, stdlib_dataset: str) -> str:
    """The first error line of `pretrain_gpt.py --load theirs` for the oracle's model."""
    refused = launch(1, ["--load", theirs, "--num-layers", "2", "--hidden-size", "64",
                         "--num-attention-heads", "4", "--seq-length", "32",
                         "--max-position-embeddings", "32", "--micro-batch-size", "1",
                         "--train-iters", "1", "--lr", "1e-4", "--data-path", stdlib_dataset,
                         "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE])  # fmt: skip
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.stdout[-3000:]
    return errors[0]


@pytest.mark.slow
def test_megatron_lm_training_checkpoint_is_read_with_its_foreign_types(
    stdlib_dataset: str, tmp_path
) -> None:
    theirs = str(tmp_path / "megatron_lm")
    saved_logits = _oracle(tmp_path, "train_save", theirs, rerun=True, vocab_file=VOCAB_FILE,
                           merge_file=MERGE_FILE)  # fmt: skip
    common = os.path.join(theirs, "iter_0000010", "common.pt")
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(common)) == (
        MEGATRON_LM_FOREIGN_TYPES
    )
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(common, weights_only=True)  # the reported failure

    contents = load_file(common)
    assert sorted(contents) == [
        "args", "checkpoint_version", "content_metadata", "iteration",
        "num_floating_point_operations_so_far", "opt_param_scheduler", "optimizer",
        "rerun_state_machine",
    ]  # fmt: skip
    saved = contents["args"]
    assert repr(saved.attention_backend) == "<AttnBackend.auto: 5>"
    assert repr(contents["rerun_state_machine"]["state"]) == (
        "<RerunState.WILL_RERUN_FROM_CHECKPOINT: 3>"
    )
    plain = args_dict(saved)
    assert (plain["attention_backend"], plain["model_type"], plain["cuda_graph_scope"]) == (
        "auto",
        "encoder_or_decoder",
        ["attn"],
    )
    assert (plain["exit_signal"], plain["params_dtype"]) == ("SIGTERM", torch.float32)
    assert not [name for name in sys.modules if name.startswith("megatron.core.transformer")]
    flags = parse_args(["--load", theirs, "--use-checkpoint-args", "--micro-batch-size", "1",
                        "--train-iters", "10", "--lr", "1e-3", "--dry-run", "--vocab-file",
                        VOCAB_FILE, "--merge-file", MERGE_FILE], world_size=1)  # fmt: skip
    assert (flags.num_layers, flags.hidden_size, flags.ffn_hidden_size) == (2, 64, 256)
    assert (flags.num_attention_heads, flags.seq_length) == (4, 32)
    assert flags.normalization == "LayerNorm"

    dense = load_dense_checkpoint(theirs, true_vocab_size=GPT2_VOCAB)
    assert dense.args["layernorm_epsilon"] == 1e-5  # core_v0.16's name for --norm-epsilon

    hf = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", theirs, "--save", hf, "--true-vocab-size",
                               str(GPT2_VOCAB)]) == 0  # fmt: skip
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    with torch.no_grad():
        hf_logits = model.eval()(torch.tensor(TOKENS)).logits
    torch.testing.assert_close(hf_logits, saved_logits, rtol=0, atol=1e-4)

    ours = str(tmp_path / "ours")
    assert reshard.main(["--load", theirs, "--save", ours, "--target-tensor-parallel-size", "2",
                         "--true-vocab-size", str(GPT2_VOCAB)]) == 0  # fmt: skip
    resharded = load_dense_checkpoint(ours)
    assert resharded.iteration == 10 and resharded.args["consumed_train_samples"] == 20
    torch.testing.assert_close(
        our_logits(resharded.state_dict, resharded.args, torch.tensor(TOKENS)),
        saved_logits, rtol=0, atol=1e-4,
    )  # fmt: skip

    error = _refusal(theirs, stdlib_dataset)
    assert "megatron-core's) torch_dist checkpoint" in error and "reshard.py" in error, error
