"""The GPT: megatron-core's GPTModel configured to be exactly Hugging Face GPT-2."""
from .config import GPTConfig
from .gpt import GPTModelTP, build_gpt_model, causal_attention_mask

__all__ = ["GPTConfig", "GPTModelTP", "build_gpt_model", "causal_attention_mask"]
