"""Megatron-LM's MoE layer in place of a transformer layer's MLP: the router picks top-k
experts per token, a token dispatcher brings each token to the rank holding its experts, the
experts run, and the weighted outputs come back to their tokens (Megatron core's `MoELayer`).

Dispatchers (`--moe-token-dispatcher-type`), over the expert-parallel group (EP ranks, each
holding E / EP experts):
- `alltoall`: each rank sends every (token, expert) pair to the expert's rank and gets the
  results back with the reverse all-to-all; only routed copies travel.
- `allgather`: every rank gathers all EP ranks' tokens, runs its own experts on the ones routed
  to them, and a reduce-scatter sums the results back to the tokens' ranks.
At EP = 1 both run the local experts only. With `--moe-shared-expert-overlap` the all-to-all
dispatcher launches the tokens' transfer, computes the shared expert, then waits (the same
values; the transfer hidden behind the shared expert's forward). Under Megatron-LM's combined
1F1B (`comm_overlap`, set by the engine) both dispatchers' collectives, forward and backward,
are launched without waiting and travel while another micro-batch computes
(`megatron.core.pipeline_parallel.combined_1f1b`). Dropless by default: an
expert takes every token routed to it (`--moe-expert-capacity-factor` bounds it).

Expert parallelism is folded over tensor, context and data parallelism (megatron-core's
"MoE parallel folding" with `--expert-tensor-parallel-size 1`): the EP ranks are consecutive
ranks of a pipeline stage, each routing its own tokens (sequence parallelism splits them over
the tensor-parallel ranks, context parallelism over the context-parallel ranks), and the
experts stay whole. At EP = 1 the experts are replicated like the router: under sequence
parallelism their gradients are summed over the tensor-parallel ranks.

Parameter names: `mlp.router.weight` ([E, h]), `mlp.experts.weight1/weight2` (and biases;
stacked over this rank's experts, `moe_experts.py`), `mlp.shared_experts.*` (Megatron-LM's
shared expert, our MLP with `--moe-shared-expert-intermediate-size`). With expert parallelism
the expert parameters carry `allreduce = False`: their gradients are reduced over the ranks
holding the same experts (`reduce_expert_gradients`), not over all data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.pipeline_parallel.combined_1f1b import (
    Combined1F1B,
    with_deferred_weight_grads,
)
from megatron.core.process_groups import ModelGroups, RankGroup
from megatron.core.tensor_parallel import mark_sequence_parallel
from megatron.core.tensor_parallel.expert_mappings import (
    all_to_all_hidden,
    all_to_all_over_expert_parallel,
    all_to_all_over_expert_parallel_while,
    exchange_counts_over_expert_parallel,
    gather_from_expert_parallel_region,
    gather_hidden,
    gather_indices_from_expert_parallel_region,
    reduce_expert_gradient,
    reduce_scatter_hidden,
    reduce_scatter_to_expert_parallel_region,
)
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter
from megatron.model.mlp import ParallelMLP
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.moe_experts import GroupedExperts
from megatron.model.moe_router import TopKRouter
from megatron.model.utils import checkpointed_pair, init_method_normal, recomputes

EXPERT_GROUP_NAME = "expert_model_parallel"
"""`group_name` of the routed experts' parameters (DeepSpeed-MoE's are named by their EP)."""


class RoutedMoE(nn.Module):
    """[s, b, h] -> ([s, b, h], None): routed experts (plus the shared expert, if any)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
    ) -> None:
        super().__init__()
        moe = config.routed_moe
        assert moe is not None
        self.groups = groups
        ep = groups.expert.size
        if moe.num_experts % ep != 0:
            raise ValueError(
                f"--num-experts {moe.num_experts} is not divisible by "
                f"--expert-model-parallel-size {ep}"
            )
        self.num_local_experts = moe.num_experts // ep
        self.first_expert = groups.expert.rank * self.num_local_experts
        self.dispatcher = moe.dispatcher
        token_group = tokens_shared_with(config, groups)
        if token_group.size > 1:  # the logged losses are summed over its ranks' parts
            moe_losses.sum_parts_over(token_group.group)
        self.router = TopKRouter(config, layer_number, moe_losses, token_group)
        self.experts = GroupedExperts(config, self.num_local_experts, self.first_expert)
        for param in self.experts.parameters():
            if ep > 1:  # each rank holds other experts: DeepSpeed's mark, read by the grad norm
                param.allreduce = False
                param.group_name = EXPERT_GROUP_NAME
                # Whole on each rank of an EP group that spans tensor-parallel ranks: not a
                # tensor-parallel duplicate (the gradient norm counts it there too).
                param.expert_folded_over_tensor_ranks = True
            elif config.sequence_parallel:  # replicated, each TP rank's tokens
                mark_sequence_parallel(param)
        if moe.shared_expert_ffn_hidden_size:
            shared = dataclasses.replace(config, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
            self.shared_experts = ParallelMLP(shared)
            if moe.shared_expert_gate:  # megatron-core's name: mlp.shared_experts.gate_weight
                gate = new_parameter((1, config.hidden_size), config.torch_dtype)
                initialize(gate, init_method_normal(config.init_method_std))
                self.shared_experts.gate_weight = gate
                if config.sequence_parallel:  # each tensor-parallel rank gates its own tokens
                    mark_sequence_parallel(gate)
        else:
            self.shared_experts = None
        self.overlap_shared = moe.shared_expert_overlap and self.shared_experts is not None
        # --recompute-modules shared_experts (not when the whole layer is recomputed: moe).
        self.recompute_shared = recomputes(config, "shared_experts") and not recomputes(
            config, "moe"
        )
        # Megatron-LM's combined 1F1B, set by the engine (`attach_combined_1f1b`).
        self.comm_overlap: Combined1F1B | None = None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """[s, b, h] -> ([s, b, h], no separate bias)."""
        seq_length, batch, width = hidden.shape
        tokens = hidden.reshape(-1, width)  # [T, h], T = s x b
        probs, routing_map = self.router(tokens, seq_length)  # [T, E] each
        shared = None
        if self.dispatcher == "alltoall":
            # --moe-shared-expert-overlap: the shared expert runs while the tokens travel.
            during = (lambda: self._shared(hidden)) if self.overlap_shared else None
            output, shared = self._all_to_all(tokens, probs, routing_map, during)
        else:
            output = self._all_gather(tokens, probs, routing_map)
        output = output.view(seq_length, batch, width)
        if self.shared_experts is not None:
            output = output + (self._shared(hidden) if shared is None else shared)
        return output, None

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (gated, with `--moe-shared-expert-gate`): [s, b, h]."""
        if self.recompute_shared and self.training and torch.is_grad_enabled():
            shared, bias = checkpointed_pair(self.shared_experts, hidden)
        else:
            shared, bias = self.shared_experts(hidden)
        shared = shared if bias is None else shared + bias
        gate = getattr(self.shared_experts, "gate_weight", None)
        if gate is not None:
            shared = shared * torch.sigmoid(F.linear(hidden, gate))
        return shared

    def _all_to_all(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        during: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' output [T, h] through the all-to-all dispatcher, and what
        `during()` computes while the dispatched tokens travel (None without it)."""
        # (expert, token) pairs in expert order: the row order of every expert's input.
        expert_ids, token_ids = routing_map.t().nonzero(as_tuple=True)  # [N] each
        weights = probs.t()[expert_ids, token_ids]  # [N]
        permuted = tokens[token_ids]  # [N, h]
        ep, local = self.groups.expert.size, self.num_local_experts
        counts = routing_map.sum(dim=0).view(ep, local)  # [EP, local]: to each rank's experts
        received_counts = exchange_counts_over_expert_parallel(counts)  # [EP, local]: from each
        sent, received = counts.sum(dim=1).tolist(), received_counts.sum(dim=1).tolist()
        computed, overlap = None, self._overlap()
        if overlap is not None:  # by (source, expert), the other micro-batch computing
            arrived = all_to_all_hidden(permuted, received, sent, overlap)
        elif during is None:
            arrived = all_to_all_over_expert_parallel(permuted, received, sent)
        else:
            arrived, computed = all_to_all_over_expert_parallel_while(
                permuted, received, sent, during
            )
        order = _by_expert_then_source(received_counts)
        outputs = self._experts(arrived[order], received_counts.sum(dim=0).tolist())
        outputs = outputs[_inverse(order)]
        if overlap is not None:
            returned = all_to_all_hidden(outputs, sent, received, overlap)
        else:
            returned = all_to_all_over_expert_parallel(outputs, sent, received)
        return _combine(returned, weights, token_ids, tokens.shape[0]), computed

    def _all_gather(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> torch.Tensor:
        overlap = self._overlap()
        if overlap is not None:  # [EP x T, h], [EP x T, E], [EP x T, E]
            everyone, all_probs, all_map = gather_hidden(
                overlap, tokens, probs, routing_map.to(torch.uint8)
            )
        else:
            everyone = gather_from_expert_parallel_region(tokens)
            all_probs = gather_from_expert_parallel_region(probs)
            all_map = gather_indices_from_expert_parallel_region(routing_map.to(torch.uint8))
        all_map = all_map.bool()
        mine = slice(self.first_expert, self.first_expert + self.num_local_experts)
        expert_ids, token_ids = all_map[:, mine].t().nonzero(as_tuple=True)
        weights = all_probs[:, mine].t()[expert_ids, token_ids]
        outputs = self._experts(everyone[token_ids], all_map[:, mine].sum(dim=0).tolist())
        combined = _combine(outputs, weights, token_ids, everyone.shape[0])  # [EP x T, h]
        if overlap is not None:
            return reduce_scatter_hidden(combined, overlap)
        return reduce_scatter_to_expert_parallel_region(combined)

    def _overlap(self) -> Combined1F1B | None:
        """The combined 1F1B hiding this layer's collectives: in training forwards with
        expert parallelism (evaluation and generation run them in line)."""
        if self.comm_overlap is None or self.groups.expert.size == 1:
            return None
        return self.comm_overlap if self.training and torch.is_grad_enabled() else None

    def _experts(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on `tokens` grouped by expert; under `--delay-wgrad-compute`
        their weight gradients wait for the backward's next collective."""
        overlap = self._overlap()
        if overlap is None or not overlap.delay_weight_grads:
            return self.experts(tokens, counts)
        params = list(self.experts.parameters())
        return with_deferred_weight_grads(
            overlap, lambda rows: self.experts(rows, counts), params, tokens
        )


def tokens_shared_with(config: ModelConfig, groups: ModelGroups) -> RankGroup:
    """The ranks holding the other tokens of this rank's micro-batch: tensor x context
    parallel under sequence parallelism, else the sequence split (context parallelism or
    Ulysses); one rank when the micro-batch is whole here."""
    if config.sequence_parallel and groups.tensor.size > 1:
        return groups.tensor_sequence
    return groups.context if groups.context.size > 1 else groups.ulysses


def _by_expert_then_source(counts: torch.Tensor) -> torch.Tensor:
    """Row order regrouping chunks laid out (source rank, expert) into (expert, source rank);
    `counts` [EP, local] are the chunk sizes."""
    sizes = counts.flatten().tolist()
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    ep, local = counts.shape
    pieces = [
        torch.arange(starts[r * local + e], starts[r * local + e] + sizes[r * local + e])
        for e in range(local)
        for r in range(ep)
    ]
    return torch.cat(pieces).to(counts.device)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _combine(
    outputs: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Sum each token's expert outputs times their routing weights: [N, h] -> [T, h]."""
    weighted = outputs * weights.to(outputs.dtype).unsqueeze(-1)
    combined = outputs.new_zeros((num_tokens, outputs.shape[-1]))
    return combined.index_add(0, token_ids, weighted)


def routed_moe_layers(model: nn.Module) -> list[RoutedMoE]:
    """The model's Megatron-LM MoE layers."""
    return [module for module in model.modules() if isinstance(module, RoutedMoE)]


def attach_combined_1f1b(model: nn.Module, overlap: Combined1F1B) -> None:
    """Let `overlap` hide the expert-parallel collectives of `model`'s MoE layers
    (`--overlap-moe-expert-parallel-comm`)."""
    for layer in routed_moe_layers(model):
        layer.comm_overlap = overlap


def reduce_expert_gradients(model: nn.Module) -> None:
    """With expert parallelism, the routed experts' gradients (left out of the data-parallel
    reduction): see `reduce_expert_gradient`. Without it, they are averaged with the rest."""
    for layer in routed_moe_layers(model):
        groups = layer.groups
        if groups.expert.size == 1:
            continue
        # FSDP2 (DTensor gradients) averaged them over the expert-data ranks already
        # (engines/fsdp.py): Megatron-LM's scaling is their sum / DP.
        sharded_scale = groups.expert_data_size / groups.sequence_data_size
        for param in layer.experts.parameters():
            if param.grad is None:
                continue
            if not hasattr(param.grad, "to_local"):
                reduce_expert_gradient(param.grad)
            elif sharded_scale != 1.0:
                param.grad.mul_(sharded_scale)


def update_expert_biases(model: nn.Module) -> None:
    """After a step's backward: move the aux-loss-free routers' expert biases toward even
    loads, counted over every rank of this pipeline stage (Megatron-LM's TP x DP x CP)."""
    for layer in routed_moe_layers(model):
        if layer.router.expert_bias is not None:
            layer.router.update_expert_bias(layer.groups.stage)


def finish_moe_backward(model: nn.Module) -> None:
    """What a step does between the backward and the optimizer for Megatron-LM's MoE layers:
    reduce the expert gradients, update the expert biases."""
    reduce_expert_gradients(model)
    update_expert_biases(model)


def names_outside_data_parallel(model: nn.Module) -> list[str]:
    """Parameters and buffers DDP must leave alone: experts under expert parallelism (reduced
    apart) and the routers' load counts (each rank's own until the step sums them)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, RoutedMoE):
            names += [f"{name}.router.{buffer}" for buffer, _ in module.router.named_buffers()]
            if module.groups.expert.size > 1:
                names += [
                    f"{name}.experts.{param}" for param, _ in module.experts.named_parameters()
                ]
    return names
