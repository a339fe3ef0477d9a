"""FP8 matmuls for the transformer layers' linear layers, through torchao's float8 training.

Megatron-LM runs FP8 through Transformer Engine; here torchao's float8 training
(`torchao.float8`, the engine torchtitan uses) casts each linear layer's input, weight and
output gradient to FP8 with one scale per tensor from its current amax (the `tensorwise`
recipe, Transformer Engine's Float8CurrentScaling) and multiplies them with torch's scaled
matmul (`torch._scaled_mm`: Hopper/Ada tensor cores on GPUs, a reference kernel on CPUs, so the
numerics are tested on any machine).

torchao converts `nn.Linear` modules; our tensor-parallel layers are not ones, so each keeps
its own communication and calls torchao's FP8 matmul (`matmul_with_hp_or_float8_args`, what
`Float8Linear.forward` calls) on its shard: a `Float8Matmul` set as the layer's `fp8_matmul`.
Each shard is scaled by its own amax (as Transformer Engine's current scaling does with
tensor-parallel weights), so TP=2 equals TP=1 to FP8's precision, not bit for bit.

What stays in the run's precision, as in Megatron-LM: the embedding, the output layer, the
MoE routers, Megatron-LM MoE's grouped expert matmul (torchao's FP8 grouped matmul is a GPU
prototype), attention's softmax(QK^T)V, and the first / last layers under
`--first-last-layers-bf16`. Parameters, gradients, optimizer state and checkpoints keep their
dtypes: FP8 copies of weights exist only inside each matmul, or, under FSDP2 with
`--fp8-param-gather`, in the all-gather that builds them (`cast_weights_before_all_gather`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from megatron.config import Fp8Config
from megatron.extensions import install_hint

TORCHAO_FP8 = f"torchao>=0.16: {install_hint('torchao', 'fp8')}"

# Transformer Engine's FP8 GEMMs and torch._scaled_mm need compute capability 8.9 (Ada) or
# 9.0+ (Hopper, Blackwell).
MIN_CUDA_CAPABILITY = (8, 9)


def import_torchao_float8():
    """torchao's float8 modules, imported quietly (its optional CUDA extensions and a torch
    deprecation note would otherwise print at every start-up on machines without them)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.float8 import config as float8_config
        from torchao.float8 import float8_linear
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8_config, float8_linear


def has_fp8_tensor_cores(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of compute `capability` (major, minor) multiplies in FP8: sm_89 or
    newer. `fp8_support` refuses FP8 training on others; the planner notes it too."""
    return capability >= MIN_CUDA_CAPABILITY


def fp8_support(device: torch.device) -> str | None:
    """None where FP8 training runs on `device`, else the one-line reason it does not."""
    try:
        import_torchao_float8()
    except ImportError as error:
        return f"FP8 training here needs {TORCHAO_FP8}: {error}"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if not has_fp8_tensor_cores(capability):
            return (
                f"{torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}) has "
                "no FP8 tensor cores; FP8 matmuls need sm_89 or newer (Ada, Hopper, Blackwell)"
            )
    elif device.type != "cpu":
        return f"FP8 matmuls are built for CUDA GPUs and CPUs, not {device.type}"
    return None


class Float8Matmul:
    """F.linear(input, weight, bias) with input, weight and output gradient in FP8.

    The output has the input's dtype (under autocast, autocast's half type, as F.linear's);
    the gradients reach the weight and the input in their own dtypes. A weight FSDP2 gathered
    in FP8 (`cast_weights_before_all_gather`) arrives cast and is used as it is.
    """

    def __init__(self, config: Fp8Config) -> None:
        float8_config, float8_linear = import_torchao_float8()
        self.config = config
        self.torchao_config = _torchao_config(config, float8_config)
        self._matmul = float8_linear.matmul_with_hp_or_float8_args
        # Float8Linear builds the scaled-matmul settings (fast accumulation in the forward,
        # exact in the two backward matmuls) from the config: borrowed from one on `meta`.
        reference = float8_linear.Float8Linear(
            16, 16, bias=False, device="meta", config=self.torchao_config
        )
        self.mm_config = reference.linear_mm_config

    def __call__(
        self, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[..., in] x [out, in] (+ [out]) -> [..., out]."""
        device = input_.device.type
        if torch.is_autocast_enabled(device):
            input_ = input_.to(torch.get_autocast_dtype(device))
        output = self._matmul.apply(input_, weight.t(), self.mm_config, self.torchao_config)
        if bias is not None:
            output = output + bias.to(output.dtype)
        return output

    def __repr__(self) -> str:
        return f"Float8Matmul({describe(self.config)})"


def _torchao_config(config: Fp8Config, float8_config):
    """torchao's Float8LinearConfig for Megatron-LM's format and recipe."""
    cast = float8_config.CastConfig
    kwargs = {}
    if config.format == "e4m3":
        # torchao's tensorwise default is Megatron-LM's hybrid: E5M2 output gradients.
        kwargs["cast_config_grad_output"] = cast(target_dtype=float8_config.e4m3_dtype)
    if config.param_gather:
        kwargs["enable_fsdp_float8_all_gather"] = True
    if not config.wgrad:
        disabled = float8_config.ScalingType.DISABLED
        kwargs["cast_config_input_for_grad_weight"] = cast(scaling_type=disabled)
        kwargs["cast_config_grad_output_for_grad_weight"] = cast(scaling_type=disabled)
    return float8_config.Float8LinearConfig(**kwargs)


def describe(config: Fp8Config) -> str:
    """The recipe in words, for the start-up line: `hybrid tensorwise (torchao)`."""
    words = f"{config.format} {config.recipe} (torchao)"
    if not config.wgrad:
        words += ", weight gradients in high precision"
    return words


def use_fp8_matmuls(layer: nn.Module, config: Fp8Config) -> int:
    """Give every tensor-parallel linear layer inside `layer` (a transformer layer) the FP8
    matmul; returns how many took it. Routers and grouped experts are not such layers."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    matmul = Float8Matmul(config)
    count = 0
    for module in layer.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8_matmul = matmul
            count += 1
    return count


def cast_weights_before_all_gather(model: nn.Module) -> int:
    """Under FSDP2, before `fully_shard`: make each FP8 layer's weight (where its config asks for
    `param_gather`) torchao's `WeightWithDynamicFloat8CastTensor`, as `Float8Linear.from_float`
    does under `enable_fsdp_float8_all_gather`; returns how many.

    FSDP2 then casts each rank's shard of the fp32 weight to FP8 with one scale from the amax
    over the shards (a one-number all-reduce per weight per gather), all-gathers the FP8 bytes,
    and hands the layer a `Float8TrainingTensor` of FSDP2's compute dtype, which `Float8Matmul`
    takes as already cast. The shard stays the fp32 master weight for the optimizer, the
    gradient clipping and the checkpoints: the wrapper runs every other op on it and returns
    plain tensors (a gathered full state dict holds plain fp32 tensors; loading copies into
    the wrapped shard). torchao's `precompute_float8_dynamic_scale_for_fsdp` (torchtitan calls it
    after each optimizer step) only trades those small all-reduces for one, with the same
    scales, and finds `Float8Linear` modules only: not called here. torchao is imported only
    when such a layer exists: a run without FP8 needs no fp8 extra."""
    count = 0
    for module in model.modules():
        matmul = getattr(module, "fp8_matmul", None)
        if matmul is None or not matmul.config.param_gather:
            continue
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        weight = module.weight
        target_dtype = matmul.torchao_config.cast_config_weight.target_dtype
        cast = WeightWithDynamicFloat8CastTensor(weight.detach(), matmul.mm_config, target_dtype)
        module.weight = nn.Parameter(cast, requires_grad=weight.requires_grad)
        count += 1
    return count


def fp8_report(model: nn.Module) -> str:
    """The start-up line: how many of this rank's linear layers multiply in FP8, and how."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    linears = [
        module
        for module in model.modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    ]
    matmuls = [module.fp8_matmul for module in linears if module.fp8_matmul is not None]
    recipe = describe(matmuls[0].config) if matmuls else "none on this rank"
    return (
        f" > FP8 matmuls: {len(matmuls)} of this rank's {len(linears)} tensor-parallel linear "
        f"layers, {recipe}; the embedding, output layer, routers and grouped experts in the run's "
        "precision"
    )
