"""Complete a prompt with an exported Hugging Face GPT-2 folder, through `transformers` only.

    python tools/checkpoint/sample_hf.py --load gpt2_hf --prompt "def main(" --max-new-tokens 48

Loads the folder with `AutoModelForCausalLM` / `AutoTokenizer` (offline, as anyone who
downloads the export would) and prints the prompt followed by its continuation: greedy by
default, or sampled with `--top-k` / `--top-p` / `--temperature` and `--seed`. Greedy output
equals `tools/generate_samples_gpt.py --greedy` on the checkpoint the folder came from, which
is how the quickstart checks its export. Needs `pip install -e .[hf]`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

from megatron.extensions import install_hint  # noqa: E402
from tools.cli_errors import ToolArgumentParser, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Hugging Face folder (convert_to_hf.py).")
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="Tokens to generate.")
    parser.add_argument("--top-k", type=int, default=0, help="Sample from the k likeliest.")
    parser.add_argument("--top-p", type=float, default=0.0, help="Nucleus sampling mass.")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    parser.add_argument("--seed", type=int, default=1234, help="Seed for sampling.")
    args = parser.parse_args(argv)
    # Checked here: transformers reports these late, or (--top-p > 1) as an IndexError.
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.top_k < 0:
        parser.error(f"--top-k must be at least 0, got {args.top_k}")
    if not 0.0 <= args.top_p <= 1.0:
        parser.error(f"--top-p must be in [0, 1], got {args.top_p}")
    if args.temperature <= 0.0:
        parser.error(f"--temperature must be positive, got {args.temperature}")
    if not os.path.isfile(os.path.join(args.load, "config.json")):
        raise FileNotFoundError(f"--load {args.load}: no config.json (not a Hugging Face folder)")
    return args


def complete(args: argparse.Namespace) -> str:
    """The prompt plus the model's continuation, decoded."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ImportError(
            f"sampling a Hugging Face folder needs transformers ({error}): "
            f"{install_hint('transformers', 'hf')}"
        ) from None

    tokenizer = AutoTokenizer.from_pretrained(args.load)
    model = AutoModelForCausalLM.from_pretrained(args.load).eval()  # the dtype it was saved in
    inputs = tokenizer(args.prompt, return_tensors="pt")
    sample = args.top_k > 0 or args.top_p > 0.0
    options = {"do_sample": sample, "max_new_tokens": args.max_new_tokens}
    if sample:
        torch.manual_seed(args.seed)
        options.update(top_k=args.top_k or None, top_p=args.top_p or None)
        options["temperature"] = args.temperature
    with torch.no_grad():
        output = model.generate(**inputs, pad_token_id=tokenizer.eos_token_id, **options)
    return tokenizer.decode(output[0], skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad folder, flag or package."""
    # OSError covers what transformers raises for a folder it cannot load (weights missing,
    # config.json not JSON).
    return run_tool(lambda: print(complete(get_args(argv))), (ImportError,))


if __name__ == "__main__":
    sys.exit(main())
