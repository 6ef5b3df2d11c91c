"""The training job: arguments -> pre-launch checks (prelaunch.py) -> the Trainer (trainer.py),
which builds the components (data, model, optimizer engine, schedule, metrics, checkpoints) and
runs one loop that composes them. Entry: loop.pretrain()."""
