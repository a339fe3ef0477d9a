"""What the installed `transformers` reads from Hugging Face folders: ids, logits, greedy tokens.

    python tests/tools/hf_reader.py OUT.pt --text TEXT --new-tokens 8 DIR...
    python tests/tools/hf_reader.py OUT.pt --make-llama DIR

Imports only torch and transformers, so that a test can run it under transformers 4.x (a
subprocess with `tests.conftest.ensure_transformers_4()` first on PYTHONPATH) and call `read`
in-process under the installed 5.x. `--make-llama DIR` saves a random LLaMA (grouped-query
attention, untied output layer, RoPE base 500000) to DIR with this release's `save_pretrained`,
and its logits.
"""

from __future__ import annotations

import argparse

import torch
import transformers


def read(folder: str, text: str, new_tokens: int) -> dict:
    """The tokenizer's ids of `text`, the model's logits [s, v] and its greedy continuation, and
    the weights the folder lacked or had too many of (`missing`, `unexpected`)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, output_loading_info=True
    )
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.eval()(ids).logits[0]
    greedy = model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id
    )
    return dict(
        version=transformers.__version__,
        architecture=type(model).__name__,
        dtype=model.dtype,
        ids=ids[0].tolist(),
        logits=logits,
        greedy=greedy[0, ids.size(1) :].tolist(),
        missing=sorted(info["missing_keys"]),
        unexpected=sorted(info["unexpected_keys"]),
    )


def make_llama(folder: str) -> dict:
    """Save a random LLaMA (every weight random, norms around 1) with this `save_pretrained`;
    its logits [s, v] on random ids."""
    config = transformers.LlamaConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset = 1.0 if "norm" in name else 0.0
            param.copy_(offset + torch.randn_like(param) * 0.2)
        ids = torch.randint(0, config.vocab_size, (1, 24))
        logits = model(ids).logits[0]
    model.save_pretrained(folder)
    return dict(version=transformers.__version__, ids=ids[0].tolist(), logits=logits)


def main() -> None:
    """Command-line entry point: results of every folder, by folder, into OUT (torch.save)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--text", default="")
    parser.add_argument("--new-tokens", type=int, default=0)
    parser.add_argument("--make-llama", default=None)
    args = parser.parse_intermixed_args()
    results = {folder: read(folder, args.text, args.new_tokens) for folder in args.folders}
    if args.make_llama:
        results[args.make_llama] = make_llama(args.make_llama)
    torch.save(results, args.out)


if __name__ == "__main__":
    main()
