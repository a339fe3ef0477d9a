"""Megatron-DeepSpeed's examples_deepspeed/finetune_hf_llama/finetune_llama.sh, its three stages
run through the `deepspeed` launcher on CPU with the sizes scaled down.

The command lines are the script's (tests/compat/scripts/finetune_hf_llama/finetune_llama.json):
every flag kept, the sizes made tiny (2 layers, h=64, 128 tokens, 12 iterations), the paths
pointed at fixtures built here (tests/compat/finetune_llama_fixtures.py: a LLaMA made with
transformers, a byte-level BPE tokenizer with LLaMA's <s>/</s>, 40 Alpaca records) and nccl
swapped for gloo:

1. convert_hf2mds: tools/hf2megads_weight_converter.py writes the checkpoint;
2. finetune_llama.py fine-tunes it under DeepSpeed's pipeline engine (ZeRO 0, bf16) with
   --finetune and --repeated-dataloader (96 samples of 40 records), and the loss falls. The
   script passes no --save (its last stage converts the untouched weights back): the test adds
   one, for the last stage to convert what was trained;
3. convert_mds2hf: the fine-tuned checkpoint becomes a Hugging Face folder that transformers
   loads, computing our checkpoint's logits (run in the test's process: the first stage has
   shown the tool under the launcher).

Scaled: TP 1 x PP 2 on 2 processes (the script's TP 2 x PP 2 takes 4, twice the start-up on a
2-core CI machine; its flags are validated at TP 2 x PP 2 on 4 ranks, and the TP split of a
conversion is what tests/checkpointing checks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron.arguments.parser import build_parser, typed_flags
from megatron.arguments.validation import validate_args
from megatron.checkpointing.shapes import model_config
from megatron.checkpointing.shards import load_dense_checkpoint, shard_state_dict
from megatron.data.alpaca import alpaca_prompt
from megatron.model import GPTModel
from megatron.model.sharding import declared_splits
from megatron.training.monitor import parse_iteration_log
from tests.compat.finetune_llama_fixtures import (
    HF_MAX_POSITIONS,
    RECORDS,
    alpaca_records,
    build_hf_llama,
    build_tokenizer_folder,
    write_alpaca_json,
)
from tests.compat.scripts import SCRIPTS_DIR, Script, localized, with_values
from tests.conftest import REPO_ROOT
from tests.distributed import free_port
from tests.preloaded import launch_command
from tests.pretrain_runs import cpu_env
from tests.tolerances import assert_close_reordered, forward_terms
from tools import hf2megads_weight_converter

transformers = pytest.importorskip("transformers")

SCRIPT = os.path.join(SCRIPTS_DIR, "finetune_hf_llama", "finetune_llama.json")
SEQ, ITERATIONS, GLOBAL_BATCH, MICRO_BATCH = 128, 12, 8, 2
RANKS = 2  # PP 2 as the script, TP 1 (the script's TP 2 x PP 2 would be 4 processes)
SIZES = {
    "--tensor-model-parallel-size": ["1"],
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--num-attention-heads": ["4"],
    "--seq-length": [str(SEQ)],
    "--max-position-embeddings": [str(SEQ)],
    "--micro-batch-size": [str(MICRO_BATCH)],
    "--global-batch-size": [str(GLOBAL_BATCH)],
    "--train-iters": [str(ITERATIONS)],  # 96 samples of 40 records: read again
    "--lr-warmup-iters": ["2"],
    # A tiny model from a random start takes a larger step than the script's 2e-5.
    "--lr": ["2e-3"],
}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    """The Alpaca JSON, the HF LLaMA folder (its tokenizer inside), a scratch folder."""
    root = tmp_path_factory.mktemp("finetune_llama")
    records = alpaca_records()
    data = write_alpaca_json(str(root / "alpaca_data.json"), records)
    hf = build_tokenizer_folder(str(root / "llama-hf"), records)
    build_hf_llama(hf, len(transformers.AutoTokenizer.from_pretrained(hf)))
    return {"data": data, "hf": hf, "root": str(root)}


def stage_argv(stage: str, fixtures: dict[str, str], values: dict[str, list[str] | None]) -> list:
    """The script's argv of `stage` at SIZES and `values`, its DeepSpeed config at the tiny
    batch, its paths pointed at `fixtures`."""
    with open(SCRIPT, encoding="utf-8") as file:
        captured = json.load(file)
    config = dict(
        captured["stages"][stage]["ds_config"],
        train_batch_size=GLOBAL_BATCH,
        train_micro_batch_size_per_gpu=MICRO_BATCH,
    )
    scratch = os.path.join(fixtures["root"], stage)
    argv = with_values(captured["stages"][stage]["argv"], SIZES)
    script = Script(stage, captured["source"], "deepspeed", RANKS, argv, config)
    argv = localized(script, fixtures["data"], scratch)  # the config written, nccl -> gloo
    local = {
        "--hf-ckpt-dir": [fixtures["hf"]],
        "--tokenizer-model": [fixtures["hf"]],
        "--tensorboard-dir": [os.path.join(scratch, "tensorboard")],
    }
    local = {flag: value for flag, value in local.items() if flag in argv}
    return with_values(argv, {**local, **values})


def launch(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus RANKS script argv` on CPU, its ranks forked from the preloaded
    process with the environment the launcher gives them (tests/preloaded.py); stdout and
    stderr together."""
    command = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        str(RANKS),
        "--master_port",
        str(free_port()),
        os.path.join(REPO_ROOT, script),
        *argv,
    ]
    return launch_command(command, cpu_env(OMP_NUM_THREADS="1"), REPO_ROOT, timeout=600)


def our_logits(checkpoint: str, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Logits [b, s, true vocab] of the checkpoint's model (TP 1, fp32), and its args."""
    dense = load_dense_checkpoint(checkpoint)
    state = {name: tensor.float() for name, tensor in dense.state_dict.items()}
    rows = -(-dense.true_vocab_size // 128) * 128
    config = dataclasses.replace(
        model_config(dense.args), vocab_size=rows, parallel_output=False, params_dtype="float32"
    )
    model = GPTModel(config)
    model.load_state_dict(shard_state_dict(state, 1, 0, rows, declared_splits(model)))
    with torch.no_grad():
        logits = model.eval()(tokens)[..., : dense.true_vocab_size]
    return logits, dense.args


def test_the_fine_tune_command_line_validates_at_the_scripts_world_size(fixtures) -> None:
    """finetune_llama.py's flags as the script passes them (TP 2 x PP 2 on 4 ranks): --data-path
    an Alpaca JSON file, --repeated-dataloader accepted, --save-interval without --save."""
    argv = stage_argv("finetune", fixtures, {"--tensor-model-parallel-size": ["2"]})
    parser = build_parser()
    parser.set_defaults(prompt_json_data=True)  # finetune_llama.py's ARGS_DEFAULTS
    args = validate_args(parser.parse_args(argv), 4, typed_flags(parser, argv))
    assert args.repeated_dataloader and args.finetune and args.deepspeed
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.data_parallel_size == 1 and args.save is None  # the script saves nothing
    assert args.data_path == [fixtures["data"]]


@pytest.mark.slow
def test_the_scripts_three_stages(fixtures) -> None:
    """convert_hf2mds, fine-tune (the loss falls), convert_mds2hf (transformers computes the
    fine-tuned checkpoint's logits)."""
    root = fixtures["root"]
    converted, tuned, out = (os.path.join(root, name) for name in ("mds", "tuned", "hf-out"))
    done = launch(
        "tools/hf2megads_weight_converter.py",
        stage_argv("convert_hf2mds", fixtures, {"--save": [converted]}),
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert "tensor-parallel 1 x pipeline-parallel 2, bfloat16 weights" in done.stdout

    argv = stage_argv("finetune", fixtures, {"--load": [converted], "--save": [tuned]})
    done = launch("finetune_llama.py", argv)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "(weights only)" in done.stdout, done.stdout[-4000:]
    assert f"> {RECORDS} Alpaca records, one sample each" in done.stdout
    logs = [
        parse_iteration_log(line)
        for line in done.stdout.splitlines()
        if line.startswith(" iteration ") and "consumed samples:" in line
    ]
    assert [log["iteration"] for log in logs] == list(range(1, ITERATIONS + 1))
    losses = [log["lm loss"] for log in logs]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses

    # In this process (the launcher's part was the first stage's): --to-hf-ckpt.
    argv = stage_argv("convert_mds2hf", fixtures, {"--load": [tuned], "--save": [out]})
    assert hf2megads_weight_converter.main(argv) == 0
    release = os.path.join(out, "release")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        release, local_files_only=True, dtype=torch.float32
    )
    assert model.config.max_position_embeddings == HF_MAX_POSITIONS  # the model's, not SEQ's
    tokenizer = transformers.AutoTokenizer.from_pretrained(release, local_files_only=True)
    ids = tokenizer(alpaca_prompt(alpaca_records()[3]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = model.eval()(ids).logits
    ours, args = our_logits(tuned, ids)
    assert_close_reordered(theirs, ours, terms=forward_terms(model_config(args), ids.numel()))
    # It is the fine-tuned model: the weights moved away from the Hugging Face original.
    original = transformers.AutoModelForCausalLM.from_pretrained(
        fixtures["hf"], dtype=torch.float32
    )
    assert not torch.equal(original.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def auto_converted(fixtures) -> str:
    """convert_hf2mds with the script's --load-mode auto, in this process."""
    save = os.path.join(fixtures["root"], "auto")
    assert (
        hf2megads_weight_converter.main(stage_argv("convert_hf2mds", fixtures, {"--save": [save]}))
        == 0
    )
    return save


def test_the_converted_checkpoint_computes_the_hugging_face_models_logits(fixtures, auto_converted):
    """convert_hf2mds keeps the function: our model from the checkpoint (bf16 weights, as
    --bf16 under --deepspeed writes them) against the Hugging Face model with the same
    bf16-rounded weights, both computing in fp32; convert_mds2hf gives those weights back."""
    model = transformers.AutoModelForCausalLM.from_pretrained(fixtures["hf"], dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    tokenizer = transformers.AutoTokenizer.from_pretrained(fixtures["hf"])
    ids = tokenizer(alpaca_prompt(alpaca_records()[0]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = model.eval()(ids).logits
    ours, args = our_logits(auto_converted, ids)
    assert_close_reordered(theirs, ours, terms=forward_terms(model_config(args), ids.numel()))
    # The script as written converts these weights straight back: the same tensors come out.
    out = os.path.join(fixtures["root"], "straight-back")
    values = {"--load": [auto_converted], "--save": [out]}
    assert hf2megads_weight_converter.main(stage_argv("convert_mds2hf", fixtures, values)) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "release"))
    assert back.dtype == torch.bfloat16
    expected = dict(model.named_parameters())
    assert all(torch.equal(p.float(), expected[name]) for name, p in back.named_parameters())


@pytest.mark.parametrize("mode", ["safetensor", "torchbin", "auto at TP 2"])
def test_every_load_mode_reads_the_same_weights(fixtures, auto_converted, mode, tmp_path) -> None:
    """--load-mode safetensor reads model-0000i-of-00002.safetensors, torchbin
    pytorch_model-0000i-of-00002.bin (--hf-ckpt-num-shards 2): the weights auto reads; split
    at the script's TP 2 x PP 2 they are the same model too."""
    from safetensors.torch import load_file

    hf = fixtures["hf"]
    if mode == "torchbin":  # the same shards as torch.save files, beside the config
        hf = str(tmp_path / "bin")
        os.makedirs(hf)
        for name in os.listdir(fixtures["hf"]):
            if name.endswith(".safetensors"):
                shard = name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
                torch.save(load_file(os.path.join(fixtures["hf"], name)), os.path.join(hf, shard))
            elif name.endswith(".json"):
                with open(os.path.join(fixtures["hf"], name), "rb") as source:
                    with open(os.path.join(hf, name), "wb") as copy:
                        copy.write(source.read())
    save = str(tmp_path / "ckpt")
    values = {"--save": [save], "--load-mode": [mode], "--hf-ckpt-dir": [hf]}
    if mode == "auto at TP 2":
        values.update({"--load-mode": ["auto"], "--tensor-model-parallel-size": ["2"]})
    assert hf2megads_weight_converter.main(stage_argv("convert_hf2mds", fixtures, values)) == 0
    ours, auto = load_dense_checkpoint(save), load_dense_checkpoint(auto_converted)
    tp = 2 if mode == "auto at TP 2" else 1
    assert ours.args["tensor_model_parallel_size"] == tp
    assert sorted(ours.state_dict) == sorted(auto.state_dict)
    assert all(torch.equal(ours.state_dict[k], t) for k, t in auto.state_dict.items())
    assert ours.args["max_position_embeddings"] == SEQ  # the run's flag, which it checks


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"--ffn-hidden-size": ["96"]},
            "error: --ffn-hidden-size: ffn_hidden_size 96 against 128 (intermediate_size): the "
            "command line's model is not config.json's",
        ),
        ({"--swiglu": None}, "error: --swiglu: activation 'gelu"),
        (
            {"--load-mode": ["torchbin"]},
            "no pytorch_model-00001-of-00002.bin (--load-mode torchbin with "
            "--hf-ckpt-num-shards 2)",
        ),
        ({"--load-mode": ["safetensor"], "--hf-ckpt-num-shards": ["-1"]}, "--hf-ckpt-num-shards"),
        ({"--to-hf-ckpt": []}, "error: --to-hf-ckpt needs --load"),
    ],
)
def test_a_command_line_the_model_does_not_fit_is_one_line(fixtures, values, message, capsys):
    """Refused before anything is written, in one line naming the flag."""
    save = os.path.join(fixtures["root"], "refused")
    argv = stage_argv("convert_hf2mds", fixtures, {"--save": [save], **values})
    assert hf2megads_weight_converter.main(argv) in (1, 2)
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error, error
    assert not os.path.exists(save)
