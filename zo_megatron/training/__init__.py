"""The training job: arguments -> components (data, model, optimizer engine, schedule, metrics,
checkpoints) -> one loop that composes them (training/loop.py)."""
