"""Export a GPT checkpoint (either layout, any TP x PP) as a Hugging Face GPT-2 folder.

    python tools/checkpoint/convert_to_hf.py --load checkpoints/gpt2 --save hf/gpt2

Writes `config.json` (`GPT2LMHeadModel`), `model.safetensors` and the tokenizer files, so that
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it
offline. The vocabulary is trimmed to the tokenizer's size (the padding rows are dropped).
The folder is written under `{save}.partial-{pid}` and renamed when complete; an existing
non-empty `--save` is refused unless `--force`. Needs `pip install transformers safetensors`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

from megatron.checkpointing.huggingface import (  # noqa: E402
    EOD_TOKEN_ID,
    check_hf_compatible,
    hf_config_kwargs,
    model_config,
    to_hf_state_dict,
)
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    load_dense_checkpoint,
)
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tools.checkpoint import CONVERSION_ERRORS  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Checkpoint directory to read.")
    parser.add_argument("--save", required=True, help="Hugging Face folder to write.")
    parser.add_argument("--iteration", type=int, default=None, help="Default: the latest.")
    parser.add_argument(
        "--true-vocab-size", type=int, default=None, help="For checkpoints that lack it."
    )
    parser.add_argument("--vocab-file", default=None, help="Default: the checkpoint's.")
    parser.add_argument("--merge-file", default=None, help="Default: the checkpoint's.")
    parser.add_argument("--force", action="store_true", help="Replace a non-empty --save.")
    return parser.parse_args(argv)


def check_destination(path: str, force: bool) -> None:
    """Refuse a `--save` that cannot be written, or a non-empty folder without `--force`."""
    check_output_path(path, "--save", is_folder=True)
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise CheckpointConversionError(
            f"--save {path} is not empty; choose another folder or pass --force"
        )


def tokenizer_files(args: argparse.Namespace, dense: DenseCheckpoint) -> tuple[str, str]:
    """The GPT-2 vocab and merges files: the flags, else the ones the checkpoint names."""
    files = []
    for flag, key in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")):
        path = getattr(args, key) or dense.args.get(key)
        if not path or not os.path.isfile(path):
            raise CheckpointConversionError(
                f"{flag} {path}: no such file (the checkpoint's {key}); pass {flag}"
            )
        files.append(path)
    # Read once by our tokenizer: a bad file is a TokenizerFileError naming it, where
    # transformers would fail with a bare Exception deep inside the export.
    GPT2BPETokenizer(files[0], files[1])
    return files[0], files[1]


def write_tokenizer(
    folder: str, vocab: str, merges: str, max_length: int, vocab_size: int
) -> int | None:
    """Save the GPT-2 tokenizer (vocab.json, merges.txt, tokenizer.json...); its eos id."""
    from transformers import GPT2TokenizerFast

    shutil.copyfile(vocab, os.path.join(folder, "vocab.json"))
    shutil.copyfile(merges, os.path.join(folder, "merges.txt"))
    # Built from the folder: GPT2TokenizerFast(vocab_file=...) ignores the files in
    # transformers 5 (it takes `vocab`/`merges` contents instead).
    tokenizer = GPT2TokenizerFast.from_pretrained(folder, model_max_length=max_length)
    if len(tokenizer) > vocab_size:
        raise CheckpointConversionError(
            f"the tokenizer {vocab} has {len(tokenizer)} tokens, the model only {vocab_size}"
        )
    tokenizer.save_pretrained(folder)
    return tokenizer.eos_token_id


def write_folder(folder: str, dense: DenseCheckpoint, vocab: str, merges: str) -> None:
    """config.json, model.safetensors and the tokenizer files of `dense` into `folder`."""
    from safetensors.torch import save_file
    from transformers import GPT2Config

    config = model_config(dense.args)
    eod = write_tokenizer(
        folder, vocab, merges, config.max_position_embeddings, dense.true_vocab_size
    )
    eod = EOD_TOKEN_ID if eod is None else eod
    weights = to_hf_state_dict(dense.state_dict, config.num_attention_heads)
    dtype = str(weights["transformer.wte.weight"].dtype).removeprefix("torch.")
    hf_config = GPT2Config(
        **hf_config_kwargs(config, dense.true_vocab_size, eod), torch_dtype=dtype
    )
    hf_config.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates it owner-only; the other files are 0644


def publish(staging: str, final: str) -> None:
    """Rename the complete `staging` folder to `final` (replacing what `--force` allowed)."""
    replaced = f"{final}.replaced-{os.getpid()}"
    if os.path.isdir(final):
        os.replace(final, replaced)
    os.replace(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)


def convert(args: argparse.Namespace) -> None:
    """Read `--load`, write the Hugging Face folder `--save`."""
    check_destination(args.save, args.force)
    print(f"reading checkpoint {args.load} ...", flush=True)
    dense = load_dense_checkpoint(args.load, args.iteration, args.true_vocab_size)
    print(
        f"read {dense.layout} checkpoint at iteration {dense.iteration}: tensor-parallel "
        f"{dense.args.get('tensor_model_parallel_size', 1)} x pipeline-parallel "
        f"{dense.args.get('pipeline_model_parallel_size', 1)}, vocabulary {dense.true_vocab_size}",
        flush=True,
    )
    check_hf_compatible(model_config(dense.args))
    vocab, merges = tokenizer_files(args, dense)
    save = os.path.abspath(args.save)
    staging = f"{save}.partial-{os.getpid()}"
    os.makedirs(os.path.dirname(save), exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        write_folder(staging, dense, vocab, merges)
        publish(staging, save)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote Hugging Face GPT-2 folder {args.save} (config, safetensors, tokenizer)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: convert(get_args(argv)), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
