"""Export a GPT checkpoint (either layout, any TP x PP) as a Hugging Face GPT-2, LLaMA, Qwen2,
Qwen3, Mistral, Mixtral, GLM-4-MoE, Qwen3-MoE, Qwen2-MoE, gpt-oss, DeepSeek-V2 or DeepSeek-V3.

    python tools/checkpoint/convert_to_hf.py --load checkpoints/gpt2 --save hf/gpt2
    python tools/checkpoint/convert_to_hf.py --load checkpoints/moe --save hf/moe \
        --disable-moe-token-dropping --disable-moe-top2-2nd-expert-sampling

Writes `config.json` (`GPT2LMHeadModel` for GPT-2-shaped models; `LlamaForCausalLM` for
RMSNorm + SwiGLU + RoPE ones, grouped-query attention and an untied output layer included;
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `MistralForCausalLM` for such a model with
`--add-qkv-bias`, `--qk-layernorm` or `--window-size`, see
`megatron/checkpointing/huggingface_qwen_mistral.py` (Qwen3 loads in transformers 4.51+);
`MixtralForCausalLM` for such a model with top-2 DeepSpeed-MoE in every layer, or with
Megatron-LM's softmax-routed MoE in every layer; `Glm4MoeForCausalLM` for Megatron-LM's MoE
with DeepSeek-V3's router: sigmoid scores, expert bias, scaling factor, a shared expert, the
first layers dense, see `megatron/checkpointing/huggingface_glm4_moe.py`; it loads in
transformers 4.54+ or 5.x; `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` (see
`megatron/checkpointing/huggingface_qwen3_moe.py`); `GptOssForCausalLM` for Megatron-LM's MoE
in every layer with gpt-oss's biases, attention sinks, sliding windows, YaRN and clamped
quick-GeGLU experts (`megatron/checkpointing/huggingface_gpt_oss.py`; transformers 4.55+);
`DeepseekV3ForCausalLM` / `DeepseekV2ForCausalLM` for
`--multi-latent-attention` models with the V3 (sigmoid) or V2 (softmax over all experts)
router, or dense, V3 with its `--mtp-num-layers` modules in DeepSeek's layer-L layout, see
`megatron/checkpointing/huggingface_deepseek.py`),
`model.safetensors` and the tokenizer files (see `hf_tokenizer.py`), so that
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it
offline, with transformers 4.45+ or 5.x alike (config.json carries both releases' keys: see
`megatron/checkpointing/huggingface.py`). A model no such class computes exactly is refused
in one line naming what differs.
Mixtral computes every token with its two most probable experts; a checkpoint whose own
evaluation drops tokens past capacity or samples the second expert (DeepSpeed's defaults) is
refused unless `--disable-moe-token-dropping` / `--disable-moe-top2-2nd-expert-sampling` say to
export the model as it computes with them (see `megatron/checkpointing/huggingface_mixtral.py`).
The vocabulary is trimmed to the tokenizer's size (the padding rows are dropped).
The folder is written under `{save}.partial-{pid}` and renamed when complete; an existing
non-empty `--save` is refused unless `--force`. Needs `pip install transformers safetensors`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

from megatron.checkpointing.huggingface import (  # noqa: E402
    hf_architecture,
    hf_config_json,
    model_config,
    to_hf_weights,
)
from megatron.checkpointing.shapes import WORD_EMBEDDINGS  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    load_dense_checkpoint,
)
from tools.checkpoint import CONVERSION_ERRORS, require_hf_packages  # noqa: E402
from tools.checkpoint.hf_tokenizer import (  # noqa: E402
    TokenizerSource,
    tokenizer_source,
    write_tokenizer,
)
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
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece model file (or HFTokenizer folder); default: the checkpoint's.",
    )
    parser.add_argument("--force", action="store_true", help="Replace a non-empty --save.")
    parser.add_argument(
        "--disable-moe-token-dropping",
        action="store_true",
        help="Mixture-of-Experts: export the model as it computes without expert capacity "
        "(every token reaches its experts, as in Mixtral), whatever the checkpoint's flags.",
    )
    parser.add_argument(
        "--disable-moe-top2-2nd-expert-sampling",
        action="store_true",
        help="Mixture-of-Experts: export the model as it computes taking the second most "
        "probable expert instead of sampling it (Mixtral's top-2).",
    )
    return parser.parse_args(argv)


def check_destination(path: str, force: bool) -> None:
    """Refuse a `--save` that cannot be written, or a non-empty folder without `--force`."""
    check_output_path(path, "--save", is_folder=True)
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise CheckpointConversionError(
            f"--save {path} is not empty; choose another folder or pass --force"
        )


def write_folder(folder: str, dense: DenseCheckpoint, tokenizer: TokenizerSource) -> str:
    """config.json, model.safetensors and the tokenizer files of `dense` into `folder`.

    Returns the Hugging Face architecture written.
    """
    from safetensors.torch import save_file

    config = model_config(dense.args)
    architecture = hf_architecture(config)
    bos, eos = write_tokenizer(
        folder, tokenizer, config.max_position_embeddings, dense.true_vocab_size
    )
    weights = to_hf_weights(dense.state_dict, config)
    dtype = dense.state_dict[WORD_EMBEDDINGS].dtype
    coeff = dense.args.get("moe_loss_coeff")
    if dense.args.get("routed_moe"):  # Megatron-LM's --moe-aux-loss-coeff
        coeff = (dense.args.get("moe_aux_loss_coeff") or [None])[0]
    hf_config = hf_config_json(config, dense.true_vocab_size, bos, eos, dtype, coeff)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        handle.write(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    path = os.path.join(folder, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates it owner-only; the other files are 0644
    return architecture


def publish(staging: str, final: str) -> None:
    """Rename the complete `staging` folder to `final` (replacing what `--force` allowed)."""
    replaced = f"{final}.replaced-{os.getpid()}"
    if os.path.isdir(final):
        os.replace(final, replaced)
    os.replace(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)


def moe_overrides(args: argparse.Namespace) -> dict[str, bool]:
    """The checkpoint args the `--disable-moe-*` flags replace (Megatron's flag names)."""
    overrides = {}
    if args.disable_moe_token_dropping:
        overrides["moe_token_dropping"] = False
    if args.disable_moe_top2_2nd_expert_sampling:
        overrides["moe_top2_2nd_expert_sampling"] = False
    return overrides


def convert(args: argparse.Namespace) -> None:
    """Read `--load`, write the Hugging Face folder `--save`."""
    require_hf_packages("writing a Hugging Face folder")
    check_destination(args.save, args.force)
    print(f"reading checkpoint {args.load} ...", flush=True)
    dense = load_dense_checkpoint(args.load, args.iteration, args.true_vocab_size)
    dense.args.update(moe_overrides(args))
    print(
        f"read {dense.layout} checkpoint at iteration {dense.iteration}: tensor-parallel "
        f"{dense.args.get('tensor_model_parallel_size', 1)} x pipeline-parallel "
        f"{dense.args.get('pipeline_model_parallel_size', 1)}, vocabulary {dense.true_vocab_size}",
        flush=True,
    )
    hf_architecture(model_config(dense.args))  # refuses a model no HF class computes
    tokenizer = tokenizer_source(args, dense.args)
    save = os.path.abspath(args.save)
    staging = f"{save}.partial-{os.getpid()}"
    os.makedirs(os.path.dirname(save), exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        architecture = write_folder(staging, dense, tokenizer)
        publish(staging, save)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote Hugging Face {architecture} folder {args.save} (config, safetensors, tokenizer)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: convert(get_args(argv)), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
