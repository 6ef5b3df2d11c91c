"""Checkpoints: torch.distributed.checkpoint (DCP) with ZeRO fragments declared as boxes, saved
atomically, loaded safely into any TP x DP layout (docs/checkpoints.md). hf/ maps weights to
and from Hugging Face model families (one module per family)."""
from zo_megatron.checkpoint.load import LoadOptions, Resumed, load_checkpoint
from zo_megatron.checkpoint.save import save_checkpoint

__all__ = ["LoadOptions", "Resumed", "load_checkpoint", "save_checkpoint"]
