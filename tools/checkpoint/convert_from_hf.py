"""Import a Hugging Face GPT-2, LLaMA, Qwen2, Qwen3, Mistral, Mixtral, GLM-4-MoE, Qwen3-MoE,
Qwen2-MoE, gpt-oss, DeepSeek-V2 or DeepSeek-V3 folder as a Megatron-layout `release` checkpoint.

    python tools/checkpoint/convert_from_hf.py --load hf/gpt2 --save checkpoints/gpt2_tp2 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
    python pretrain_gpt.py --load checkpoints/gpt2_tp2 --finetune --tensor-model-parallel-size 2 \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 ...   # the flags printed

Reads `config.json` and the weights (safetensors or pytorch_model.bin) with `GPT2LMHeadModel` /
`LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `MistralForCausalLM` /
`MixtralForCausalLM` / `Glm4MoeForCausalLM` / `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` /
`GptOssForCausalLM` / `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM.from_pretrained` (by the
config's `model_type`), refuses what our GPT cannot compute (GPT-2: other
activations, an untied output layer, cross-attention, unscaled or layer-scaled attention; LLaMA,
Mixtral and GLM-4-MoE: RoPE scaling, activations other than silu, attention and MLP biases that
differ; LLaMA and Mixtral: partial RoPE; Mixtral: a sliding window shorter than the positions;
GLM-4-MoE: QK norm, q/k/v biases, groups ranked otherwise than ours; Qwen3-MoE and Qwen2-MoE
(`huggingface_qwen3_moe.py`): attention biases other than Qwen2-MoE's q/k/v ones, a sliding window;
gpt-oss (`huggingface_gpt_oss_import.py`): another `swiglu_alpha`, a YaRN `attention_factor`
other than 0.1 ln(factor) + 1, rotary types but YaRN and plain RoPE), and writes the checkpoint
with args complete enough for
`pretrain_gpt.py --load` to build the same model (LLaMA: RMSNorm, SwiGLU, RoPE theta, key/value
heads, untied output layer, no linear biases; Qwen2: `--add-qkv-bias`; Qwen3: `--qk-layernorm`;
Mistral: `--window-size`, see `megatron/checkpointing/huggingface_qwen_mistral.py`, which also says
what of theirs is refused: the Qwens' sliding window, Qwen3's `attention_bias`) and tokenizer.

Mixture-of-Experts models become Megatron-LM's MoE (`--moe-family megatron`, the default: the
printed flags carry `--moe-router-topk`, which picks it, and train on any engine at TP 1, with
pipeline stages if wanted) or DeepSpeed-MoE (`--moe-family deepspeed`: `--topk`, under
`--deepspeed --no-pipeline-parallel`; Mixtral at top-2 only, without token dropping or second-
expert sampling, as Mixtral computes). Mixtral: experts in every layer, softmax top-k.
GLM-4-MoE (DeepSeek-V3's MoE beside grouped-query attention, `huggingface_glm4_moe.py`):
sigmoid router in fp32 with expert bias, scaling factor, shared expert, the first layers dense
(`--moe-layer-freq "([0]*k+[1]*n)"`), partial RoPE (`--rotary-percent`), group-limited routing.
DeepSeek-V3 / V2 (`huggingface_deepseek.py`): `--multi-latent-attention` with its shapes and
YaRN, the V3 router as GLM's, V2's softmax over all experts (`--moe-router-pre-softmax`);
DeepSeek-V3's multi-token prediction modules (layers num_hidden_layers and on, read from the
safetensors files) become `--mtp-num-layers`.
gpt-oss: Megatron-LM's MoE with biases, `--softmax-type learnable` (attention sinks),
`--window-size` on the `layer_types` windowed (`--window-attn-skip-freq`), YaRN
(`--position-embedding-type yarn` and its flags), `--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value` (the experts' clamped activation).
A config.json may come from transformers 4 (top-level `rope_theta`, `partial_rotary_factor`,
`rope_scaling`) or 5 (`rope_parameters`); one whose values disagree between the places is
refused.
The vocabulary is padded to a multiple of `--make-vocab-size-divisible-by` x TP.
Needs `pip install transformers safetensors` (GLM-4-MoE: transformers 4.54 or later;
gpt-oss: 4.55; DeepSeek-V2/V3: 4.57).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 2)))

from megatron.checkpointing.huggingface import (  # noqa: E402
    from_hf_state_dict,
    megatron_args_from_hf,
    model_config,
)
from megatron.checkpointing.huggingface_deepseek import (  # noqa: E402
    MODEL_TYPES as DEEPSEEK_TYPES,
)
from megatron.checkpointing.huggingface_deepseek_import import (  # noqa: E402
    from_deepseek_state_dict,
    megatron_args_from_deepseek,
    mtp_layers_in,
)
from megatron.checkpointing.huggingface_glm4_moe import (  # noqa: E402
    from_glm4_moe_state_dict,
    megatron_args_from_glm4_moe,
)
from megatron.checkpointing.huggingface_gpt_oss import from_gpt_oss_state_dict  # noqa: E402
from megatron.checkpointing.huggingface_gpt_oss_import import (  # noqa: E402
    megatron_args_from_gpt_oss,
)
from megatron.checkpointing.huggingface_llama import (  # noqa: E402
    from_llama_state_dict,
    megatron_args_from_llama,
)
from megatron.checkpointing.huggingface_mixtral import (  # noqa: E402
    MOE_FAMILIES,
    from_mixtral_state_dict,
    megatron_args_from_mixtral,
)
from megatron.checkpointing.huggingface_qwen3_moe import (  # noqa: E402
    from_qwen3_moe_state_dict,
    megatron_args_from_qwen3_moe,
)
from megatron.checkpointing.huggingface_qwen_mistral import (  # noqa: E402
    megatron_args_from_mistral,
    megatron_args_from_qwen2,
    megatron_args_from_qwen3,
)
from megatron.checkpointing.layouts import holds_checkpoint  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    save_megatron_checkpoint,
)
from tools.checkpoint import CONVERSION_ERRORS, require_hf_packages  # noqa: E402
from tools.checkpoint.hf_import_flags import model_flags  # noqa: E402
from tools.checkpoint.hf_tokenizer import imported_tokenizer_args  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--load",
        required=True,
        help="Hugging Face GPT-2, LLaMA, Qwen2, Qwen3, Mistral, Mixtral, GLM-4-MoE, Qwen3-MoE, "
        "Qwen2-MoE, gpt-oss, DeepSeek-V2 or DeepSeek-V3 folder.",
    )
    parser.add_argument("--save", required=True, help="Checkpoint directory to write.")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument(
        "--seq-length", type=int, default=None, help="Recorded in args; default n_positions."
    )
    parser.add_argument(
        "--force", action="store_true", help="Overwrite a checkpoint already in --save."
    )
    parser.add_argument(
        "--moe-family",
        choices=MOE_FAMILIES,
        default="megatron",
        help="Mixture-of-Experts models: write Megatron-LM's MoE (trained with --num-experts "
        "and --moe-router-topk; the default) or DeepSpeed-MoE (--num-experts with --topk "
        "under --deepspeed; Mixtral at top-2 only).",
    )
    args = parser.parse_args(argv)
    check_output_path(args.save, "--save", is_folder=True)
    return args


def read_hf_config(folder: str) -> dict:
    """config.json of `folder` as a dict, after checking the folder exists."""
    if not os.path.isdir(folder):
        raise CheckpointConversionError(f"--load {folder} is not a directory")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointConversionError(f"--load {folder} has no config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except ValueError as error:  # bad JSON, or not UTF-8
        raise CheckpointConversionError(f"--load {path}: not a JSON config ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointConversionError(f"--load {path}: expected a JSON object")
    return config


LLAMA_SHAPE = (
    "num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, "
    "max_position_embeddings and vocab_size"
)
SHAPE_FIELDS = {
    "gpt2": "n_layer, n_embd, n_head, n_positions and vocab_size",
    **dict.fromkeys(
        (
            "llama",
            "qwen2",
            "qwen3",
            "mistral",
            "mixtral",
            "glm4_moe",
            "qwen3_moe",
            "qwen2_moe",
            "gpt_oss",
        ),
        LLAMA_SHAPE,
    ),
    **dict.fromkeys(
        DEEPSEEK_TYPES,
        LLAMA_SHAPE + ", kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
        "v_head_dim, n_routed_experts, num_experts_per_tok and moe_intermediate_size",
    ),
}
"""What each family's config.json must list (save_pretrained writes them all)."""
ARGS_FROM_HF = {
    "gpt2": megatron_args_from_hf,
    "llama": megatron_args_from_llama,
    "qwen2": megatron_args_from_qwen2,
    "qwen3": megatron_args_from_qwen3,
    "mistral": megatron_args_from_mistral,
    "mixtral": megatron_args_from_mixtral,
    "glm4_moe": megatron_args_from_glm4_moe,
    "qwen3_moe": megatron_args_from_qwen3_moe,
    "qwen2_moe": megatron_args_from_qwen3_moe,  # by its model_type
    "gpt_oss": megatron_args_from_gpt_oss,
    **dict.fromkeys(DEEPSEEK_TYPES, megatron_args_from_deepseek),
}
"""Each family's Megatron args from its config.json (GPT-2's also refuses other types)."""
MOE_MODEL_TYPES = ("mixtral", "glm4_moe", "qwen3_moe", "qwen2_moe", "gpt_oss", *DEEPSEEK_TYPES)
"""The families whose args take `--moe-family`."""
FROM_HF = {
    "llama": from_llama_state_dict,
    "qwen2": from_llama_state_dict,
    "qwen3": from_llama_state_dict,
    "mistral": from_llama_state_dict,
    "mixtral": from_mixtral_state_dict,
    "glm4_moe": from_glm4_moe_state_dict,
    "qwen3_moe": from_qwen3_moe_state_dict,
    "qwen2_moe": from_qwen3_moe_state_dict,
    "gpt_oss": from_gpt_oss_state_dict,
    "deepseek_v3": from_deepseek_state_dict,
    "deepseek_v2": lambda state, config: from_deepseek_state_dict(state, config, v3=False),
}
"""Each family's weights (but GPT-2's) as our state dict."""


def read_hf_model(folder: str, model_type: str) -> tuple[dict, dict]:
    """(config dict, state dict) of the GPT-2, LLaMA, Qwen2, Qwen3, Mistral, Mixtral,
    GLM-4-MoE, Qwen3-MoE, Qwen2-MoE, gpt-oss or DeepSeek-V2/V3 in `folder`, loaded offline."""
    import transformers

    names = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "gpt_oss": "GptOssForCausalLM",
        **DEEPSEEK_TYPES,
    }
    name = names.get(model_type, "GPT2LMHeadModel")
    if not hasattr(transformers, name):
        raise CheckpointConversionError(
            f"--load {folder}: {model_type} needs transformers with {name} (4.51 or later for "
            f"Qwen3, 4.54 for GLM-4-MoE, 4.55 for gpt-oss, 4.57 for DeepSeek-V2/V3); this is "
            f"{transformers.__version__}"
        )
    model_class = getattr(transformers, name)
    model = model_class.from_pretrained(folder, local_files_only=True)
    return model.config.to_dict(), dict(model.state_dict())


def safetensors_names(folder: str) -> dict[str, str]:
    """Every weight name in `folder`'s safetensors files, with the file holding it."""
    from safetensors import safe_open

    names = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="pt") as handle:
                names.update(dict.fromkeys(handle.keys(), file))
    return names


def deepseek_mtp_weights(folder: str, num_layers: int, depth: int) -> dict:
    """DeepSeek's multi-token prediction modules (layers num_layers .. + depth - 1), read from
    the safetensors files: transformers' causal LM leaves them unread."""
    from safetensors import safe_open

    wanted = tuple(f"model.layers.{num_layers + k}." for k in range(depth))
    by_file: dict[str, list[str]] = {}
    for name, file in safetensors_names(folder).items():
        if name.startswith(wanted):
            by_file.setdefault(file, []).append(name)
    found: dict = {}
    for file, names in by_file.items():  # each file opened once
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in names})
    return found


def mtp_depth(args: argparse.Namespace, hf_config: dict) -> int:
    """How many of DeepSeek-V3's multi-token prediction modules `--load` holds; says so when
    config.json announces more than its weights hold."""
    if hf_config.get("model_type") != "deepseek_v3":
        return 0
    layers = hf_config.get("num_hidden_layers", 0)
    found = mtp_layers_in(list(safetensors_names(args.load)), layers)
    announced = hf_config.get("num_nextn_predict_layers") or 0
    if announced > found:
        print(
            f"note: config.json has num_nextn_predict_layers={announced} but the weights hold "
            f"{found} multi-token prediction module(s) (model.layers.{layers + found}.eh_proj "
            f"is absent); imported with --mtp-num-layers {found}",
            flush=True,
        )
    return found


def checkpoint_args(args: argparse.Namespace, hf_config: dict) -> dict:
    """The Megatron args of the model `hf_config` describes; raises naming what is missing."""
    model_type = hf_config.get("model_type")
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    build = ARGS_FROM_HF.get(model_type, megatron_args_from_hf)
    family = {"moe_family": args.moe_family} if model_type in MOE_MODEL_TYPES else {}
    if model_type in DEEPSEEK_TYPES:
        family["mtp_layers"] = mtp_depth(args, hf_config)
    try:
        return build(
            hf_config, tp, pp, args.make_vocab_size_divisible_by, args.seq_length, **family
        )
    except KeyError as missing:
        fields = SHAPE_FIELDS.get(model_type, SHAPE_FIELDS["gpt2"])
        raise CheckpointConversionError(
            f"--load {args.load}: config.json has no {missing} (a {model_type} config lists "
            f"{fields})"
        ) from None


def read_hf_folder(args: argparse.Namespace) -> DenseCheckpoint:
    """The Hugging Face model of `--load` as our dense checkpoint (full size, release args)."""
    hf_config = read_hf_config(args.load)
    megatron_args = checkpoint_args(args, hf_config)
    model_type = hf_config["model_type"]
    print(f"reading Hugging Face {model_type} {args.load} ...", flush=True)
    hf_config, hf_state = read_hf_model(args.load, model_type)
    if megatron_args.get("mtp_num_layers"):
        layers, depth = megatron_args["num_layers"], megatron_args["mtp_num_layers"]
        hf_state.update(deepseek_mtp_weights(args.load, layers, depth))
    tokenizer = imported_tokenizer_args(args.load)
    if tokenizer["tokenizer_type"] is not None:
        megatron_args.update(tokenizer)
    if model_type == "gpt2":
        state = from_hf_state_dict(hf_state, megatron_args["num_attention_heads"])
    else:
        state = FROM_HF[model_type](hf_state, model_config(megatron_args))
    print(
        f"read {megatron_args['num_layers']} layers, hidden {megatron_args['hidden_size']}, "
        f"{megatron_args['num_attention_heads']} heads, vocabulary {hf_config['vocab_size']}",
        flush=True,
    )
    return DenseCheckpoint(
        state_dict=state,
        args=megatron_args,
        iteration=0,
        true_vocab_size=hf_config["vocab_size"],
        layout="huggingface",
    )


def convert(args: argparse.Namespace) -> None:
    """Read the Hugging Face folder `--load`, write `--save` in Megatron's layout."""
    require_hf_packages("reading a Hugging Face folder")
    read_hf_config(args.load)
    if holds_checkpoint(args.save) and not args.force:
        raise CheckpointConversionError(
            f"--save {args.save} already holds a checkpoint; choose another directory or pass "
            "--force to replace it"
        )
    dense = read_hf_folder(args)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    directory = save_megatron_checkpoint(
        dense, args.save, tp, pp, args.make_vocab_size_divisible_by, overwrite=args.force
    )
    print(
        f"wrote Megatron checkpoint {directory}: tensor-parallel {tp} x pipeline-parallel {pp}",
        flush=True,
    )
    flags = model_flags(dense.args)
    print(f"train from it with: pretrain_gpt.py --load {args.save} --finetune {flags}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: convert(get_args(argv)), CONVERSION_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
