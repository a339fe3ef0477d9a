"""`--context-parallel-size` and `--cp-comm-type`: context parallelism with Megatron-LM's rules.

C ranks split every sample's tokens in Megatron's load-balanced layout (the sequence cut
into 2C chunks, rank r holding chunks r and 2C-1-r), so the sequence must divide by 2C.
Which engines run it is in `megatron.compatibility`; what else it cannot run with is refused
here in one line each. Sliding windows (`--window-size`) and packed documents
(`--reset-attention-mask`) run with every `--cp-comm-type` (`megatron.model.ring_blocks`:
the ring skips what the window or the documents hide and masks the rest). (The factor on
each rank's part of the loss gradient is the engine's:
`megatron.layout.Engine.sequence_split_gradient_scale`.)
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError
from megatron.arguments.ulysses_checks import check_zero3_reduce_scatter


def settle_context_parallel(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what context parallelism cannot run with (size 1: only the
    flags that need it)."""
    cp = args.context_parallel_size
    comm_types = list(getattr(args, "cp_comm_type", None) or ["p2p"])
    _check_comm_types(args, comm_types)
    if cp == 1:
        return
    flag = f"--context-parallel-size {cp}"
    if args.seq_length % (2 * cp) != 0:
        raise ArgumentError(
            f"--seq-length ({args.seq_length}) is not divisible by 2 x {flag}: each rank holds "
            f"two of the {2 * cp} chunks of every sequence (load-balanced for the causal mask)"
        )
    if "a2a" in comm_types:
        _check_a2a_heads(args, cp)
    if args.moe:
        raise ArgumentError(
            f"{flag} with --num-experts: Mixture-of-Experts with context parallelism is not "
            "built here (each rank would balance its own part of the tokens)"
        )
    if args.layout.engine.uses_deepspeed and args.layout.zero_stage == 3:
        check_zero3_reduce_scatter(args, flag)


def _check_comm_types(args: argparse.Namespace, comm_types: list[str]) -> None:
    """One value, or one per layer; the hierarchical kind is refused."""
    if len(comm_types) not in (1, args.num_layers):
        raise ArgumentError(
            f"--cp-comm-type takes one value or one per layer ({args.num_layers}), got "
            f"{len(comm_types)}"
        )
    if "a2a+p2p" in comm_types or getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ArgumentError(
            "--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes: hierarchical "
            "context parallelism is not built here; use p2p (ring), a2a or allgather"
        )


def _check_a2a_heads(args: argparse.Namespace, cp: int) -> None:
    """a2a gives each rank 1/C of this tensor-parallel rank's query and key/value heads."""
    tp = args.tensor_model_parallel_size
    for value, name in (
        (args.num_attention_heads, "--num-attention-heads"),
        (args.num_key_value_heads, "--num-key-value-heads"),
    ):
        if value % (tp * cp) != 0:
            raise ArgumentError(
                f"--cp-comm-type a2a: {name} ({value}) is not divisible by tensor x context "
                f"parallel size ({tp} x {cp}); each rank attends to 1/{cp} of its heads "
                "(use --cp-comm-type p2p or allgather, which take any head count)"
            )
