"""The GPT: megatron-core's GPTModel, exactly Hugging Face GPT-2 by default, Llama / Mistral / Qwen2 by flags."""
from .config import ARCH_FIELDS, GPTConfig
from .gpt import GPTModelTP, build_gpt_model, causal_attention_mask

__all__ = ["ARCH_FIELDS", "GPTConfig", "GPTModelTP", "build_gpt_model", "causal_attention_mask"]
