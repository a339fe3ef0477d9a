"""`--recompute-granularity selective --recompute-modules ...` (Megatron-LM's list): each
choice leaves the losses and every gradient bit-identical (dropout on: the recomputation
replays the forward's random streams; with `layernorm` the gradients within fp32 reordering:
the residual stream's gradient then adds the norm's two inner paths before the skip
connection's, not after) and keeps fewer bytes for the backward than
recomputing the core attention alone, counted exactly from what autograd saves (the storages
alive after the forward: a discarded output's is freed, `output_discarding.py`)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import MLAConfig, RoutedMoEConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from tests.model.helpers import random_batch, tiny_config

MODEL = dict(
    num_layers=2,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    activation="swiglu",
    normalization="rmsnorm",
    add_bias_linear=False,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                  v_head_dim=8),
    routed_moe=RoutedMoEConfig(num_experts=4, moe_layers=(False, True), top_k=2,
                               shared_expert_ffn_hidden_size=24, aux_loss_coeff=1e-2),
)  # fmt: skip
"""DeepSeek-V3's kinds of layer: MLA, a dense first layer, then routed experts with a shared one."""
CHOICES = ["mlp", "moe", "shared_experts", "moe_act", "layernorm", "mla_up_proj"]


def _run(modules: tuple[str, ...] | None) -> tuple[torch.Tensor, dict, int]:
    """Loss, gradients and the bytes saved for the backward of one training step."""
    granularity = None if modules is None else "selective"
    config = tiny_config(
        **MODEL, recompute_granularity=granularity, recompute_modules=modules or ("core_attn",)
    )
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config).train()
    tokens, labels = random_batch(2, 16, config.vocab_size)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, labels=labels).mean()
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept = sum(size for pointer, size in storages.items() if pointer not in parameters)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return loss.detach(), grads, kept


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, dict, int]:
    return _run(None)


@pytest.fixture(scope="module")
def core_attention_only() -> tuple[torch.Tensor, dict, int]:
    return _run(("core_attn",))


@pytest.mark.parametrize("module", CHOICES)
def test_each_module_recomputes_the_same_numbers_and_keeps_less(
    module: str, reference, core_attention_only
) -> None:
    loss, grads, kept = _run(("core_attn", module))
    assert torch.equal(loss, reference[0])
    _assert_same_gradients(grads, reference[1], exact=module != "layernorm")
    assert kept < core_attention_only[2] < reference[2], (kept, core_attention_only[2])


def test_all_of_them_together() -> None:
    loss, grads, kept = _run(("core_attn", *CHOICES))
    reference_loss, reference_grads, reference_kept = _run(None)
    assert torch.equal(loss, reference_loss)
    _assert_same_gradients(grads, reference_grads, exact=False)
    assert kept < reference_kept


def _assert_same_gradients(grads: dict, expected: dict, exact: bool) -> None:
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        if exact:
            assert torch.equal(grads[name], grad), name
        else:
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-9, msg=name)
