"""DeepSpeed 0.19 accepts our `mpu`: engine sizes, ZeRO-1 steps, and its activation checkpointing.

Four gloo ranks as TP=2 x DP=2. The engine must see 2 data-parallel and 2 model-parallel
ranks, take optimizer steps under ZeRO-1, and keep the tensor-parallel shards consistent; and
`deepspeed.checkpointing` (configured with our mpu through `use_deepspeed_checkpointing`) must
recompute layers with the same dropout as running them plainly.
"""

from __future__ import annotations

import torch

from tests.distributed import run_distributed

CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=16,
    use_cpu_initialization=True,
)


def _batch(rank_seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank_seed))


def _loss_and_grads(model, tokens, seed):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model.zero_grad()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _deepspeed_body(rank: int, world_size: int) -> None:
    import deepspeed

    from megatron.config import ModelConfig
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.model import GPTModel

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(2, 1)
    mpu = parallel_state.mpu

    # DeepSpeed activation checkpointing replays dropout exactly (dropout on, full recompute).
    torch.manual_seed(0)
    plain = GPTModel(ModelConfig(**CONFIG, hidden_dropout=0.2, attention_dropout=0.2))
    tokens = _batch(parallel_state.get_data_parallel_rank())
    tp_random.use_deepspeed_checkpointing(mpu, num_checkpoints=CONFIG["num_layers"])
    try:
        assert isinstance(
            tp_random.get_cuda_rng_tracker(),
            deepspeed.checkpointing.CudaRNGStatesTracker,
        )
        loss_plain, grads_plain = _loss_and_grads(plain, tokens, seed=11)
        plain.config.recompute_granularity = "full"
        loss_ckpt, grads_ckpt = _loss_and_grads(plain, tokens, seed=11)
    finally:
        tp_random.use_builtin_checkpointing()
    plain.config.recompute_granularity = None
    # Bitwise on purpose: the same model and layout twice, the recompute replaying the same
    # kernels on the same values.
    assert loss_plain == loss_ckpt
    for a, b in zip(grads_plain, grads_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # The engine sees our groups and trains under ZeRO-1.
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**CONFIG, hidden_dropout=0.0, attention_dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        mpu=mpu,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
        },
    )
    assert engine.dp_world_size == 2
    assert engine.mp_world_size == 2
    assert engine.train_batch_size() == 2 * 2
    losses = []
    for _ in range(3):
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses

    # Replicated parameters (layer norms, row-parallel biases) stay identical across TP ranks:
    # bitwise, as both ranks run the same kernels on the same replicated values (and receive
    # the same all-reduced sums).
    import torch.distributed as dist

    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            continue
        gathered = [torch.empty_like(param) for _ in range(2)]
        dist.all_gather(
            gathered, param.detach(), group=parallel_state.get_tensor_model_parallel_group()
        )
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0, msg=name)
    parallel_state.destroy_model_parallel()


def test_deepspeed_engine_and_checkpointing_with_our_mpu():
    """ZeRO-1 over TP=2 x DP=2, and DeepSpeed's recompute equals the plain model."""
    run_distributed(_deepspeed_body, 4)
