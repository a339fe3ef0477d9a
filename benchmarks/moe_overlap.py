"""Benchmark: `--moe-shared-expert-overlap` on CPU at EP = 2 and 4: how much of the all-to-all
dispatch hides behind the shared expert's forward, against the share it could hide.

    python benchmarks/moe_overlap.py            # 4096 tokens per rank, h 256, 8 experts, top-2
    python benchmarks/moe_overlap.py --quick    # smoke run: 512 tokens, 2 rounds

One Megatron-LM MoE layer (`megatron.model.moe_layer.RoutedMoE`: 8 SwiGLU experts 512 wide,
top-2, all-to-all dispatcher, a gated shared expert 1024 wide; fp32, no biases), its training
forward and backward on this rank's tokens, in a world of EP fresh gloo processes (one torch
thread each; **EP = 4 puts 4 processes on 2 cores**, so its times measure time-sharing too).
Each rank routes its own tokens; every run of a world uses the same weights and tokens, so the
overlapped forward's output must equal the plain one's bit for bit (printed).

Measured on rank 0, medians over the rounds, each phase between barriers:
- `a2a`: the dispatch all-to-all alone (`all_to_all_over_expert_parallel` of the layer's own
  dispatched rows), and `shared`: the shared expert's forward alone;
- the layer's forward and backward, plain and with the overlap, and the saving;
- hidden (measured): 1 - (time blocked in the dispatch's wait) / (its time from launch to
  the end of the wait), the dispatch launched before the shared expert and waited for after
  it (the same rule as benchmarks/context_parallel.py's ring); hideable: min(shared, a2a) /
  a2a, what a dispatch and a shared expert of these lengths could overlap at most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import describe_machine, format_ms, free_port  # noqa: E402
from worlds import start_world  # noqa: E402  (benchmarks/worlds.py)

from megatron.config import ModelConfig, RoutedMoEConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.process_groups import this_rank_groups  # noqa: E402
from megatron.core.tensor_parallel import expert_mappings  # noqa: E402
from megatron.model.moe_aux_loss import AuxLossTracker  # noqa: E402
from megatron.model.moe_layer import RoutedMoE  # noqa: E402


def layer_config(hidden: int, overlap: bool) -> ModelConfig:
    """The benchmark's MoE layer."""
    moe = RoutedMoEConfig(
        num_experts=8,
        moe_layers=(True,),
        top_k=2,
        ffn_hidden_size=2 * hidden,
        dispatcher="alltoall",
        shared_expert_ffn_hidden_size=4 * hidden,
        shared_expert_gate=True,
        shared_expert_overlap=overlap,
    )
    return ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        vocab_size=128,
        max_position_embeddings=16,
        activation="swiglu",
        add_bias_linear=False,
        routed_moe=moe,
    )


class TimedStart(expert_mappings._StartAllToAll):
    """`_StartAllToAll` that records when it launched."""

    launched = 0.0

    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits, in_flight):  # noqa: ANN001, ANN205
        """Launch, timed."""
        TimedStart.launched = time.perf_counter()
        return expert_mappings._StartAllToAll.forward(
            ctx, tensor, output_splits, input_splits, in_flight
        )


class TimedWait(expert_mappings._WaitAllToAll):
    """`_WaitAllToAll` that adds its time blocked and the transfer's life to the counters."""

    blocked_s = 0.0
    in_flight_s = 0.0

    @staticmethod
    def forward(ctx, output, in_flight):  # noqa: ANN001, ANN205
        """Wait, timed."""
        entered = time.perf_counter()
        result = expert_mappings._WaitAllToAll.forward(ctx, output, in_flight)
        done = time.perf_counter()
        TimedWait.blocked_s += done - entered
        TimedWait.in_flight_s += done - TimedStart.launched
        return result


def _timed(fn, barrier: bool = True) -> float:  # noqa: ANN001
    dist.barrier()
    start = time.perf_counter()
    fn()
    if barrier:
        dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, size: int, settings: dict, out_dir: str) -> None:
    """One rank of a world of EP = `size`: measure, write the results to `out_dir`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    parallel_state.initialize_model_parallel(1, 1, expert_parallel_size=size)
    # What the overlapped dispatch launches and waits on.
    expert_mappings._StartAllToAll.apply = TimedStart.apply
    expert_mappings._WaitAllToAll.apply = TimedWait.apply
    hidden, tokens = settings["hidden"], settings["tokens"]
    x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(rank))
    layers, outputs = {}, {}
    for overlap in (False, True):
        torch.manual_seed(0)
        layers[overlap] = RoutedMoE(
            layer_config(hidden, overlap), 1, this_rank_groups(), AuxLossTracker()
        )
    results = {"plain": [], "overlap": [], "a2a": [], "shared": [], "in_flight": [], "blocked": []}
    # The dispatch alone: as many rows as the layer sends (top-2, balanced).
    rows = tokens * 2
    split = [rows // size] * size
    sent = torch.randn(rows, hidden)
    for step in range(settings["warmup"] + settings["rounds"]):
        row = {}
        for overlap, name in ((False, "plain"), (True, "overlap")):
            layer = layers[overlap]
            inputs = x.clone().requires_grad_()
            TimedWait.blocked_s = TimedWait.in_flight_s = 0.0

            def run(layer=layer, inputs=inputs, overlap=overlap) -> None:  # noqa: ANN001
                out, _ = layer(inputs)
                out.square().mean().backward()
                outputs[overlap] = out.detach()

            row[name] = _timed(run)
            if overlap:
                row["blocked"], row["in_flight"] = TimedWait.blocked_s, TimedWait.in_flight_s
        # The pieces alone: the dispatch, the shared expert's forward.
        row["a2a"] = _timed(
            lambda: expert_mappings.all_to_all_over_expert_parallel(sent, split, split)
        )
        with torch.no_grad():
            row["shared"] = _timed(lambda: layers[True]._shared(x), barrier=False)
        if step >= settings["warmup"]:
            for key, value in row.items():
                results[key].append(value)
    results["identical"] = bool(torch.equal(outputs[False], outputs[True]))
    with open(os.path.join(out_dir, f"{size}-{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()


def run_world(size: int, settings: dict, out_dir: str) -> dict:
    """A world of EP = `size` ranks; rank 0's results (and every rank's bit-identity)."""
    start_world(worker, (size, settings, out_dir), size, {"MASTER_PORT": str(free_port())})
    ranks = []
    for rank in range(size):
        with open(os.path.join(out_dir, f"{size}-{rank}.json")) as file:
            ranks.append(json.load(file))
    first = ranks[0]
    first["identical"] = all(rank["identical"] for rank in ranks)
    return first


def main() -> None:
    """Parse the flags, run each EP's world, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, 2 rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    settings = dict(hidden=256, tokens=512 if args.quick else 4096, warmup=1)
    settings["rounds"] = args.rounds or (2 if args.quick else 8)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(describe_machine(f"EP gloo processes, 1 thread each; {settings}"))
    print(
        "| EP | a2a alone | shared alone | step plain | step overlapped | saved | "
        "hidden (measured) | hideable | bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory() as out_dir:
        for size in args.sizes:
            result = run_world(size, settings, out_dir)
            median = {key: statistics.median(result[key]) for key in result if key != "identical"}
            hidden = 1 - sum(result["blocked"]) / sum(result["in_flight"])
            hideable = min(median["shared"], median["a2a"]) / median["a2a"]
            saved = median["plain"] - median["overlap"]
            print(
                f"| {size} | {format_ms(median['a2a'])} | {format_ms(median['shared'])} | "
                f"{format_ms(median['plain'])} | {format_ms(median['overlap'])} | "
                f"{format_ms(saved)} | {hidden:.1%} | {hideable:.1%} | "
                f"{'yes' if result['identical'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
