"""The GPT-2 model, its layers, and the DeepSpeed pipeline arrangement of them."""

from megatron.model.gpt_model import GPTModel
from megatron.model.model_size import flops_per_token, model_size_report, num_parameters

__all__ = ["GPTModel", "flops_per_token", "model_size_report", "num_parameters"]
