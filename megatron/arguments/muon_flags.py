"""Megatron-LM's Muon flags (`--optimizer muon`, `--muon-*`) and where Muon runs here.

Names, defaults and meanings are Megatron-LM's (megatron/training/arguments.py; the update is
`megatron.training.muon`). Where each engine runs it:

- the plain engine and Megatron's schedules: Megatron-LM's Muon with every `--muon-*` flag,
  at any tensor-parallel size (`--muon-tp-mode`); not under FSDP2 (`--use-torch-fsdp2`,
  `--use-megatron-fsdp`), which shards each matrix over the data-parallel ranks: refused, as
  Megatron-LM refuses it (gathering every matrix on every rank to orthogonalize it would undo
  the sharding). `--use-distributed-optimizer` (and `--optimizer dist_muon`) means Megatron-LM's
  layer-wise distributed optimizer with Muon, which is not built: the same updates run with
  every rank holding the whole optimizer state (a start-up note says so);
- DeepSpeed where the client optimizer steps whole parameters (fp32 ZeRO-0; bf16 ZeRO-0 on
  `--no-pipeline-parallel`): the same Muon;
- DeepSpeed where its wrapper flattens parameters into partitions (ZeRO 1-3, its
  BF16_Optimizer): DeepSpeed's own `MuonWithAuxAdam`, whose update is Megatron-LM's only with
  `DEEPSPEED_MUON`'s flags; other flags are refused in one line naming them.

What each engine refuses is a row of `megatron.compatibility.FEATURES` (the Muon rows).
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError
from megatron.training.muon import (
    FP32_MATMUL_PRECISIONS,
    NS_COEFFICIENTS,
    SCALE_MODES,
    TP_MODES,
)

# DeepSpeed 0.19.8's Muon (runtime/zero/muon/original_muon.py `muon_update`): Nesterov
# momentum, 5 steps of (3.4445, -4.7750, 2.0315) in bf16 (`ns_method` standard), scaled by
# sqrt(max(1, rows / cols)), every tensor whole. Its ZeRO wrappers write the orthogonalized
# update where the gradient was and then clip that (stage_1_and_2.py `scaled_global_norm`):
# Megatron-LM clips the gradients before the momentum, so only unclipped runs agree. As
# Megatron-LM flags: dest, value, flag.
DEEPSPEED_MUON: tuple[tuple[str, object, str], ...] = (
    ("clip_grad", 0.0, "--clip-grad 0"),
    ("muon_nesterov", True, "--muon-nesterov"),
    ("muon_coefficient_type", "simple", "--muon-coefficient-type simple"),
    ("muon_num_ns_steps", 5, "--muon-num-ns-steps 5"),
    ("muon_scale_mode", "shape_scaling", "--muon-scale-mode shape_scaling"),
    ("muon_extra_scale_factor", 1.0, "--muon-extra-scale-factor 1.0"),
    ("muon_split_qkv", False, "--muon-no-split-qkv"),
    ("muon_fp32_matmul_prec", "medium", "--muon-fp32-matmul-prec medium"),
)


def add_muon_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's `--muon-*` flags."""
    group = parser.add_argument_group("Muon optimizer (--optimizer muon)")
    group.add_argument(
        "--muon-momentum", type=float, default=0.9, help="Muon's momentum (an EMA coefficient)."
    )
    group.add_argument(
        "--muon-no-split-qkv",
        action="store_false",
        dest="muon_split_qkv",
        help="Orthogonalize the fused query/key/value weight whole, not as its query, key and "
        "value blocks apart.",
    )
    group.add_argument(
        "--muon-nesterov",
        "--muon-use-nesterov",
        action="store_true",
        help="Nesterov momentum: orthogonalize g + momentum (m - g) instead of the momentum m.",
    )
    group.add_argument(
        "--muon-scale-mode",
        choices=SCALE_MODES,
        default="spectral",
        help="The update's scale for a rows x cols matrix: sqrt(max(rows, cols)), "
        "sqrt(rows / cols) or sqrt(max(1, rows / cols)).",
    )
    group.add_argument(
        "--muon-fp32-matmul-prec",
        choices=FP32_MATMUL_PRECISIONS,
        default="medium",
        help="torch's float32 matmul precision for the Newton-Schulz iteration: medium runs it "
        "in bf16, high in fp32 (TF32 allowed); torch ignores low.",
    )
    group.add_argument(
        "--muon-coefficient-type",
        default="quintic",
        help=f"Newton-Schulz coefficients per step: one of {', '.join(NS_COEFFICIENTS)}.",
    )
    group.add_argument(
        "--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz steps per update."
    )
    group.add_argument(
        "--muon-tp-mode",
        choices=TP_MODES,
        default="duplicated",
        help="A tensor-parallel matrix: gathered and orthogonalized whole on every rank "
        "(duplicated), whole with its Gram matrices summed over the ranks (distributed), or "
        "each rank's shard on its own (blockwise).",
    )
    group.add_argument(
        "--muon-use-syrk",
        action="store_true",
        help="Accepted without effect: a Triton kernel for the Gram matrix; torch's matmul "
        "computes the same product here.",
    )
    group.add_argument(
        "--muon-extra-scale-factor",
        type=float,
        default=1.0,
        help="A further factor on every Muon update.",
    )
    group.add_argument(
        "--muon-scalar-optimizer",
        choices=["adam", "lion"],
        default="adam",
        help="The optimizer of the parameters Muon leaves (embeddings, output layer, biases, "
        "norms): adam (AdamW with --adam-*); lion is refused.",
    )


def settle_muon(args: argparse.Namespace) -> None:
    """Check the Muon flags, before the sharding is settled: `--optimizer dist_muon` and
    `--use-distributed-optimizer` become Muon with whole optimizer state (a note)."""
    if args.optimizer == "dist_muon":
        args.optimizer = "muon"
        args.compat_notes.append(
            " > --optimizer dist_muon: Megatron-LM's deprecated spelling of --optimizer muon "
            "--use-distributed-optimizer"
        )
        args.use_distributed_optimizer = True
    if args.optimizer != "muon":
        return
    if args.fp16:
        raise ArgumentError("--optimizer muon with --fp16: not supported (nor in Megatron-LM)")
    if args.muon_scalar_optimizer != "adam":
        raise ArgumentError(
            f"--muon-scalar-optimizer {args.muon_scalar_optimizer}: Lion is not built here; "
            "use adam"
        )
    if args.muon_coefficient_type not in NS_COEFFICIENTS:
        raise ArgumentError(
            f"--muon-coefficient-type {args.muon_coefficient_type}: choose one of "
            f"{', '.join(NS_COEFFICIENTS)}"
        )
    if args.muon_num_ns_steps < 1:
        raise ArgumentError(f"--muon-num-ns-steps must be at least 1, not {args.muon_num_ns_steps}")
    if args.muon_coefficient_type == "cubic5" and args.muon_num_ns_steps != 5:
        raise ArgumentError("--muon-coefficient-type cubic5 is a 5-step set: --muon-num-ns-steps 5")
    sharding = "--use-torch-fsdp2" if args.use_torch_fsdp2 else None
    if args.use_megatron_fsdp:
        sharding = "--use-megatron-fsdp"
    if sharding is not None:
        raise ArgumentError(
            f"--optimizer muon with {sharding}: Muon orthogonalizes whole matrices and FSDP2 "
            "shards each over the data-parallel ranks (Megatron-LM refuses it too); drop "
            f"{sharding}"
        )
    if args.use_distributed_optimizer:
        args.use_distributed_optimizer = False
        args.compat_notes.append(
            " > --optimizer muon --use-distributed-optimizer: Megatron-LM's layer-wise "
            "distributed optimizer is not built here; the same updates run with every "
            "data-parallel rank holding the whole Muon and AdamW state"
        )
