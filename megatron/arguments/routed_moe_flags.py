"""Megatron-LM's MoE flags (`--num-experts N` with `--moe-router-topk`,
`--expert-model-parallel-size`, `--moe-token-dispatcher-type`, ...) and their checks.

`--num-experts` is also Megatron-DeepSpeed's flag (DeepSpeed-MoE, `moe_flags.py`). Which MoE
a command line asks for is read off the other flags typed with it (`choose_moe_family`): any
of Megatron-LM's `--moe-*` / `--expert-*` flags below picks Megatron-LM's MoE
(`megatron.model.moe_layer`), any of Megatron-DeepSpeed's (`--topk`, `--expert-interval`,
`--moe-expert-parallel-size`, ...) or `--num-experts` alone picks DeepSpeed-MoE, and both
families together are refused in one line. Defaults are Megatron-LM's: top-2, aux_loss
balancing at coefficient 0 (off), the all-gather dispatcher, every layer an MoE layer,
dropless routing.
"""

from __future__ import annotations

import argparse
import ast

from megatron.arguments.errors import ArgumentError
from megatron.moe_config import moe_layer_flags

# Megatron-DeepSpeed's MoE flags (dest names) that Megatron-LM does not have.
DEEPSPEED_MOE_DESTS = (
    "topk",
    "expert_interval",
    "moe_expert_parallel_size",
    "moe_train_capacity_factor",
    "moe_eval_capacity_factor",
    "moe_min_capacity",
    "moe_token_dropping",
    "moe_top2_2nd_expert_sampling",
    "moe_loss_coeff",
    "create_moe_param_group",
    "mlp_type",
    "enable_expert_tensor_parallelism",
)
# Accepted with no effect here: they choose a kernel, an overlap or a shape, not a result.
INERT = {
    "moe_permute_fusion": ("--moe-permute-fusion", "a kernel choice"),
    "moe_router_fusion": ("--moe-router-fusion", "a kernel choice"),
    "moe_pad_expert_input_to_capacity": (
        "--moe-pad-expert-input-to-capacity",
        "Megatron-LM pads each expert's rows to the capacity for static shapes; the padded "
        "rows are zeros and the results the same, so the experts here take their own rows",
    ),
}


def moe_layer_pattern(text: str) -> int | list[int]:
    """`--moe-layer-freq`: N (every N-th layer) or a Python list expression such as
    "([0]+[1]*23)" (1 = MoE layer), as Megatron-LM reads it."""
    if "[" not in text:
        return int(text)
    # Megatron-LM evaluates the expression; here only list literals of integers with + and *.
    allowed = (ast.Expression, ast.List, ast.Constant, ast.BinOp, ast.Add, ast.Mult, ast.Load)
    try:
        tree = ast.parse(text, mode="eval")
        if not all(isinstance(node, allowed) for node in ast.walk(tree)):
            raise ValueError
        pattern = eval(compile(tree, "<--moe-layer-freq>", "eval"), {"__builtins__": {}})  # noqa: S307
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or a list pattern") from None
    return list(pattern)


def add_routed_moe_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's MoE flags with its defaults (`--num-experts` is `moe_flags`' own)."""
    group = parser.add_argument_group("Mixture-of-Experts (Megatron-LM)")
    add = group.add_argument
    add(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Data-parallel ranks each MoE layer's experts are split over (EP).",
    )
    add(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor-parallel ranks each expert is split over (1 is built here).",
    )
    add(
        "--moe-layer-freq",
        type=moe_layer_pattern,
        default=1,
        help='Every N-th layer is an MoE layer, or a pattern such as "([0]+[1]*23)".',
    )
    add(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="Each routed expert's hidden size (default: --ffn-hidden-size).",
    )
    add(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Hidden size of the shared expert every token also goes through (none: no shared "
        "expert).",
    )
    add(
        "--moe-shared-expert-gate",
        action="store_true",
        help="Scale the shared expert's output by sigmoid(x . w), a learned [1, h] gate per "
        "layer (Qwen2-MoE's shared_expert_gate).",
    )
    add("--moe-router-topk", type=int, default=2, help="Experts per token.")
    add(
        "--moe-router-load-balancing-type",
        nargs="+",
        default=["aux_loss"],
        choices=[
            "aux_loss",
            "seq_aux_loss",
            "global_aux_loss",
            "sinkhorn",
            "quantile_balancing",
            "none",
        ],
        help="aux_loss (micro-batch), seq_aux_loss (per sequence) or none.",
    )
    add(
        "--moe-aux-loss-coeff",
        type=float,
        nargs="+",
        default=[0.0],
        help="Weight of the load-balancing loss (1e-2 is the usual start).",
    )
    add("--moe-z-loss-coeff", type=float, default=None, help="Weight of the router z-loss.")
    add(
        "--moe-router-score-function",
        choices=["softmax", "sigmoid", "sqrtsoftplus"],
        default="softmax",
        help="Router scores: softmax, or sigmoid (DeepSeek-V3).",
    )
    add(
        "--moe-router-pre-softmax",
        action="store_true",
        help="Softmax over all experts before the top-k (not over the chosen k).",
    )
    add(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="Multiply the routing weights by this.",
    )
    add(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="Aux-loss-free balancing: per-expert biases for choosing experts, moved toward "
        "even loads after each step.",
    )
    add(
        "--moe-router-bias-update-rate",
        type=float,
        default=1e-3,
        help="Step of the expert-bias update.",
    )
    add(
        "--moe-router-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="Precision of the router's logits and scores.",
    )
    add(
        "--moe-router-num-groups",
        type=int,
        default=None,
        help="Group-limited routing (DeepSeek-V2's device-limited, V3's node-limited): the "
        "experts in this many equal groups, of which each token uses --moe-router-group-topk.",
    )
    add(
        "--moe-router-group-topk",
        type=int,
        default=None,
        help="Groups each token chooses (by the sum of its top k / group-topk scores in each) "
        "before its top-k experts among them.",
    )
    add(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="Megatron-LM's benchmarking mode: random router logits (each token's experts "
        "drawn uniformly; the gradient passes through as if they were the router's).",
    )
    add(
        "--moe-token-dispatcher-type",
        choices=["allgather", "alltoall", "flex"],
        default="allgather",
        help="How tokens reach other ranks' experts (flex: Megatron-LM's DeepEP/HybridEP "
        "dispatcher, run as alltoall here).",
    )
    add(
        "--moe-flex-dispatcher-backend",
        choices=["deepep", "hybridep"],
        default=None,
        help="The flex dispatcher's GPU kernels (DeepEP or HybridEP; not used here: flex runs "
        "as alltoall).",
    )
    add(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="Bound each expert's tokens to factor x tokens x k / experts (default: dropless).",
    )
    add(
        "--moe-token-drop-policy",
        choices=["probs", "position"],
        default="probs",
        help="Which tokens over capacity are dropped: lowest weight, or latest.",
    )
    add(
        "--moe-grouped-gemm",
        action="store_true",
        help="One grouped matmul for the local experts (torch's grouped_mm).",
    )
    add("--moe-per-layer-logging", action="store_true", help="Log each MoE layer's losses.")
    add(
        "--moe-shared-expert-overlap",
        action="store_true",
        help="Compute the shared expert while the all-to-all dispatcher's tokens are in flight "
        "(forward; the same results).",
    )
    for flag, reason in INERT.values():
        add(
            flag, action="store_true", help=f"Accepted without effect (said at start-up): {reason}."
        )


def _given(args: argparse.Namespace, explicit: set[str] | None, dest: str, default) -> bool:
    if explicit is not None:
        return dest in explicit
    return getattr(args, dest, default) != default


ROUTED_DEFAULTS = {
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_router_topk": 2,
    "moe_router_load_balancing_type": ["aux_loss"],
    "moe_aux_loss_coeff": [0.0],
    "moe_z_loss_coeff": None,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_dtype": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_force_load_balancing": False,
    "moe_token_dispatcher_type": "allgather",
    "moe_flex_dispatcher_backend": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_grouped_gemm": False,
    "moe_per_layer_logging": False,
    "moe_shared_expert_overlap": False,
    **{dest: False for dest in INERT},
}
_DEEPSPEED_DEFAULTS = {
    "topk": 1,
    "expert_interval": 2,
    "moe_expert_parallel_size": 1,
    "moe_train_capacity_factor": 1.0,
    "moe_eval_capacity_factor": 1.0,
    "moe_min_capacity": 4,
    "moe_token_dropping": True,
    "moe_top2_2nd_expert_sampling": True,
    "moe_loss_coeff": 0.1,
    "create_moe_param_group": False,
    "mlp_type": "standard",
    "enable_expert_tensor_parallelism": False,
}


def choose_moe_family(args: argparse.Namespace, explicit: set[str] | None) -> None:
    """Set `args.routed_moe` (Megatron-LM's MoE) from the flags typed; refuse both families."""
    counts = list(getattr(args, "num_experts", None) or [1])
    ours = [d for d in ROUTED_DEFAULTS if _given(args, explicit, d, ROUTED_DEFAULTS[d])]
    theirs = [d for d in DEEPSPEED_MOE_DESTS if _given(args, explicit, d, _DEEPSPEED_DEFAULTS[d])]
    if ours and theirs:
        raise ArgumentError(
            f"--{ours[0].replace('_', '-')} (Megatron-LM's MoE) with "
            f"--{theirs[0].replace('_', '-')} (Megatron-DeepSpeed's DeepSpeed-MoE): use the "
            "flags of one"
        )
    args.routed_moe = bool(ours) and any(count > 1 for count in counts)
    if ours and not args.routed_moe:
        raise ArgumentError(
            f"--{ours[0].replace('_', '-')}: Megatron-LM's MoE flag without --num-experts above 1"
        )
    if ours and len(counts) > 1:
        raise ArgumentError(
            f"--num-experts {' '.join(map(str, counts))}: Megatron-LM's MoE takes one expert "
            "count for every MoE layer"
        )
    if not args.routed_moe:
        args.expert_model_parallel_size = 1


def settle_routed_moe(args: argparse.Namespace) -> None:
    """Check Megatron-LM's MoE flags against the model and the layout (after the layout)."""
    if not args.routed_moe:
        return
    experts, ep = args.num_experts[0], args.expert_model_parallel_size
    flag = f"--num-experts {experts}"
    _not_built(args)
    if not 1 <= args.moe_router_topk <= experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk}: must be 1 to {experts}")
    if ep < 1 or experts % ep != 0:
        raise ArgumentError(
            f"--expert-model-parallel-size {ep}: must divide {flag} (each rank holds "
            "num_experts / EP experts)"
        )
    layout = args.layout
    stage = layout.tensor_parallel * layout.context_parallel * layout.data_parallel
    if stage % ep != 0:
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} must divide the ranks of a pipeline stage, "
            f"tensor x context x data-parallel size {layout.tensor_parallel} x "
            f"{layout.context_parallel} x {layout.data_parallel} = {stage} (the experts are "
            "spread over them)"
        )
    if len(args.moe_aux_loss_coeff) != 1 or args.moe_aux_loss_coeff[0] < 0:
        raise ArgumentError(
            f"--moe-aux-loss-coeff {' '.join(map(str, args.moe_aux_loss_coeff))}: one value, "
            "0 or more"
        )
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor <= 0:
        raise ArgumentError(
            f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}: must be above 0"
        )
    if args.moe_shared_expert_gate and not args.moe_shared_expert_intermediate_size:
        raise ArgumentError(
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (the gate "
            "scales the shared expert's output)"
        )
    if args.moe_shared_expert_overlap and not args.moe_shared_expert_intermediate_size:
        raise ArgumentError(
            "--moe-shared-expert-overlap needs --moe-shared-expert-intermediate-size (the "
            "shared expert is what runs while the tokens travel)"
        )
    moe_layers(args)  # checks the pattern's length
    _group_limited(args, experts)
    _flex_dispatcher(args)
    for dest, (typed, reason) in INERT.items():
        if getattr(args, dest):
            args.compat_notes.append(f" > {typed}: accepted; no effect here ({reason})")


def _group_limited(args: argparse.Namespace, experts: int) -> None:
    """--moe-router-num-groups G with --moe-router-group-topk g: G equal groups of experts,
    g of them per token, k experts among those (megatron-core's `group_limited_topk`)."""
    groups, chosen, k = args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk
    if groups is None and chosen is None:
        return
    if groups is None or chosen is None:
        raise ArgumentError(
            "--moe-router-num-groups and --moe-router-group-topk go together (group-limited "
            "routing needs both)"
        )
    if groups < 1 or experts % groups:
        raise ArgumentError(
            f"--moe-router-num-groups {groups}: must divide --num-experts {experts}"
        )
    if not 1 <= chosen <= groups:
        raise ArgumentError(f"--moe-router-group-topk {chosen}: must be 1 to {groups} groups")
    if k % chosen or k > chosen * (experts // groups):
        raise ArgumentError(
            f"--moe-router-topk {k} with --moe-router-group-topk {chosen}: k must be a multiple "
            f"of the chosen groups (each contributes k / {chosen} scores) and fit in them "
            f"({chosen} x {experts // groups} experts)"
        )


def _flex_dispatcher(args: argparse.Namespace) -> None:
    """--moe-token-dispatcher-type flex runs as alltoall (the same tokens reach the same
    experts); its GPU kernel libraries are named in a start-up note."""
    backend = args.moe_flex_dispatcher_backend
    if args.moe_token_dispatcher_type == "flex":
        args.moe_token_dispatcher_type = "alltoall"
        kernels = {"deepep": "DeepEP", "hybridep": "HybridEP"}.get(backend, "DeepEP/HybridEP")
        args.compat_notes.append(
            f" > --moe-token-dispatcher-type flex: runs as alltoall here ({kernels} is a GPU "
            "kernel library for NVLink/InfiniBand all-to-all, not built; tokens, experts and "
            "results are the same)"
        )
    elif backend is not None:
        args.compat_notes.append(
            f" > --moe-flex-dispatcher-backend {backend}: accepted; no effect without "
            "--moe-token-dispatcher-type flex"
        )


def _not_built(args: argparse.Namespace) -> None:
    """The parts of Megatron-LM's MoE not built here, refused in one line each."""
    balancing, tp = args.moe_router_load_balancing_type, args.tensor_model_parallel_size
    refusals = [
        (
            len(balancing) > 1,
            f"--moe-router-load-balancing-type {' '.join(balancing)}: "
            "one type at a time is built here",
        ),
        (
            balancing[0] in ("sinkhorn", "global_aux_loss", "quantile_balancing"),
            f"--moe-router-load-balancing-type {balancing[0]}: not built here (aux_loss, "
            "seq_aux_loss and none are)",
        ),
        (
            args.moe_router_score_function == "sqrtsoftplus",
            "--moe-router-score-function sqrtsoftplus: not built here (softmax and sigmoid are)",
        ),
        (
            (args.expert_tensor_parallel_size or 1) > 1,
            f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: experts split over "
            "tensor-parallel ranks are not built here; use 1 (experts whole, expert parallelism "
            "folded over the tensor x context x data-parallel ranks)",
        ),
        (
            tp > 1 and args.expert_tensor_parallel_size is None,
            f"--num-experts with --tensor-model-parallel-size {tp}: Megatron-LM's default "
            "--expert-tensor-parallel-size is the TP size (each expert split over the "
            "tensor-parallel ranks), which is not built here; pass --expert-tensor-parallel-size "
            "1 (experts whole, expert parallelism folded over TP x CP x DP)",
        ),
        (
            tp > 1 and not args.sequence_parallel,
            f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
            "(as in Megatron-LM: each tensor-parallel rank routes its own part of the sequence)",
        ),
        (
            args.layout.ulysses > 1,
            "--num-experts with --ds-sequence-parallel-size above 1: not built here for "
            "Megatron-LM's MoE (--context-parallel-size is)",
        ),
    ]
    for refused, line in refusals:
        if refused:
            raise ArgumentError(line)


def moe_layers(args: argparse.Namespace) -> tuple[bool, ...]:
    """Which layers are MoE layers (`--moe-layer-freq`), or the one-line refusal."""
    try:
        return moe_layer_flags(args.moe_layer_freq, args.num_layers)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
