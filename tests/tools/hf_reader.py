"""What the installed `transformers` reads from Hugging Face folders: ids, logits, greedy tokens.

    python tests/tools/hf_reader.py OUT.pt --text TEXT --new-tokens 8 DIR...
    python tests/tools/hf_reader.py OUT.pt --make-llama DIR
    python tests/tools/hf_reader.py OUT.pt --make-deepseek-v3 DIR
    python tests/tools/hf_reader.py OUT.pt --make-qwen2-moe DIR --make-qwen3-moe DIR
    python tests/tools/hf_reader.py OUT.pt --make-gpt-oss DIR

Imports only torch and transformers, so that a test can run it under transformers 4.x (a
subprocess with `tests.conftest.ensure_transformers_4()` first on PYTHONPATH) and call `read`
in-process under the installed 5.x. `--make-llama DIR` saves a random LLaMA (grouped-query
attention, untied output layer, RoPE base 500000) to DIR with this release's `save_pretrained`,
and its logits; `--make-deepseek-v3 DIR` likewise a random DeepSeek-V3 (MoE, MLA, YaRN),
`--make-qwen2-moe DIR` a Qwen2-MoE (gated shared expert, q/k/v biases, every other layer
dense), `--make-qwen3-moe DIR` a Qwen3-MoE, `--make-gpt-oss DIR` a gpt-oss (`GPT_OSS_SHAPE`:
sinks, windows on every other layer shorter than the ids, YaRN, clamped experts, biases).
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


def make_deepseek_v3(folder: str) -> dict:
    """Save a random DeepSeek-V3 (every weight and expert bias random, norms around 1, the
    biases positive; MLA
    with a query latent, DeepSeek's YaRN settings, top-4 within the best 2 of 4 groups, a
    shared expert, the first layer dense) with this `save_pretrained`; its logits [s, v]."""
    yarn = dict(
        factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1,
    )  # fmt: skip
    if transformers.__version__.startswith("4."):
        rope = dict(rope_theta=10000.0, rope_scaling=dict(yarn, type="yarn"))
    else:
        rope = dict(rope_parameters=dict(yarn, rope_type="yarn", rope_theta=10000.0))
    config = transformers.DeepseekV3Config(
        vocab_size=300, max_position_embeddings=64, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, tie_word_embeddings=False, **rope,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)
            if "e_score_correction_bias" in name:  # >= 0: see test_hf_deepseek.py
                tensor.abs_()
        ids = torch.randint(0, config.vocab_size, (1, 24))
        logits = model(ids).logits[0]
    model.save_pretrained(folder)
    return dict(version=transformers.__version__, ids=ids[0].tolist(), logits=logits)


def make_qwen_moe(folder: str, model_type: str) -> dict:
    """Save a random Qwen2-MoE or Qwen3-MoE (`model_type`; every weight random, norms around 1;
    top-3 of 8 renormalized, every other layer an MoE layer by decoder_sparse_step 2) with this
    `save_pretrained`; its logits [s, v]."""
    shape = dict(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
        decoder_sparse_step=2, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**shape, shared_expert_intermediate_size=48)
        model_class = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**shape, head_dim=16)
        model_class = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(6)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)
        ids = torch.randint(0, config.vocab_size, (1, 24))
        logits = model(ids).logits[0]
    model.save_pretrained(folder)
    return dict(version=transformers.__version__, ids=ids[0].tolist(), logits=logits)


GPT_OSS_YARN = dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=8.0,
    beta_slow=1.0, truncate=False,
)  # fmt: skip
"""YaRN whose ramp (between channels 1.4 and 3.2 of head_dim 16's 8) the truncation would move."""
GPT_OSS_SHAPE = dict(
    vocab_size=300, max_position_embeddings=1024, hidden_size=64, intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False,
)  # fmt: skip
"""A tiny gpt-oss: the default layer_types (windowed, full, windowed, full), 8-key windows."""


def make_gpt_oss(folder: str, seed: int = 7) -> dict:
    """Save a random gpt-oss (`GPT_OSS_SHAPE`, `GPT_OSS_YARN` at RoPE base 10000; every weight,
    sink and bias random, norms around 1, the experts' gate_up wide enough that the clamp
    acts) with this `save_pretrained`, eager attention; its logits [s, v] on 24 random ids."""
    if transformers.__version__.startswith("4."):
        rope = dict(rope_theta=10000.0, rope_scaling=dict(GPT_OSS_YARN))
    else:
        rope = dict(rope_parameters=dict(GPT_OSS_YARN, rope_theta=10000.0))
    config = transformers.GptOssConfig(**GPT_OSS_SHAPE, **rope, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            scale = 0.6 if name.endswith("gate_up_proj") else 0.1
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * scale)
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
    parser.add_argument("--make-deepseek-v3", default=None)
    parser.add_argument("--make-qwen2-moe", default=None)
    parser.add_argument("--make-qwen3-moe", default=None)
    parser.add_argument("--make-gpt-oss", default=None)
    args = parser.parse_intermixed_args()
    results = {folder: read(folder, args.text, args.new_tokens) for folder in args.folders}
    if args.make_llama:
        results[args.make_llama] = make_llama(args.make_llama)
    if args.make_deepseek_v3:
        results[args.make_deepseek_v3] = make_deepseek_v3(args.make_deepseek_v3)
    for model_type in ("qwen2_moe", "qwen3_moe"):
        folder = getattr(args, f"make_{model_type}")
        if folder:
            results[folder] = make_qwen_moe(folder, model_type)
    if args.make_gpt_oss:
        results[args.make_gpt_oss] = make_gpt_oss(args.make_gpt_oss)
    torch.save(results, args.out)


if __name__ == "__main__":
    main()
