"""FP8 matmuls (megatron.model.fp8) against torchao's own FP8 linear layer, and TP=2 vs TP=1.

At one rank a layer's FP8 matmul is torchao's `Float8Linear` arithmetic exactly (the same
casts, the same scaled matmul), so outputs and gradients are compared bitwise. Under tensor
parallelism each rank scales its own shard (as Transformer Engine's current scaling does):
a column- or row-parallel layer equals torchao's layer applied to each rank's shard, put
together (concatenated, or summed), in one spawned 2-rank world. A whole GPT at TP=2 then
equals TP=1 to FP8's precision (other shard scales round other elements), not bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import Fp8Config
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_cuda_manual_seed,
)
from megatron.model.fp8 import Float8Matmul, fp8_report, import_torchao_float8
from tests.model.helpers import (
    build_model,
    full_grads,
    loss_and_grads,
    random_batch,
    spawn_collect,
    tiny_config,
)

HYBRID = Fp8Config()
FORMATS = {"hybrid": HYBRID, "e4m3": Fp8Config(format="e4m3")}
GPT = dict(hidden_size=64, num_attention_heads=4, vocab_size=128, use_cpu_initialization=True)
# LLaMA's shape: SwiGLU (a stride-2 column split), RMSNorm, rotary, no biases, GQA, untied.
LLAMA = dict(
    activation="swiglu",
    normalization="rmsnorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    num_key_value_heads=2,
    ffn_hidden_size=128,
    untie_embeddings_and_output_weights=True,
)
BATCH, SEQ = 2, 16


def torchao_linear(weight: torch.Tensor, config: Fp8Config, bias: torch.Tensor | None = None):
    """torchao's Float8Linear holding a copy of `weight` (and `bias`): the reference."""
    _, float8_linear = import_torchao_float8()
    out_features, in_features = weight.shape
    layer = float8_linear.Float8Linear(
        in_features,
        out_features,
        bias=bias is not None,
        config=Float8Matmul(config).torchao_config,
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def run_linear(forward, params: list[torch.Tensor], input_: torch.Tensor, grad_seed: int = 3):
    """(output, input grad, param grads) of forward(input) against a fixed output gradient."""
    input_ = input_.detach().clone().requires_grad_(True)
    output = forward(input_)
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(grad_seed))
    output.backward(grad)
    return output.detach(), input_.grad, [param.grad.clone() for param in params]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_matmul_is_torchaos_float8_linear_bitwise(name: str) -> None:
    config = FORMATS[name]
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 32))
    bias = torch.nn.Parameter(torch.randn(48))
    input_ = torch.randn(4, 8, 32)
    ours = run_linear(lambda x: Float8Matmul(config)(x, weight, bias), [weight, bias], input_)
    reference = torchao_linear(weight.detach(), config, bias.detach())
    theirs = run_linear(reference, [reference.weight, reference.bias], input_)
    for mine, its in zip((ours[0], ours[1], *ours[2]), (theirs[0], theirs[1], *theirs[2])):
        assert torch.equal(mine, its)
    # And FP8 it is: far from the fp32 product, within E4M3's rounding of its operands.
    exact = torch.nn.functional.linear(input_, weight.detach(), bias.detach())
    error = (ours[0] - exact).norm() / exact.norm()
    assert 1e-3 < error < 2 * 2.0**-4, error


def test_formats_differ_in_the_gradients_only() -> None:
    """hybrid casts output gradients to E5M2, e4m3 to E4M3: same forward, other backward."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 32))
    input_ = torch.randn(64, 32)
    hybrid = run_linear(lambda x: Float8Matmul(HYBRID)(x, weight), [weight], input_)
    weight.grad = None
    e4m3 = run_linear(lambda x: Float8Matmul(FORMATS["e4m3"])(x, weight), [weight], input_)
    assert torch.equal(hybrid[0], e4m3[0])
    assert not torch.equal(hybrid[1], e4m3[1])


def test_high_precision_weight_gradient() -> None:
    """--no-fp8-wgrad: the weight gradient is the unquantized product grad^T x."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 32))
    input_ = torch.randn(64, 32)
    _, _, (grad,) = run_linear(
        lambda x: Float8Matmul(Fp8Config(wgrad=False))(x, weight), [weight], input_
    )
    output_grad = torch.randn((64, 48), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(grad, output_grad.t() @ input_)


def test_autocast_output_is_the_half_type_and_weights_keep_their_dtype() -> None:
    weight = torch.nn.Parameter(torch.randn(48, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = Float8Matmul(HYBRID)(torch.randn(16, 32), weight)
    output.float().sum().backward()
    assert output.dtype == torch.bfloat16
    assert weight.grad.dtype == torch.float32


def test_fp8_covers_the_transformer_layers_linear_layers_only() -> None:
    model = build_model(tiny_config(fp8=HYBRID, num_layers=3))
    report = fp8_report(model)
    assert "12 of this rank's 12 tensor-parallel linear layers" in report, report
    assert "hybrid tensorwise (torchao)" in report
    kept = build_model(
        tiny_config(fp8=Fp8Config(bf16_layers_at_start=1, bf16_layers_at_end=1), num_layers=3)
    )
    in_fp8 = [
        name
        for name, module in kept.named_modules()
        if getattr(module, "fp8_matmul", None) is not None
    ]
    assert in_fp8 and all(".layers.1." in name for name in in_fp8), in_fp8
    untied = build_model(tiny_config(fp8=HYBRID, untie_embeddings_and_output_weights=True))
    assert untied.language_model.output_layer.fp8_matmul is None


# --- one spawned 2-rank world: parallel layers, then the whole GPT at TP=1 and TP=2 ----------


def _gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dim)


def _parallel_layers(rank: int) -> dict[str, object]:
    """Each layer's output and gradients, and torchao's layer on this rank's shard."""
    torch.manual_seed(0)
    results: dict[str, object] = {}
    init = torch.nn.init.normal_
    for sp in (False, True):
        column = ColumnParallelLinear(
            32, 64, init, sequence_parallel=sp, use_cpu_initialization=True
        )
        column.fp8_matmul = Float8Matmul(HYBRID)
        full_input = torch.randn(16, 2, 32)  # [s, b, h]: the same on both ranks (seeded)
        local_input = full_input.chunk(2)[rank] if sp else full_input
        output, input_grad, (weight_grad, _) = run_linear(
            lambda x, c=column: c(x)[0], [column.weight, column.bias], local_input
        )
        reference = torchao_linear(column.weight.detach(), HYBRID, column.bias.detach())
        ref_out, ref_input_grad, (ref_weight_grad, _) = run_linear(
            reference, [reference.weight, reference.bias], full_input
        )
        results[f"column-sp{sp}"] = dict(
            output=output,
            weight_grad=weight_grad,
            ref_output=ref_out,
            ref_weight_grad=ref_weight_grad,
            input_grad=input_grad,
            ref_input_grad_shard=ref_input_grad,
        )
    row = RowParallelLinear(64, 32, init, input_is_parallel=True, use_cpu_initialization=True)
    row.fp8_matmul = Float8Matmul(HYBRID)
    full_input = torch.randn(16, 2, 64)
    local_input = full_input.chunk(2, dim=-1)[rank]
    output, input_grad, (weight_grad, bias_grad) = run_linear(
        lambda x: row(x)[0], [row.weight, row.bias], local_input
    )
    reference = torchao_linear(row.weight.detach(), HYBRID)
    partial, ref_input_grad, (ref_weight_grad,) = run_linear(
        reference, [reference.weight], local_input
    )
    results["row"] = dict(
        output=output,
        partials=_gather(partial.unsqueeze(0), 0),
        bias=row.bias.detach(),
        input_grad=input_grad,
        ref_input_grad=ref_input_grad,
        weight_grad=weight_grad,
        ref_weight_grad=ref_weight_grad,
    )
    return results


def _gpt(fp8: Fp8Config | None, sequence_parallel: bool = False, **shape) -> dict[str, object]:
    tokens, labels = random_batch(BATCH, SEQ, GPT["vocab_size"])
    model = build_model(tiny_config(**GPT, **shape, fp8=fp8, sequence_parallel=sequence_parallel))
    losses, grads = loss_and_grads(model, tokens, labels)
    return dict(loss=losses.mean(), grads=full_grads(model, grads))


def fp8_world(rank: int, world: int) -> dict[str, object]:
    """The parallel-layer checks at TP=2; the GPT at TP=1 (fp32 and FP8) and TP=2 (FP8)."""
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(11)
    results = _parallel_layers(rank)
    results["tp2"] = _gpt(HYBRID)
    results["tp2-sp"] = _gpt(HYBRID, sequence_parallel=True)
    results["tp2-llama"] = _gpt(HYBRID, **LLAMA)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(11)
    results["tp1"] = _gpt(HYBRID)
    results["tp1-fp32"] = _gpt(None)
    results["tp1-llama"] = _gpt(HYBRID, **LLAMA)
    results["tp1-llama-fp32"] = _gpt(None, **LLAMA)
    parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world() -> list[dict]:
    """Results of the 2-rank world, by rank."""
    return spawn_collect(fp8_world, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_column_parallel_is_torchao_on_each_shard(world, sp: bool) -> None:
    """Output columns and weight gradients: torchao's layer on the shard, bitwise; the input
    gradient: the sum over ranks of torchao's on each shard (reduce-scattered under SP)."""
    ranks = [rank[f"column-sp{sp}"] for rank in world]
    for rank in ranks:
        assert torch.equal(rank["output"], rank["ref_output"])
        assert torch.equal(rank["weight_grad"], rank["ref_weight_grad"])
    # The references of the input gradient: each rank's shard's, summed over the 2 ranks.
    summed = ranks[0]["ref_input_grad_shard"] + ranks[1]["ref_input_grad_shard"]
    for index, rank in enumerate(ranks):
        expected = summed.chunk(2)[index] if sp else summed
        torch.testing.assert_close(rank["input_grad"], expected, rtol=0, atol=1e-5)


def test_row_parallel_is_the_sum_of_torchao_on_each_shard(world) -> None:
    for rank in world:
        row = rank["row"]
        expected = row["partials"].sum(0) + row["bias"]
        torch.testing.assert_close(row["output"], expected, rtol=0, atol=1e-5)
        assert torch.equal(row["input_grad"], row["ref_input_grad"])
        assert torch.equal(row["weight_grad"], row["ref_weight_grad"])


# E5M2's unit roundoff (2 mantissa bits): hybrid's output gradients are rounded to it.
E5M2_ROUNDOFF = 2.0**-3


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "tp2-llama"])
def test_gpt_at_tp2_equals_tp1_to_fp8_precision(world, layout: str) -> None:
    """Loss and gradients of TP=2 against TP=1, both in FP8. Each rank scales its own shard,
    so other elements round: each run's gradients sit within about E5M2's roundoff of the
    exact ones (measured: 1-11% per parameter, against fp32), so two runs differ by less than
    twice it. fp32's reordering would be 1e-6, a wrong shard O(1)."""
    llama = "-llama" if layout.endswith("llama") else ""
    tp1, fp32 = world[0]["tp1" + llama], world[0][f"tp1{llama}-fp32"]
    assert 0 < abs(tp1["loss"] - fp32["loss"]) / fp32["loss"] < 1e-2
    for rank in world:
        run = rank[layout]
        assert abs(run["loss"] - tp1["loss"]) / tp1["loss"] < 1e-2
        for name, grad in tp1["grads"].items():
            difference = (run["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-12)
            assert difference < 2 * E5M2_ROUNDOFF, (name, float(difference))


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
def test_fp8_on_the_gpu_is_torchaos_and_a_gpt_tracks_bf16() -> None:
    """On a GPU: the matmul is torchao's Float8Linear bitwise (cuBLAS's FP8 GEMM), and a bf16
    GPT with FP8 matmuls gives the bf16 model's loss to FP8's rounding."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))
    input_ = torch.randn(4, 16, 32, device="cuda", dtype=torch.bfloat16)
    ours = run_linear(lambda x: Float8Matmul(HYBRID)(x, weight), [weight], input_)
    reference = torchao_linear(weight.detach(), HYBRID).cuda().to(torch.bfloat16)
    theirs = run_linear(reference, [reference.weight], input_)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    tokens, labels = (tensor.cuda() for tensor in random_batch(BATCH, SEQ, GPT["vocab_size"]))
    losses = {}
    for name, fp8 in (("bf16", None), ("fp8", HYBRID)):
        model = build_model(tiny_config(**GPT, fp8=fp8)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses[name], _ = loss_and_grads(model, tokens, labels)
    assert abs(losses["fp8"].mean() - losses["bf16"].mean()) / losses["bf16"].mean() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
def test_fp8_tensor_parallel_shards_on_the_gpu() -> None:
    """TP=2's shards through cuBLAS's FP8 GEMM, in one process (one GPU cannot hold two NCCL
    ranks): each shard scaled by its own amax as each rank scales it, the column-parallel
    halves concatenated and the row-parallel halves summed (the all-reduce) give the whole
    bf16 layer's output and gradients to FP8's rounding."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(128, 64, device="cuda", dtype=torch.bfloat16))
    input_ = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    matmul = Float8Matmul(HYBRID)
    layouts = {
        "dense": lambda: input_ @ weight.t(),
        "column": lambda: torch.cat([matmul(input_, w) for w in weight.chunk(2, 0)], dim=-1),
        "row": lambda: sum(
            matmul(x, w) for x, w in zip(input_.chunk(2, -1), weight.chunk(2, 1), strict=True)
        ),
    }
    grad = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, forward in layouts.items():
        out = forward()
        results[name] = (out, *torch.autograd.grad(out, (input_, weight), grad))
    for name in ("column", "row"):
        for what, got, dense in zip(("out", "dx", "dw"), results[name], results["dense"]):
            error = (got.float() - dense.float()).norm() / dense.float().norm()
            assert error < E5M2_ROUNDOFF, (name, what, float(error))
