"""Megatron-DeepSpeed's tools/hf2megads_weight_converter.py: a Hugging Face LLaMA folder to a
checkpoint that finetune_llama.py (or pretrain_gpt.py) loads, and back, with the run's flags.

    deepspeed tools/hf2megads_weight_converter.py --hf-ckpt-num-shards 2 --hf-ckpt-dir HF \\
        --load-mode auto --save CKPT  <the fine-tune's flags: sizes, TP, PP, tokenizer, ...>
    deepspeed tools/hf2megads_weight_converter.py --hf-ckpt-num-shards 2 --hf-ckpt-dir HF \\
        --load-mode auto --to-hf-ckpt --load CKPT --save OUT  <the same flags>

(examples_deepspeed/finetune_hf_llama/finetune_llama.sh's convert_hf2mds and convert_mds2hf
stages.) The command line is the fine-tune's: every flag of finetune_llama.py parses and is
validated as there (so a run the checkpoint cannot serve is refused now, not after the
conversion), and the model it describes must be the Hugging Face one: a size or architecture
flag that differs (--num-layers, --hidden-size, --ffn-hidden-size, --num-key-value-heads,
--swiglu, --normalization rmsnorm, --use-rotary-position-embeddings,
--untie-embeddings-and-output-weights, --disable-bias-linear) is refused naming it; an RMSNorm
epsilon or RoPE base that differs is a warning (the run computes with its flags, and the
checkpoint records them). The tokenizer of --tokenizer-model must pad to the same vocabulary.

HF -> ours (the default): the weights of --hf-ckpt-dir, read per --load-mode (auto:
transformers' `from_pretrained`, any file layout; torchbin: the --hf-ckpt-num-shards files
pytorch_model-0000i-of-0000N.bin; safetensor: model.safetensors for one shard, else
model-0000i-of-0000N.safetensors), in the run's parameter dtype (--bf16 under --deepspeed:
bfloat16, as Megatron-DeepSpeed writes them), are written to --save as a `release` checkpoint
in Megatron's layout at the flags' TP x PP (`megatron.checkpointing.shards`; vocabulary padding
rows are zeros). DeepSpeed's engines load it too (its pipeline engine included), weights only,
from iteration 0. An existing checkpoint in --save is replaced, as there.

Ours -> HF (--to-hf-ckpt): the checkpoint in --load (either layout: the converted one, or
what finetune_llama.py saved with --deepspeed) becomes a `LlamaForCausalLM` folder in
`--save/release` (where Megatron-DeepSpeed writes it): config.json (the Hugging Face config of
the model the checkpoint computes; max_position_embeddings that of --hf-ckpt-dir's config.json,
which the fine-tune's --max-position-embeddings may have cut), model.safetensors and the
tokenizer (tools/checkpoint/convert_to_hf.py). Only config.json is read from --hf-ckpt-dir
then, whatever --load-mode says.

Launched by `deepspeed` (or torchrun) on several ranks, rank 0 converts and the others exit;
`python tools/hf2megads_weight_converter.py ...` runs it as one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

if __name__ == "__main__" and int(os.environ.get("RANK", "0")) != 0:
    sys.exit(0)  # launched on several ranks: rank 0 converts (before the slow imports below)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.arguments.data_checks import PROMPT_JSON_DATA  # noqa: E402
from megatron.arguments.errors import ArgumentError  # noqa: E402
from megatron.checkpointing.huggingface_llama import (  # noqa: E402
    from_llama_state_dict,
    megatron_args_from_llama,
)
from megatron.checkpointing.shapes import model_config  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.config import ModelConfig, model_params_dtype  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.tokenizer.tokenizer import (  # noqa: E402
    tokenizer_with_sizes,
    vocab_size_with_padding,
)
from tools.checkpoint import CONVERSION_ERRORS, require_hf_packages  # noqa: E402
from tools.checkpoint.convert_to_hf import publish, write_folder  # noqa: E402
from tools.checkpoint.hf_tokenizer import tokenizer_source  # noqa: E402
from tools.cli_errors import UsageError, check_output_path, run_tool  # noqa: E402

LOAD_MODES = ("torchbin", "safetensor", "auto")
# The model's structure: (ModelConfig field, the flag that sets it, config.json's key).
STRUCTURE = (
    ("num_layers", "--num-layers", "num_hidden_layers"),
    ("hidden_size", "--hidden-size", "hidden_size"),
    ("num_attention_heads", "--num-attention-heads", "num_attention_heads"),
    ("ffn_hidden_size", "--ffn-hidden-size", "intermediate_size"),
    ("num_key_value_heads", "--num-key-value-heads", "num_key_value_heads"),
    ("kv_channels", "--kv-channels", "head_dim"),
    ("activation", "--swiglu", "hidden_act silu"),
    ("normalization", "--normalization rmsnorm", "RMSNorm"),
    ("position_embedding_type", "--use-rotary-position-embeddings", "RoPE"),
    ("rotary_percent", "--rotary-percent", "partial_rotary_factor"),
    (
        "untie_embeddings_and_output_weights",
        "--untie-embeddings-and-output-weights",
        "tie_word_embeddings",
    ),
    ("add_bias_linear", "--disable-bias-linear", "attention_bias"),
    ("add_qkv_bias", "--add-qkv-bias", "attention_bias"),
)
# Numerics the run's flags decide (a difference is a warning): field, flag, config.json key.
NUMERICS = (
    ("layernorm_epsilon", "--layernorm-epsilon", "rms_norm_eps"),
    ("rotary_base", "--rotary-position-embeddings-theta", "rope_theta"),
)
# The run's flags the checkpoint records as its own (the model the fine-tune computes).
RUN_ARGS = (
    "seq_length",
    "max_position_embeddings",
    "layernorm_epsilon",
    "rope_theta",
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
)


def add_converter_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-DeepSpeed's hf2mega flags, beside the fine-tune's."""
    group = parser.add_argument_group(title="hf2mega")
    group.add_argument("--hf-ckpt-dir", type=str, default="", help="The Hugging Face LLaMA folder.")
    group.add_argument(
        "--hf-ckpt-num-shards",
        type=int,
        default=-1,
        help="How many weight files --load-mode torchbin / safetensor read.",
    )
    group.add_argument(
        "--load-mode",
        type=str,
        default=None,
        choices=LOAD_MODES,
        help="How the weights are read: pytorch_model-*.bin files, model*.safetensors files, "
        "or auto (transformers' from_pretrained).",
    )
    group.add_argument(
        "--to-hf-ckpt",
        action="store_true",
        help="Convert the checkpoint in --load to a Hugging Face folder in --save/release "
        "instead (default: --hf-ckpt-dir to a checkpoint in --save).",
    )
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The fine-tune's flags and ours, validated as finetune_llama.py validates them, with the
    tokenizer built (`padded_vocab_size`); UsageError names a bad flag."""
    from megatron.arguments.parser import build_parser, typed_flags
    from megatron.arguments.validation import validate_args

    parser = build_parser(add_converter_flags)
    parser.set_defaults(**{PROMPT_JSON_DATA: True})  # --data-path as finetune_llama.py reads it
    args = parser.parse_args(argv)
    world_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    world_size = int(os.environ.get("WORLD_SIZE", world_size))
    try:
        args = validate_args(args, world_size, typed_flags(parser, argv))
    except ArgumentError as error:
        raise UsageError(str(error)) from None
    if not args.hf_ckpt_dir:
        raise UsageError("--hf-ckpt-dir is required (the Hugging Face LLaMA folder)")
    if not args.save:
        raise UsageError("--save is required (where the converted model is written)")
    if args.to_hf_ckpt and not args.load:
        raise UsageError("--to-hf-ckpt needs --load (the checkpoint to convert)")
    check_output_path(args.save, "--save", is_folder=True)
    try:
        _, sizes = tokenizer_with_sizes(args, verbose=True)  # the padding the fine-tune will use
    except ValueError as error:  # a missing or unreadable tokenizer, named by its flag
        raise CheckpointConversionError(str(error)) from None
    return with_settled(args, **sizes)


def read_hf_config(folder: str) -> dict:
    """config.json of the LLaMA in `folder`; errors name --hf-ckpt-dir."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointConversionError(f"--hf-ckpt-dir {folder}: no config.json there")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except ValueError as error:
        raise CheckpointConversionError(
            f"--hf-ckpt-dir {path}: not a JSON config ({error})"
        ) from None
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointConversionError(
            f"--hf-ckpt-dir {path}: model_type {kind!r}; this tool converts LLaMA (use "
            "tools/checkpoint/convert_from_hf.py for the other families)"
        )
    return config


def weight_files(folder: str, mode: str, shards: int) -> list[str]:
    """The files --load-mode torchbin / safetensor reads, as Megatron-DeepSpeed names them."""
    if shards < 1:
        raise UsageError(
            f"--load-mode {mode} reads --hf-ckpt-num-shards files; give their number (>= 1)"
        )
    if mode == "torchbin":
        names = [f"pytorch_model-{i:05d}-of-{shards:05d}.bin" for i in range(1, shards + 1)]
    elif shards == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    paths = [os.path.join(folder, name) for name in names]
    for path in paths:
        if not os.path.isfile(path):
            raise CheckpointConversionError(
                f"--hf-ckpt-dir {folder}: no {os.path.basename(path)} (--load-mode {mode} with "
                f"--hf-ckpt-num-shards {shards})"
            )
    return paths


def read_hf_weights(folder: str, mode: str | None, shards: int) -> dict:
    """The LLaMA's state dict (`model.layers.N...` names) from `folder`, per --load-mode."""
    if mode in (None, "auto"):
        from tools.checkpoint.convert_from_hf import read_hf_model

        require_hf_packages("--load-mode auto (transformers' from_pretrained)", ("transformers",))
        return read_hf_model(folder, "llama")[1]
    state: dict = {}
    for path in weight_files(folder, mode, shards):
        if mode == "torchbin":
            import torch

            part = torch.load(path, map_location="cpu", weights_only=True)
        else:
            require_hf_packages("--load-mode safetensor", ("safetensors",))
            from safetensors.torch import load_file

            part = load_file(path)
        repeated = sorted(set(part) & set(state))
        if repeated:
            raise CheckpointConversionError(f"{path}: {repeated[0]} is also in an earlier shard")
        state.update(part)
    return state


def structure_difference(ours: ModelConfig, theirs: ModelConfig) -> str | None:
    """The first of `STRUCTURE` where two models differ, as "FLAG: ... (KEY)"; None if none."""
    for field, flag, key in STRUCTURE:
        mine, other = getattr(ours, field), getattr(theirs, field)
        if mine != other:
            return f"{flag}: {field} {mine!r} against {other!r} ({key})"
    return None


def check_same_model(run: ModelConfig, theirs: ModelConfig, where: str) -> None:
    """Refuse run flags that build another model than `where`'s; warn about other numerics."""
    difference = structure_difference(run, theirs)
    if difference is not None:
        raise CheckpointConversionError(
            f"{difference}: the command line's model is not {where}'s; pass the model's flags"
        )
    for field, flag, key in NUMERICS:
        ours, other = getattr(run, field), getattr(theirs, field)
        if ours != other:
            print(
                f"warning: {flag} {ours:g}, but {where} has {key} {other:g}; the run computes "
                f"with {ours:g} (pass {flag} {other:g} to keep the model's)",
                file=sys.stderr,
                flush=True,
            )


def hf_to_megatron(args: argparse.Namespace) -> None:
    """--hf-ckpt-dir -> a `release` checkpoint in --save at the flags' TP x PP."""
    import torch

    hf_config = read_hf_config(args.hf_ckpt_dir)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    divisible = args.make_vocab_size_divisible_by
    saved = megatron_args_from_llama(hf_config, tp, pp, divisible, args.seq_length)
    check_same_model(ModelConfig.from_args(args), model_config(saved), "config.json")
    padded = vocab_size_with_padding(saved["true_vocab_size"], divisible, tp, verbose=False)
    if padded != args.padded_vocab_size:
        raise CheckpointConversionError(
            f"--tokenizer-model {args.tokenizer_model}: {args.tokenizer_vocab_size} tokens pad to "
            f"{args.padded_vocab_size} rows, but config.json's vocab_size "
            f"{saved['true_vocab_size']} to {padded}; use the model's tokenizer"
        )
    saved.update({name: getattr(args, name) for name in RUN_ARGS})
    print(f"reading Hugging Face LLaMA {args.hf_ckpt_dir} (--load-mode {args.load_mode}) ...")
    hf_state = read_hf_weights(args.hf_ckpt_dir, args.load_mode, args.hf_ckpt_num_shards)
    dtype = getattr(torch, model_params_dtype(args))
    state = from_llama_state_dict(hf_state, model_config(saved))
    dense = DenseCheckpoint(
        state_dict={name: tensor.to(dtype) for name, tensor in state.items()},
        args=saved,
        iteration=0,
        true_vocab_size=saved["true_vocab_size"],
        layout="huggingface",
    )
    directory = save_megatron_checkpoint(dense, args.save, tp, pp, divisible, overwrite=True)
    print(
        f"wrote {directory}: {saved['num_layers']} layers, tensor-parallel {tp} x "
        f"pipeline-parallel {pp}, {str(dtype).removeprefix('torch.')} weights; fine-tune it "
        f"with finetune_llama.py --load {args.save} --finetune and these flags",
        flush=True,
    )


def megatron_to_hf(args: argparse.Namespace) -> None:
    """The checkpoint in --load -> a Hugging Face LLaMA folder in --save/release."""
    require_hf_packages("--to-hf-ckpt (a Hugging Face folder)")
    hf_config = read_hf_config(args.hf_ckpt_dir)
    print(f"reading checkpoint {args.load} ...", flush=True)
    dense = load_dense_checkpoint(args.load)
    check_same_model(ModelConfig.from_args(args), model_config(dense.args), args.load)
    original = megatron_args_from_llama(hf_config, 1, 1, 1)
    difference = structure_difference(model_config(dense.args), model_config(original))
    if difference is not None:  # only its max_position_embeddings is taken, but not blindly
        raise CheckpointConversionError(
            f"--hf-ckpt-dir {args.hf_ckpt_dir}: config.json describes another model than "
            f"--load {args.load} ({difference.split(': ', 1)[1]})"
        )
    dense.args["max_position_embeddings"] = original["max_position_embeddings"]
    tokenizer = tokenizer_source(args, dense.args)
    final = os.path.join(os.path.abspath(args.save), "release")
    staging = f"{final}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        architecture = write_folder(staging, dense, tokenizer)
        publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"wrote Hugging Face {architecture} folder {final} from the {dense.layout} checkpoint "
        f"at iteration {dense.iteration} (config, safetensors, tokenizer)",
        flush=True,
    )


def convert(argv: list[str] | None) -> None:
    """Parse, then convert one way or the other."""
    args = parse(argv)
    if args.to_hf_ckpt:
        megatron_to_hf(args)
    else:
        hf_to_megatron(args)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (rank 0's, see the top); 1 with one-line errors."""
    return run_tool(lambda: convert(argv), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
