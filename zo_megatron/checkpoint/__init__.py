"""Checkpoint formats and conversions (sharded save/load and resharding land here next)."""
