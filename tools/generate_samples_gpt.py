"""Generate text from a GPT checkpoint, as Megatron's `tools/generate_samples_gpt.py`.

    python tools/generate_samples_gpt.py --load checkpoints/gpt2 --prompt "def main(" \\
        --greedy --out-seq-length 32
    torchrun --nproc_per_node 2 tools/generate_samples_gpt.py --load checkpoints/gpt2 \\
        --tensor-model-parallel-size 2 --top_k 40 --sample-input-file prompts.txt
    python tools/generate_samples_gpt.py --load checkpoints/gpt2      # interactive

Prompts come from `--prompt`, from `--sample-input-file` (one per line; the results go to
`--sample-output-file`, default the input file plus `.out`), or, with neither, from stdin
("Context prompt (stop to exit) >>>", until `stop` or end of input); `--num-samples N`
without prompts draws N unconditional samples. Each prompt gets `--out-seq-length` new
tokens (fewer at `--max-position-embeddings` or an end-of-document token), with the KV cache.

The model's shape, tokenizer files and vocabulary padding come from the checkpoint's saved
arguments; only the tensor-parallel size can differ from training (the checkpoint is merged
to full weights, then split again). A Mixture-of-Experts model runs every expert in each
process (expert-parallel size 1, whatever it was trained with), without DeepSpeed's engine.
Runs as one process or under `torchrun` with one process per tensor-parallel rank (gloo on
CPU, nccl on GPUs); only rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.checkpointing.huggingface import model_config as checkpoint_model_config  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    load_dense_checkpoint,
    shard_state_dict,
)
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    broadcast_object_from_tensor_parallel_src,
)
from megatron.initialize import initialize_distributed, set_random_seed  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.sharding import declared_splits  # noqa: E402
from megatron.text_generation import check_sampling_args, generate  # noqa: E402
from megatron.tokenizer.base import MODEL_FILE_TOKENIZERS, Tokenizer  # noqa: E402
from megatron.tokenizer.tokenizer import build_tokenizer, vocab_size_with_padding  # noqa: E402
from megatron.utils import is_rank_0, print_rank_0  # noqa: E402
from tools.cli_errors import (  # noqa: E402
    ToolArgumentParser,
    check_input_file,
    check_output_path,
    run_tool,
)

VOCABULARY_ARGS = (
    "vocab_size",
    "null_tokenizer_eod_id",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "tokenizer_special_tokens",
)
"""The saved args besides the files that a NullTokenizer or TikTokenizer is built from."""
INTERACTIVE_PROMPT = "\nContext prompt (stop to exit) >>> "


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's text-generation flags (plus --prompt)."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="checkpoint and model")
    group.add_argument("--load", required=True, help="checkpoint directory (as --save wrote it)")
    group.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Megatron-LM's flag, accepted: the model's flags always come from the checkpoint here",
    )
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=None,
        help="tensor-parallel ranks (default and only choice: the number of processes)",
    )
    group.add_argument("--fp16", action="store_true", help="run the model in float16")
    group.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    group = parser.add_argument_group(title="tokenizer (default: the checkpoint's)")
    group.add_argument("--tokenizer-type", default=None, help="tokenizer class")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab JSON")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model file or Hugging Face tokenizer (the other tokenizer types)",
    )
    group = parser.add_argument_group(title="text generation")
    group.add_argument("--prompt", default=None, help="generate after this text, then exit")
    group.add_argument("--sample-input-file", default=None, help="prompts, one per line")
    group.add_argument("--sample-output-file", default=None, help="where to write the samples")
    group.add_argument(
        "--num-samples",
        type=int,
        default=0,
        help="samples per prompt (default 1); without prompts: unconditional samples, "
        "0 for interactive prompting",
    )
    group.add_argument("--out-seq-length", type=int, default=1024, help="new tokens per sample")
    group.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    group.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest")
    group.add_argument("--top_p", type=float, default=0.0, help="nucleus sampling mass")
    group.add_argument("--seed", type=int, default=1234, help="seed of the sampler")
    args = parser.parse_args(argv)
    check_sampling_args(args.top_k, args.top_p, args.temperature)
    if args.num_samples < 0 or args.out_seq_length < 1:
        parser.error("--num-samples must be >= 0 and --out-seq-length >= 1")
    if args.prompt is not None and args.sample_input_file is not None:
        parser.error("give --prompt or --sample-input-file, not both")
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 cannot both be set")
    if not os.path.isdir(args.load):
        raise FileNotFoundError(f"--load {args.load}: no such checkpoint directory")
    if args.sample_input_file is not None:
        check_input_file(args.sample_input_file, "--sample-input-file")
    if args.sample_output_file is not None:
        check_output_path(args.sample_output_file, "--sample-output-file")
    return args


def initialize(tensor_model_parallel_size: int | None, seed: int) -> torch.device:
    """Join the process group (gloo on CPU, nccl on GPUs), build TP groups, seed; the device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp = world_size if tensor_model_parallel_size is None else tensor_model_parallel_size
    if tp != world_size:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} must equal the number of processes "
            f"({world_size}); start one process per tensor-parallel rank"
        )
    if "RANK" in os.environ:  # under a launcher; a bare `python` needs no process group
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        initialize_distributed(backend, int(os.environ.get("LOCAL_RANK", "0")), False)
        parallel_state.initialize_model_parallel(tp, 1)
    set_random_seed(seed)  # the model's (discarded) initialization draws from TP streams
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tokenizer(args: argparse.Namespace, saved: dict) -> Tokenizer:
    """The tokenizer of the flags, or of the checkpoint's args where a flag is not given."""
    names = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    chosen = {name: getattr(args, name) or saved.get(name) for name in names}
    chosen["tokenizer_type"] = chosen["tokenizer_type"] or "GPT2BPETokenizer"
    chosen["vocab_extra_ids"] = saved.get("vocab_extra_ids") or 0
    # NullTokenizer's and TikTokenizer's sizes and special tokens, as the checkpoint was trained.
    for name in VOCABULARY_ARGS:
        chosen[name] = saved.get(name)
    gpt2_files = (
        ("vocab_file", "merge_file") if chosen["tokenizer_type"] == "GPT2BPETokenizer" else ()
    )
    for name in gpt2_files:
        if chosen[name] is not None and not os.path.isfile(chosen[name]):
            flag = "--" + name.replace("_", "-")
            raise FileNotFoundError(
                f"{flag} {chosen[name]} does not exist (from the checkpoint's args unless given)"
            )
    return build_tokenizer(argparse.Namespace(**chosen), verbose=False)


def model_config(saved: dict, padded_vocab_size: int, args: argparse.Namespace) -> ModelConfig:
    """The checkpoint's model shape, set up for inference (no dropout, full logits).

    MoE layers hold every expert (expert-parallel size 1), so DeepSpeed's MoE layer runs them
    locally, without expert-parallel groups or DeepSpeed's engine; top-2 gating takes the
    second expert by argmax (DeepSpeed would draw it at random, in evaluation too).
    """
    config = checkpoint_model_config(saved)
    moe = config.moe and dataclasses.replace(
        config.moe, expert_parallel_size=1, top2_2nd_expert_sampling=False
    )
    return dataclasses.replace(
        config,
        moe=moe,
        vocab_size=padded_vocab_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_backend="sdpa",
        params_dtype="float16" if args.fp16 else "bfloat16" if args.bf16 else "float32",
        sequence_parallel=False,
        recompute_granularity=None,
        distribute_saved_activations=False,
        parallel_output=False,
    )


def build_model_and_tokenizer(
    args: argparse.Namespace, device: torch.device
) -> tuple[GPTModel, Tokenizer]:
    """The checkpoint's model (this TP rank's shard, eval mode on `device`) and tokenizer."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    # Flags that name a whole tokenizer build it first: its size serves checkpoints that do
    # not record theirs. Otherwise the checkpoint's args fill in what the flags leave out.
    if args.tokenizer_type == "TikTokenizer":
        given = False  # its --vocab-size and special tokens are the checkpoint's
    elif args.tokenizer_type in MODEL_FILE_TOKENIZERS:
        given = bool(args.tokenizer_model)
    else:
        given = args.tokenizer_type in (None, "GPT2BPETokenizer") and bool(
            args.vocab_file and args.merge_file
        )
    tokenizer = _tokenizer(args, {}) if given else None
    dense = load_dense_checkpoint(
        args.load, true_vocab_size=None if tokenizer is None else tokenizer.vocab_size
    )
    tokenizer = tokenizer or _tokenizer(args, dense.args)
    trained = dense.args.get("true_vocab_size") or dense.true_vocab_size
    if tokenizer.vocab_size != trained:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but checkpoint {args.load} was "
            f"trained with {trained}; check --tokenizer-type and its files "
            "(--vocab-file and --merge-file, or --tokenizer-model)"
        )
    padded = vocab_size_with_padding(
        tokenizer.vocab_size,
        dense.args.get("make_vocab_size_divisible_by") or 128,
        tp,
        verbose=is_rank_0(),
    )
    model = GPTModel(model_config(dense.args, padded, args))
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = shard_state_dict(dense.state_dict, tp, rank, padded, declared_splits(model))
    model.load_state_dict(shard, strict=True)
    print_rank_0(f" > loaded iteration {dense.iteration} from {args.load} (TP={tp})")
    return model.to(device).eval(), tokenizer


def _local_prompts(args: argparse.Namespace) -> Iterator[str | None]:
    """Rank 0's prompts: --prompt, the input file's lines, unconditional, or stdin."""
    if args.prompt is not None:
        yield args.prompt
    elif args.sample_input_file is not None:
        with open(args.sample_input_file, encoding="utf-8") as lines:
            yield from (line.rstrip("\n") for line in lines if line.strip())
    elif args.num_samples > 0:
        yield None  # unconditional: the samples start from an end-of-document token
    else:
        while True:
            try:
                text = input(INTERACTIVE_PROMPT)
            except EOFError:
                return
            if text == "stop":
                return
            if not text:
                print("Prompt should not be empty!", flush=True)
                continue
            yield text


def shared_prompts(args: argparse.Namespace) -> Iterator[str | None]:
    """Rank 0's prompts, broadcast so that every TP rank generates for the same text."""
    local = _local_prompts(args) if is_rank_0() else iter(())
    while True:
        item = broadcast_object_from_tensor_parallel_src(next(local, StopIteration))
        if item is StopIteration:
            return
        yield item


def complete(
    model: GPTModel, tokenizer: Tokenizer, prompt: str | None, args: argparse.Namespace
) -> list[str]:
    """The continuations of `prompt` (or unconditional samples when None)."""
    context = tokenizer.tokenize(prompt) if prompt else [tokenizer.eod]
    samples = max(1, args.num_samples)
    new = generate(
        model,
        [context] * samples,
        args.out_seq_length,
        greedy=args.greedy,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=args.temperature,
        eod_token_id=tokenizer.eod,
        seed=args.seed,
        vocab_size=tokenizer.vocab_size,
    )
    prefix = tokenizer.detokenize(context) if prompt else ""
    texts = []
    for tokens in new:
        tokens = tokens[:-1] if tokens and tokens[-1] == tokenizer.eod else tokens
        full = tokenizer.detokenize((context if prompt else []) + tokens)
        texts.append(full[len(prefix) :])
    return texts


def run(args: argparse.Namespace) -> None:
    """Generate for every prompt, printing (and writing) the samples on rank 0."""
    device = initialize(args.tensor_model_parallel_size, args.seed)
    model, tokenizer = build_model_and_tokenizer(args, device)
    output_path = args.sample_output_file
    if output_path is None and args.sample_input_file is not None:
        output_path = args.sample_input_file + ".out"
        print_rank_0(f"`sample-output-file` not specified, setting it to {output_path}")
    interactive = args.prompt is None and args.sample_input_file is None and not args.num_samples
    output = open(output_path, "w", encoding="utf-8") if output_path and is_rank_0() else None
    try:
        for prompt in shared_prompts(args):
            try:
                texts = complete(model, tokenizer, prompt, args)
            except ValueError as error:  # e.g. a prompt too long: the same on every rank
                if not interactive:
                    raise
                print_rank_0(f"error: {error}")
                continue
            for text in texts:
                block = f"\nContext: {prompt or ''}\n\nMegatron-LM: {text}\n"
                print_rank_0(block)
                if output is not None:
                    output.write(block)
                    output.flush()
    finally:
        if output is not None:
            output.close()


def generate_samples(argv: list[str] | None) -> int:
    """Parse the flags and generate; the process group is torn down however it ends."""
    try:
        run(get_args(argv))
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 1 (with a one-line error) on bad input."""
    # ValueError: the sampling checks and prompt limits of megatron.text_generation and the
    # tokenizer/checkpoint mismatch; RuntimeError: torch.load of a damaged checkpoint file.
    return run_tool(lambda: generate_samples(argv), (ValueError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
