"""`--torch-compile` (each transformer layer compiled by inductor) against eager.

In fp32 with dropout off a compiled model must train like the eager one: the same losses over
10 AdamW steps up to the order of their sums (`assert_trains_alike`), at TP=1 (in this
process; the whole model is one graph) and at TP=2 with sequence parallelism and full
recomputation (two gloo ranks; each layer is compiled, the collectives stay outside). With
dropout on, compiled dropout draws other masks than eager (inductor has its own generator),
so there the tests check what must still hold: a recomputed layer replays the masks its
first pass drew, and selective recomputation keeps the attention core eager in both passes.
The DeepSpeed paths (ZeRO-1, the pipeline engine at PP=2) are checked through real runs in
tests/training/test_compile_runs.py.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model.fused_ops import bias_dropout_add, bias_gelu, fuse_eagerly, fused
from tests.model.helpers import (
    build_model,
    loss_and_grads,
    random_batch,
    spawn_collect,
    tiny_config,
)
from tests.tolerances import assert_close_reordered, grad_terms, loss_terms, reordering_atol

STEPS = 10
BATCH, SEQ = 2, 16


@pytest.fixture(autouse=True)
def _one_compile_thread():
    """Inductor compiles in this process: a worker pool costs more than it saves on 2 cores."""
    with torch._inductor.config.patch(compile_threads=1):
        yield


def train_losses(compiled: bool, steps: int = STEPS, **overrides: object) -> torch.Tensor:
    """Mean loss of each of `steps` AdamW steps on one fixed batch (weights from seed 0)."""
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    config = tiny_config(torch_compile=compiled, use_cpu_initialization=True, **overrides)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels = random_batch(BATCH, SEQ, config.vocab_size)
    losses = []
    for _ in range(steps):
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def assert_trains_alike(compiled: torch.Tensor, eager: torch.Tensor, **overrides: object) -> None:
    """The losses of `train_losses` compiled and eager agree up to the order of their sums.

    Inductor fuses and reorders the sums. Step k's loss is one forward (the mean over the
    batch's tokens of the loss terms) on weights that k updates moved with gradients
    carrying their own rounding: `loss_terms + tokens + k * grad_terms`.
    """
    config = tiny_config(**overrides)
    loss = loss_terms(config, SEQ) + BATCH * SEQ
    for step in range(STEPS):
        assert_close_reordered(
            compiled[step],
            eager[step],
            terms=loss + step * grad_terms(config, BATCH, SEQ),
            msg=f"step {step}: compiled {compiled.tolist()}, eager {eager.tolist()}",
        )


def test_compiled_model_trains_like_eager_in_one_graph():
    """TP=1: same 10 losses as eager, the whole model (ids to loss) one graph, no break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = train_losses(False), train_losses(True)
    assert_trains_alike(compiled, eager)
    assert compiled[-1] < compiled[0] - 0.5  # it learns
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    names = build_model(tiny_config(torch_compile=True)).state_dict().keys()
    assert names == build_model(tiny_config()).state_dict().keys()  # no _orig_mod. prefix


def test_compiled_recomputation_replays_its_dropout_masks():
    """Full recomputation calls the compiled layer twice: same masks, so the same gradient as
    no recomputation; selective recomputation keeps the attention core eager in both passes,
    so attention dropout equals eager's."""
    tokens, labels = random_batch(BATCH, SEQ, 64)
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
    config = tiny_config()
    # Recomputation's first pass runs without grad, another inductor graph than training's,
    # and compiled vs eager are other kernels: equal up to the order of the sums (a wrong
    # dropout mask errs by O(1)).
    terms = {"loss": loss_terms(config, SEQ), "grad": grad_terms(config, BATCH, SEQ)}

    def run(compiled: bool, **overrides: object):
        model = build_model(tiny_config(torch_compile=compiled, **overrides))
        return loss_and_grads(model, tokens, labels, rng_seed=5)

    plain_loss, plain_grads = run(True, **dropout)
    full_loss, full_grads = run(True, recompute_granularity="full", **dropout)
    assert_close_reordered(full_loss, plain_loss, terms=terms["loss"])
    for name, grad in plain_grads.items():
        assert_close_reordered(full_grads[name], grad, terms=terms["grad"], msg=name)

    selective = dict(recompute_granularity="selective", attention_dropout=0.2)
    eager_loss, eager_grads = run(False, **selective)
    compiled_loss, compiled_grads = run(True, **selective)
    assert_close_reordered(compiled_loss, eager_loss, terms=terms["loss"])
    for name, grad in eager_grads.items():
        assert_close_reordered(compiled_grads[name], grad, terms=terms["grad"], msg=name)


TP_OPTIONS = dict(num_attention_heads=4, sequence_parallel=True, recompute_granularity="full")


def tensor_parallel_body(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Eager and compiled losses at TP=world with sequence parallelism and full recompute."""
    torch._inductor.config.compile_threads = 1
    parallel_state.initialize_model_parallel(world, 1)
    return {
        "eager": train_losses(False, **TP_OPTIONS),
        "compiled": train_losses(True, **TP_OPTIONS),
    }


@pytest.mark.slow
def test_compiled_tensor_parallel_trains_like_eager():
    """TP=2 + sequence parallel + full recomputation: same losses as eager on both ranks."""
    for rank in spawn_collect(tensor_parallel_body, 2):
        assert_trains_alike(rank["compiled"], rank["eager"], **TP_OPTIONS)


def test_fused_functions_compute_the_unfused_arithmetic():
    """The compiled bias-GeLU and bias-dropout-add (p=0) equal the plain functions, with
    gradients; eager runs use them only on a GPU and only with their fusion flag on."""
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(8, 2, 16, generator=generator) for _ in range(2))
    bias = torch.randn(16, generator=generator)
    inputs = [t.clone().requires_grad_() for t in (x, bias)]
    expected = bias_gelu(*inputs, "tanh")
    expected.sum().backward()
    fused_inputs = [t.clone().requires_grad_() for t in (x, bias)]
    got = fused(bias_gelu)(*fused_inputs, "tanh")
    got.sum().backward()
    # Inductor's own tanh and another grouping of the GeLU's handful of operations (count 8);
    # the bias gradient also sums over the 8 x 2 positions.
    assert_close_reordered(got, expected, terms=8)
    for a, b in zip(fused_inputs, inputs):
        assert_close_reordered(a.grad, b.grad, terms=8 + 16)
    # Three terms, perhaps added in another order: bounded by their magnitudes (Higham).
    torch.testing.assert_close(
        fused(bias_dropout_add)(x, bias, residual, 0.0, True),
        residual + x + bias,
        atol=reordering_atol(residual.abs() + x.abs() + bias.abs(), terms=3),
        rtol=0,
    )
    assert not fuse_eagerly(x, True)  # a CPU tensor
    assert not fuse_eagerly(torch.empty(1, device="meta"), True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_gpu_layers_call_the_fused_kernels():
    """On a GPU the eager layer fuses (flags on) and still equals the unfused layer in bf16."""
    device = torch.device("cuda")
    assert fuse_eagerly(torch.empty(1, device=device), True)
    assert not fuse_eagerly(torch.empty(1, device=device), False)
    tokens, labels = (t.to(device) for t in random_batch(2, 16, 64))
    results = []
    for fusion in (True, False):
        model = build_model(
            tiny_config(
                bias_gelu_fusion=fusion, bias_dropout_fusion=fusion, params_dtype="bfloat16"
            )
        ).to(device)
        results.append(loss_and_grads(model, tokens, labels))
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=2e-2, atol=2e-2)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=5e-2, atol=5e-3, msg=name)
