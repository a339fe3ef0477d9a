"""Oracle job: megatron-core's DeepSeek-V3 parts on CPU (run with megatron-core as `megatron`):
multi-latent attention, and the router's top-k with group-limited routing.

    python megatron_core_mla.py OUT PORT

For each case, megatron-core 0.16.1's `MLASelfAttention` from its local spec, seeded, run forward
and backward on a fixed input; OUT gets {case: {"weights", "x", "out", "grads"}} for
tests/oracle/test_megatron_core_mla.py. Two things released megatron-core needs on a machine
without Transformer Engine and a GPU, neither touching its arithmetic: its YaRN frequencies are
built on `torch.cuda.current_device()` (pointed at the CPU here), and its MLA checks
`isinstance(..., TELinear)` with TELinear None (a class no layer is, here). Its local
`DotProductAttention` takes no key width other than the value's, so the core attention is a
causal SDPA at the softmax scale MLA hands it (megatron-core's own, YaRN's mscale included).
"""

from __future__ import annotations

import os
import sys

import torch

torch.cuda.current_device = lambda: "cpu"

CASES = {
    "yarn": dict(q_lora_rank=24, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.707,
                 mscale_all_dim=1.0, original_max_position_embeddings=4),
    "lite": dict(q_lora_rank=None, rope_type="rope"),
}  # fmt: skip
SHAPE = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, qk_head_dim=12,
             qk_pos_emb_head_dim=8, v_head_dim=10)  # fmt: skip
SEQ, BATCH = 8, 2
ROUTING = {
    "sigmoid, bias, groups (DeepSeek-V3)": dict(topk=4, num_groups=4, group_topk=2,
        score_function="sigmoid", scaling_factor=2.5, experts=16, bias=True),
    "softmax before the top-k, groups": dict(topk=2, num_groups=4, group_topk=2,
        use_pre_softmax=True, experts=8),
    "softmax after the top-k, groups": dict(topk=4, num_groups=2, group_topk=1, experts=8),
}  # fmt: skip
"""megatron-core's `topk_routing_with_score_function` keywords (and the experts, whether an
expert bias is added) of each routing case: OUT["routing"][case] holds its logits, bias,
routing weights and map."""


def routing_cases() -> dict:
    """megatron-core's routing of seeded logits for every `ROUTING` case."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    results = {}
    for case, fields in ROUTING.items():
        fields = dict(fields)
        experts, with_bias = fields.pop("experts"), fields.pop("bias", False)
        generator = torch.Generator().manual_seed(len(results))
        logits = torch.randn(64, experts, generator=generator)
        bias = torch.randn(experts, generator=generator) * 0.1 if with_bias else None
        probs, routing_map = topk_routing_with_score_function(logits, expert_bias=bias, **fields)
        results[case] = {"logits": logits, "bias": bias, "probs": probs, "map": routing_map}
    return results


class CausalCore(torch.nn.Module):
    """[s, b, n, d] query/key, [s, b, n, dv] value -> [s, b, n * dv], causal, at MLA's scale."""

    def __init__(self, softmax_scale=None, **_) -> None:  # noqa: ANN001, ANN003
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, mask, **_) -> torch.Tensor:  # noqa: ANN001, ANN003
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale
        )
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


def main() -> None:
    """Run every case; save what the test compares."""
    import torch.distributed as dist

    out_path, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo")
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.core import parallel_state

    for name in ("TELinear", "TEColumnParallelLinear", "Linear"):
        if hasattr(mla_module, name) and not isinstance(getattr(mla_module, name), type):
            setattr(mla_module, name, type(f"No{name}", (), {}))
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for case, fields in CASES.items():
        config = MLATransformerConfig(
            num_layers=1, normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
            add_bias_linear=False, use_cpu_initialization=True, attention_dropout=0.0,
            hidden_dropout=0.0, init_method_std=0.2, **SHAPE, **fields,
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(
            multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
        )
        spec.submodules.self_attention.submodules.core_attention = CausalCore
        torch.manual_seed(0)
        attention = build_module(spec.submodules.self_attention, config=config, layer_number=1)
        with torch.no_grad():
            for name, param in attention.named_parameters():
                if "layernorm" in name:
                    param.uniform_(0.5, 1.5)
        x = torch.randn(SEQ, BATCH, SHAPE["hidden_size"], requires_grad=True)
        out, _ = attention(x, None)
        out.pow(2).sum().backward()
        results[case] = {
            "weights": {n: p.detach().clone() for n, p in attention.named_parameters()},
            "x": x.detach().clone(),
            "out": out.detach().clone(),
            "grads": {"x": x.grad.clone()}
            | {n: p.grad.clone() for n, p in attention.named_parameters()},
        }
    results["routing"] = routing_cases()
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
