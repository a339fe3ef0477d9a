"""Megatron-LM's top-k router: which experts each token goes to, with what weight, and the
load-balancing losses (Megatron core's `TopKRouter`, same flags and arithmetic).

Scores: softmax of the logits over the chosen k (or over all experts first, with
`--moe-router-pre-softmax`), or sigmoid normalized over the chosen k (DeepSeek-V3). With
`--moe-router-enable-expert-bias` a per-expert bias is added to the scores when choosing the
experts only (the weights stay unbiased) and moved after every step toward even loads
(`update_expert_biases`; aux-loss-free balancing, arXiv 2408.15664). With
`--moe-router-num-groups G --moe-router-group-topk g` (DeepSeek-V3's node-limited routing) a
token first picks the g groups of experts whose top k / g scores sum highest, then its k
experts among them; `--moe-router-force-load-balancing` (Megatron-LM's benchmarking mode)
replaces the logits by normal noise whose gradient passes straight through. The losses reach the
backward through autograd (`megatron.model.moe_aux_loss`): the z-loss through the logits,
the load-balancing loss through the routing weights.

Under sequence parallelism and context parallelism each rank routes its own tokens of the
micro-batch, and the losses are megatron-core's over the whole micro-batch: the experts' loads
are summed over the ranks sharing it (`token_group`, the tensor x context-parallel ranks), each
rank's loss is its tokens' part of the whole (the parts add up in the logged value), and the
router's weight, replicated over tensor-parallel ranks, has its gradient summed over them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, RoutedMoEConfig
from megatron.core.process_groups import RankGroup
from megatron.core.tensor_parallel import get_cuda_rng_tracker, mark_sequence_parallel
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter
from megatron.model.moe_aux_loss import AuxLossTracker, attach_aux_loss
from megatron.model.utils import init_method_normal

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
LOGGED_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
"""Megatron-LM's log-line names of the load-balancing losses (unweighted, mean over layers)."""


class TopKRouter(nn.Module):
    """hidden [T, h] -> (routing weights [T, E], routing map [T, E] bool), E = all experts."""

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        moe_losses: AuxLossTracker,
        token_group: RankGroup | None = None,
    ) -> None:
        super().__init__()
        moe = config.routed_moe
        assert moe is not None
        self.moe: RoutedMoEConfig = moe
        self.layer_number = layer_number
        """The layer's number in the model (from 1), for the logged losses."""
        self.moe_losses = moe_losses  # the model's tracker (megatron.model.moe_aux_loss)
        self.token_group = token_group or RankGroup()
        """The ranks holding the other tokens of this rank's micro-batch (tensor x context
        parallel under sequence parallelism): the losses are over all of them."""
        # Each split rank's part of the losses is scaled as its part of the LM loss is.
        self.gradient_scale = config.sequence_split_gradient_scale
        self.weight = new_parameter((moe.num_experts, config.hidden_size), config.torch_dtype)
        initialize(self.weight, init_method_normal(config.init_method_std))
        # A bias on the logits with the linear layers' (megatron-core's; gpt-oss's router).
        self.bias = None
        if config.add_bias_linear:
            self.bias = new_parameter((moe.num_experts,), config.torch_dtype)
            initialize(self.bias, init_method_normal(config.init_method_std))
        if config.sequence_parallel:  # each tensor-parallel rank routes its own tokens
            for param in (self.weight, self.bias):
                if param is not None:
                    mark_sequence_parallel(param)
        if moe.expert_bias:
            # fp32 buffers: saved with the model, identical on every rank of a stage.
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
            self.register_buffer("local_tokens_per_expert", torch.zeros(moe.num_experts))
        else:
            self.expert_bias = None

    def forward(self, hidden: torch.Tensor, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, h] tokens ([s, b] flattened, `seq_length` = s) -> weights and map, [T, E]."""
        logits = self._logits(hidden)  # [T, E]
        if self.moe.force_load_balancing:
            logits = RandomLogits.apply(logits)
        # Full recomputation first runs each layer without gradients (the logged losses are
        # recorded then: that forward is the step's), then again in the backward (the losses
        # join the graph then; that pass is outside the step's forwards, so records nothing).
        training = self.training
        backward = training and torch.is_grad_enabled()
        if training and self.moe.z_loss_coeff:
            # This rank's part of the mean over the micro-batch's tokens.
            z_loss = torch.logsumexp(logits.float(), dim=-1).square().mean() / self.token_group.size
            self.moe_losses.record_metric("z_loss", self.layer_number, z_loss)
            logits = self._with_loss(logits, z_loss * self.moe.z_loss_coeff, backward)
        probs, routing_map = topk_routing(logits, self.moe, self.expert_bias)
        if self.moe.capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, self.moe)
        if training and self.moe.load_balancing != "none" and self.moe.aux_loss_coeff > 0:
            loss = load_balancing_loss(logits, self.moe, seq_length, self.token_group)
            self.moe_losses.record_metric(
                LOGGED_NAMES[self.moe.load_balancing], self.layer_number, loss
            )
            probs = self._with_loss(probs, loss * self.moe.aux_loss_coeff, backward)
        if backward and self.expert_bias is not None:  # counted once per token
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _with_loss(self, output: torch.Tensor, loss: torch.Tensor, backward: bool) -> torch.Tensor:
        """`output` carrying the weighted `loss` into the backward where there is one; the
        loss is recorded for the log line either way."""
        if backward:
            return attach_aux_loss(output, loss, self.gradient_scale, self.moe_losses)
        self.moe_losses.record(loss)
        return output

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = ROUTER_DTYPES[self.moe.router_dtype]
        if dtype is None:
            return F.linear(hidden, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.to(dtype)
        # Outside autocast, which would compute the product in half precision.
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), self.weight.to(dtype), bias)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None) -> None:
        """Move each expert's bias by the update rate toward the mean load (sign of the gap)
        of the loads counted since the last update, summed over `group`; reset the counts."""
        counts = self.local_tokens_per_expert
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        gap = counts.mean() - counts
        self.expert_bias += torch.sign(gap) * self.moe.bias_update_rate
        counts.zero_()


def topk_routing(
    logits: torch.Tensor, moe: RoutedMoEConfig, expert_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-LM's `topk_routing_with_score_function`: weights [T, E] (zero off the chosen
    experts) and the boolean routing map [T, E]."""
    k = moe.top_k
    if moe.score_function == "softmax":
        if moe.pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            chosen = _choose(scores, moe, expert_bias)
            probs = scores.gather(1, chosen)
        else:
            chosen = _choose(logits.float(), moe, expert_bias)
            probs = torch.softmax(logits.gather(1, chosen), dim=-1, dtype=torch.float32)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float())
        chosen = _choose(scores, moe, expert_bias)
        probs = scores.gather(1, chosen)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.topk_scaling_factor:
        probs = probs * moe.topk_scaling_factor
    probs = probs.type_as(logits)
    dense = torch.zeros_like(logits).scatter(1, chosen, probs)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return dense, routing_map


def _choose(
    scores: torch.Tensor, moe: RoutedMoEConfig, expert_bias: torch.Tensor | None
) -> torch.Tensor:
    """The k experts of highest score (plus the expert bias, when there is one), within each
    token's chosen groups under group-limited routing: [T, k]."""
    if expert_bias is not None:
        scores = scores + expert_bias.float()
    if moe.group_topk:
        scores = group_limited_scores(scores, moe.top_k, moe.num_groups, moe.group_topk)
    return torch.topk(scores, k=moe.top_k, dim=1).indices


def group_limited_scores(
    scores: torch.Tensor, k: int, num_groups: int, group_topk: int
) -> torch.Tensor:
    """[T, E] scores with every expert outside each token's `group_topk` best groups at -inf;
    a group's worth is the sum of its top k / group_topk scores (megatron-core's
    `group_limited_topk`)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    worth = grouped.topk(k // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best = worth.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(worth, dtype=torch.bool).scatter(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)


class RandomLogits(torch.autograd.Function):
    """`--moe-router-force-load-balancing`: standard normal logits in place of the router's,
    drawn on the model-parallel stream (each tensor-parallel rank its own, as megatron-core's
    `RandomSTE` on its expert stream); the gradient goes to the router's logits unchanged."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """Normal noise of `logits`' shape and dtype."""
        with get_cuda_rng_tracker().fork():
            return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """Straight through."""
        return grad


def expert_capacity(moe: RoutedMoEConfig, tokens: int) -> int | None:
    """Tokens each expert keeps of a micro-batch's `tokens` (--moe-expert-capacity-factor):
    ceil(T x k / E x factor); None when nothing is dropped (no capacity factor, or a capacity
    of at least every token). The planner counts the kept rows with it too."""
    if moe.capacity_factor is None:
        return None
    kept = math.ceil(tokens * moe.top_k / moe.num_experts * moe.capacity_factor)
    return None if kept >= tokens else kept


def drop_over_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, moe: RoutedMoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `expert_capacity` tokens per expert: those of highest weight
    (`--moe-token-drop-policy probs`) or the first ones (`position`)."""
    tokens, experts = routing_map.shape
    capacity = expert_capacity(moe, tokens)
    if capacity is None:
        return probs, routing_map
    if moe.drop_policy == "probs":
        rank_by = probs.detach().float().masked_fill(~routing_map, -1.0)
    else:  # position: the earliest tokens first
        order = torch.arange(tokens, 0, -1, device=probs.device, dtype=torch.float32)
        rank_by = order[:, None].expand(tokens, experts).masked_fill(~routing_map, -1.0)
    kept = torch.topk(rank_by, k=capacity, dim=0).indices  # [capacity, E]
    keep = torch.zeros_like(routing_map).scatter(0, kept, True) & routing_map
    return probs * keep, keep


def load_balancing_loss(
    logits: torch.Tensor,
    moe: RoutedMoEConfig,
    seq_length: int,
    token_group: RankGroup | None = None,
) -> torch.Tensor:
    """The Switch-Transformer loss E x sum_i f_i x P_i over the micro-batch (aux_loss), or per
    sequence and averaged over the sequences (seq_aux_loss), from scores over all experts.

    With `token_group` (ranks holding the rest of the micro-batch: sequence, context
    parallelism) the loads f_i are counted over all of them and this rank's scores give its
    part of P_i: the parts add up to the loss of the whole micro-batch (megatron-core's
    `switch_load_balancing_loss_func` with its tp-cp token counts)."""
    experts, k = moe.num_experts, moe.top_k
    if moe.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(scores, k=k, dim=1).indices
    routed = torch.zeros_like(scores).scatter(1, chosen, 1.0)  # [T, E]
    if moe.load_balancing == "seq_aux_loss":
        # [s, b x E]: each sequence's experts side by side; the sum is over the sequences.
        batch = scores.shape[0] // seq_length
        scores = scores.reshape(seq_length, batch * experts)
        routed = routed.reshape(seq_length, batch * experts)
        tokens = seq_length
    else:
        batch, tokens = 1, scores.shape[0]
    loads = routed.sum(dim=0)
    group = token_group or RankGroup()
    if group.size > 1:  # every rank's tokens count toward the loads
        dist.all_reduce(loads, group=group.group)
        tokens *= group.size
    loss = (scores.sum(dim=0) * loads).sum() * experts / (k * tokens * tokens)
    return loss / batch
