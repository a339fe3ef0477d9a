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


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="Hugging Face folder (convert_to_hf.py).")
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="Tokens to generate.")
    parser.add_argument("--top-k", type=int, default=0, help="Sample from the k likeliest.")
    parser.add_argument("--top-p", type=float, default=0.0, help="Nucleus sampling mass.")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    parser.add_argument("--seed", type=int, default=1234, help="Seed for sampling.")
    return parser.parse_args(argv)


def complete(args: argparse.Namespace) -> str:
    """The prompt plus the model's continuation, decoded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    """Command-line entry point; 1 with a one-line error for a missing folder or package."""
    args = get_args(argv)
    if not os.path.isfile(os.path.join(args.load, "config.json")):
        print(
            f"error: --load {args.load}: no config.json (not a Hugging Face folder)",
            file=sys.stderr,
        )
        return 1
    try:
        text = complete(args)
    except ImportError as error:
        print(f"error: {error}; install with pip install -e .[hf]", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
