"""The Mixture-of-Experts parts of the model's configuration: DeepSpeed-MoE's (Megatron-DeepSpeed's
`--num-experts` above 1) and Megatron-LM's routed MoE (its `--moe-*` flags), built from the
validated flags (`megatron.config.ModelConfig` holds them)."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass


def experts_per_layer(num_experts: list[int], num_layers: int, expert_interval: int) -> tuple:
    """Megatron-DeepSpeed's rule: layer n (from 1) is MoE when n % interval == 0, its expert
    count the list's entry for its MoE layer (one value: every MoE layer); else 1 (dense)."""
    moe_layers = num_layers // expert_interval
    if len(num_experts) == 1:
        num_experts = num_experts * moe_layers
    if len(num_experts) != moe_layers:
        raise ValueError(
            f"--num-experts lists {len(num_experts)} values for {moe_layers} MoE layers "
            f"(--num-layers {num_layers} / --expert-interval {expert_interval}); give one value "
            "or one per MoE layer"
        )
    return tuple(
        num_experts[(n - 1) // expert_interval] if n % expert_interval == 0 else 1
        for n in range(1, num_layers + 1)
    )


@dataclass(frozen=True)
class MoEConfig:
    """DeepSpeed-MoE in place of some layers' MLP (Megatron-DeepSpeed's flags)."""

    experts_per_layer: tuple[int, ...]
    """Experts of each layer, from layer 1; 1 keeps the dense MLP (`experts_per_layer`)."""
    expert_parallel_size: int = 1
    """Ranks of the data-parallel group each layer's experts are spread over (EP; a layer with
    fewer experts spreads over as many ranks as it has, as DeepSpeed before 0.7 did)."""
    top_k: int = 1
    """Experts per token: 1 (Switch) or 2 (GShard) (`--topk`)."""
    train_capacity_factor: float = 1.0
    """Tokens an expert takes in training: factor x tokens / experts (`--moe-train-...`)."""
    eval_capacity_factor: float = 1.0
    """The same in evaluation (`--moe-eval-capacity-factor`)."""
    min_capacity: int = 4
    """Lower bound of every expert's capacity (`--moe-min-capacity`)."""
    drop_tokens: bool = True
    """Drop tokens over capacity (`--disable-moe-token-dropping` turns off)."""
    top2_2nd_expert_sampling: bool = True
    """Top-2: draw the second expert with Gumbel noise (DeepSpeed's default; DeepSpeed 0.19
    samples in evaluation too)."""
    residual: bool = False
    """PR-MoE (`--mlp-type residual`): a dense MLP beside the experts, mixed per token."""
    expert_tensor_parallel: bool = False
    """Split each expert over tensor-parallel ranks (`--enable-expert-tensor-parallelism`);
    otherwise every TP rank holds whole experts."""
    loss_coeff: float = 0.1
    """Weight of each layer's load-balancing loss in the training loss (`--moe-loss-coeff`)."""


@dataclass(frozen=True)
class RoutedMoEConfig:
    """Megatron-LM's MoE in place of some layers' MLP: token-choice top-k routing, dropless
    unless a capacity factor is given (Megatron-LM's `--num-experts` and `--moe-*` flags)."""

    num_experts: int
    """Routed experts of every MoE layer (`--num-experts`)."""
    moe_layers: tuple[bool, ...]
    """Whether each layer, from layer 1, is an MoE layer (`--moe-layer-freq`)."""
    top_k: int = 2
    """Experts per token (`--moe-router-topk`)."""
    ffn_hidden_size: int | None = None
    """Each routed expert's hidden size (`--moe-ffn-hidden-size`; the model's by default)."""
    shared_expert_ffn_hidden_size: int | None = None
    """A dense MLP every token also goes through (`--moe-shared-expert-intermediate-size`)."""
    shared_expert_overlap: bool = False
    """Compute the shared expert while the all-to-all dispatcher's tokens are in flight
    (`--moe-shared-expert-overlap`): the same results, the dispatch hidden behind it."""
    shared_expert_gate: bool = False
    """The shared expert's output times sigmoid(x . w), w a learned [1, h] weight
    (`--moe-shared-expert-gate`, Qwen2-MoE's `shared_expert_gate`)."""
    overlap_expert_comm: bool = False
    """Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`): each micro-batch's
    backward runs beside the next one's forward, the expert collectives of one hidden behind
    the other's compute (`megatron.core.pipeline_parallel.combined_1f1b`)."""
    delay_wgrad: bool = False
    """With it, the experts' weight gradients run while the backward's next collective travels
    (`--delay-wgrad-compute`)."""
    score_function: str = "softmax"
    """softmax or sigmoid (DeepSeek-V3) of the router logits (`--moe-router-score-function`)."""
    pre_softmax: bool = False
    """Softmax over all experts before the top-k, not over the chosen k after it."""
    topk_scaling_factor: float | None = None
    """Multiply the routing weights by this (`--moe-router-topk-scaling-factor`)."""
    load_balancing: str = "aux_loss"
    """aux_loss (over the micro-batch), seq_aux_loss (per sequence) or none."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (`--moe-aux-loss-coeff`)."""
    z_loss_coeff: float | None = None
    """Weight of the router z-loss (`--moe-z-loss-coeff`)."""
    expert_bias: bool = False
    """Aux-loss-free balancing (`--moe-router-enable-expert-bias`): a per-expert bias added to
    the scores for choosing experts only, moved after each step toward even loads."""
    bias_update_rate: float = 1e-3
    """How far each step moves the expert biases (`--moe-router-bias-update-rate`)."""
    router_dtype: str | None = None
    """fp32 or fp64: the router's logits and softmax in that precision (`--moe-router-dtype`)."""
    dispatcher: str = "allgather"
    """How tokens reach other ranks' experts: alltoall or allgather."""
    capacity_factor: float | None = None
    """Drop tokens over factor x tokens x k / experts per expert (`--moe-expert-capacity-factor`);
    None: dropless."""
    drop_policy: str = "probs"
    """With a capacity factor, drop the lowest-probability (probs) or latest (position) tokens."""
    grouped_gemm: bool = False
    """One grouped matmul for all local experts (`--moe-grouped-gemm`) instead of a loop."""
    expert_parallel_size: int = 1
    """Data-parallel ranks each MoE layer's experts are split over (EP,
    `--expert-model-parallel-size`)."""
    per_layer_logging: bool = False
    """Log each MoE layer's losses, not only their mean (`--moe-per-layer-logging`)."""
    num_groups: int | None = None
    """Group-limited routing: the experts in this many equal groups (`--moe-router-num-groups`)."""
    group_topk: int | None = None
    """Groups each token chooses its experts from (`--moe-router-group-topk`)."""
    force_load_balancing: bool = False
    """Random router logits, for benchmarking (`--moe-router-force-load-balancing`)."""


def moe_layer_flags(pattern: int | list[int], num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE layers, from `--moe-layer-freq` (Megatron-LM's rule: with N,
    layers 1, N + 1, 2N + 1, ...; or a 0/1 list, one entry per layer)."""
    if isinstance(pattern, int):
        if pattern < 1:
            raise ValueError(f"--moe-layer-freq {pattern}: must be at least 1")
        return tuple(index % pattern == 0 for index in range(num_layers))
    if len(pattern) != num_layers or any(value not in (0, 1) for value in pattern):
        raise ValueError(
            f"--moe-layer-freq: the pattern has {len(pattern)} entries, --num-layers is "
            f"{num_layers}; each entry 0 (dense) or 1 (MoE)"
        )
    return tuple(bool(value) for value in pattern)


def routed_moe_config_from_args(args: Namespace) -> RoutedMoEConfig | None:
    """Megatron-LM's MoE settings of validated flags; None without them."""
    if not getattr(args, "routed_moe", False):
        return None
    return RoutedMoEConfig(
        num_experts=args.num_experts[0],
        moe_layers=moe_layer_flags(args.moe_layer_freq, args.num_layers),
        top_k=args.moe_router_topk,
        ffn_hidden_size=args.moe_ffn_hidden_size,
        shared_expert_ffn_hidden_size=args.moe_shared_expert_intermediate_size,
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        shared_expert_overlap=bool(getattr(args, "moe_shared_expert_overlap", False)),
        overlap_expert_comm=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
        delay_wgrad=bool(getattr(args, "delay_wgrad_compute", False)),
        score_function=args.moe_router_score_function,
        pre_softmax=args.moe_router_pre_softmax,
        topk_scaling_factor=args.moe_router_topk_scaling_factor,
        load_balancing=args.moe_router_load_balancing_type[0],
        aux_loss_coeff=args.moe_aux_loss_coeff[0],
        z_loss_coeff=args.moe_z_loss_coeff,
        expert_bias=args.moe_router_enable_expert_bias,
        bias_update_rate=args.moe_router_bias_update_rate,
        router_dtype=args.moe_router_dtype,
        dispatcher=args.moe_token_dispatcher_type,
        capacity_factor=args.moe_expert_capacity_factor,
        drop_policy=args.moe_token_drop_policy,
        grouped_gemm=args.moe_grouped_gemm,
        expert_parallel_size=args.expert_model_parallel_size,
        per_layer_logging=args.moe_per_layer_logging,
        # (Saved args of checkpoints written before these flags lack them.)
        num_groups=getattr(args, "moe_router_num_groups", None),
        group_topk=getattr(args, "moe_router_group_topk", None),
        force_load_balancing=bool(getattr(args, "moe_router_force_load_balancing", False)),
    )


def moe_config_from_args(args: Namespace) -> MoEConfig | None:
    """The MoE settings of validated flags; None when every layer keeps one expert."""
    num_experts = list(getattr(args, "num_experts", None) or [1])
    if all(count == 1 for count in num_experts) or getattr(args, "routed_moe", False):
        return None
    return MoEConfig(
        experts_per_layer=experts_per_layer(num_experts, args.num_layers, args.expert_interval),
        expert_parallel_size=args.moe_expert_parallel_size,
        top_k=args.topk,
        train_capacity_factor=args.moe_train_capacity_factor,
        eval_capacity_factor=args.moe_eval_capacity_factor,
        min_capacity=args.moe_min_capacity,
        drop_tokens=args.moe_token_dropping,
        top2_2nd_expert_sampling=args.moe_top2_2nd_expert_sampling,
        residual=args.mlp_type == "residual",
        expert_tensor_parallel=bool(args.enable_expert_tensor_parallelism),
        loss_coeff=getattr(args, "moe_loss_coeff", MoEConfig.loss_coeff),
    )
