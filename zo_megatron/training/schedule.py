"""The learning-rate schedule: Megatron-LM's `OptimizerParamScheduler`, without the optimizer.

Same names, units and timing as Megatron, so a curve from a Megatron run lines up with ours:
- steps are counted in SAMPLES (Megatron's `increment` is the global batch size), so
  `--lr-warmup-iters`, `--lr-decay-iters` and `--lr-wsd-decay-iters` become x global batch, and
  `--train-samples` runs count samples directly (with `--rampup-batch-size`, whose iterations
  differ in size, only samples: `--lr-warmup-samples`, `--lr-decay-samples`, `--lr-wsd-decay-samples`);
- an update uses the rate of the steps taken BEFORE it: the first warmup update is at
  `--lr-warmup-init` (0), the last decay update one step above `--min-lr`;
- `step()` is called only after a successful update (an fp16 step skipped for overflow does not
  advance the schedule);
- inverse-square-root gives `--min-lr` past `--lr-decay-iters`, as Megatron's does;
- `--decoupled-lr` (with `--decoupled-min-lr`, default `--min-lr`) is the peak (floor) of a second
  group, the word embedding and output layer: Megatron gives that param group its own `max_lr` /
  `min_lr` and the same scheduler, so its rate has the same warmup (from `--lr-warmup-init`) and
  decay shape (`get_decoupled_lr`). As in Megatron, `--decoupled-min-lr` alone changes nothing.

`state_dict()` holds what Megatron's holds, so a checkpoint can resume the schedule exactly.
"""
from __future__ import annotations

import math

from zo_megatron.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


class LRScheduler:
    """Learning rate as a function of the samples consumed by successful updates."""

    def __init__(self, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, init_lr: float = 0.0, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential", decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None):
        if decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {decay_style} is unknown: choose from {', '.join(DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr {min_lr:g} must be in [0, --lr {max_lr:g}]")
        if not 0.0 <= init_lr <= max_lr:
            raise ConfigError(f"--lr-warmup-init {init_lr:g} must be in [0, --lr {max_lr:g}]")
        if decay_steps <= 0:
            raise ConfigError("--lr-decay-iters must be >= 1")
        # Megatron asserts warmup < decay; warmup == decay (a run that is all warmup) is well defined
        # in its formulas too, and short test runs use it, so only a longer warmup is refused.
        if not 0 <= warmup_steps <= decay_steps:
            raise ConfigError(f"the warmup ({warmup_steps} samples) is longer than the decay "
                              f"({decay_steps} samples): lower --lr-warmup-iters or raise --lr-decay-iters")
        if decay_style == "WSD":
            if wsd_decay_steps is None:
                raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (the iterations of the "
                                  "final anneal, Megatron's flag)")
            if not 0 < wsd_decay_steps <= decay_steps:
                raise ConfigError("--lr-wsd-decay-iters must be in [1, --lr-decay-iters]")
            if wsd_decay_style not in WSD_DECAY_STYLES:
                raise ConfigError(f"--lr-wsd-decay-style {wsd_decay_style} is unknown: choose from "
                                  f"{', '.join(WSD_DECAY_STYLES)}")
        if decoupled_lr is not None:        # Megatron asserts min <= max for --lr's group only
            if decoupled_min_lr is not None and decoupled_min_lr > decoupled_lr:
                raise ConfigError(f"--decoupled-min-lr {decoupled_min_lr:g} exceeds --decoupled-lr {decoupled_lr:g}: "
                                  "the decay would climb; use --decoupled-min-lr <= --decoupled-lr")
            if decoupled_min_lr is None and min_lr > decoupled_lr:
                raise ConfigError(f"--decoupled-lr {decoupled_lr:g} is below --min-lr {min_lr:g}, where it decays to "
                                  "without --decoupled-min-lr: the decay would climb; add --decoupled-min-lr "
                                  "<= --decoupled-lr")
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        # Megatron's decoupled param group: its own max_lr, and min_lr if --decoupled-min-lr is given
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_lr is None or decoupled_min_lr is None else float(decoupled_min_lr)
        self.lr_warmup_steps, self.lr_decay_steps = int(warmup_steps), int(decay_steps)
        self.lr_decay_style = decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = wsd_decay_style
        self.num_steps = 0

    @classmethod
    def from_args(cls, args) -> "LRScheduler":
        """Megatron's `get_optimizer_param_scheduler`: iterations x global batch, or samples as given."""
        gbs = args.global_batch_size
        if getattr(args, "rampup_batch_size", None) is not None:     # iterations differ in size: samples only
            decay = args.lr_decay_samples or args.train_samples
            fraction = getattr(args, "lr_warmup_fraction", None)
            warmup = int(fraction * decay) if fraction is not None else (args.lr_warmup_samples or 0)
            return cls._from(args, warmup, decay, getattr(args, "lr_wsd_decay_samples", None))
        if args.lr_decay_iters is not None:
            decay = args.lr_decay_iters * gbs
        elif getattr(args, "train_samples", None) is not None:
            decay = args.train_samples
        else:
            decay = args.train_iters * gbs
        if getattr(args, "lr_warmup_fraction", None) is not None:
            warmup = int(args.lr_warmup_fraction * decay)
        else:
            warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if getattr(args, "lr_wsd_decay_iters", None) is not None else None
        return cls._from(args, warmup, decay, wsd)

    @classmethod
    def _from(cls, args, warmup: int, decay: int, wsd: int | None) -> "LRScheduler":
        return cls(max_lr=args.lr, min_lr=args.min_lr, warmup_steps=warmup, decay_steps=decay,
                   decay_style=args.lr_decay_style, init_lr=getattr(args, "lr_warmup_init", 0.0),
                   wsd_decay_steps=wsd, wsd_decay_style=getattr(args, "lr_wsd_decay_style", "exponential"),
                   decoupled_lr=getattr(args, "decoupled_lr", None),
                   decoupled_min_lr=getattr(args, "decoupled_min_lr", None))

    def get_decoupled_lr(self) -> float | None:
        """The decoupled group's rate for the next update (None without --decoupled-lr): Megatron's
        get_lr for a param group with max_lr = --decoupled-lr, min_lr = --decoupled-min-lr or --min-lr."""
        if self.decoupled_lr is None:
            return None
        return self.get_lr(self.decoupled_lr, self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr)

    def get_lr(self, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate for the next update (Megatron's formulas, in its order of cases); `max_lr` /
        `min_lr`: a param group's own (Megatron's param_group['max_lr'] / ['min_lr']), default --lr / --min-lr."""
        n = self.num_steps
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(self.lr_warmup_steps, 1)) / math.sqrt(max(n, 1)))
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable, then anneal over the last wsd_decay_steps
            start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= start:
                coeff = 1.0
            else:
                r = (n - start) / self.wsd_decay_steps
                coeff = {"linear": lambda: 1.0 - r, "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda: 2.0 * 0.5 ** r - 1.0,
                         "minus_sqrt": lambda: 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style]()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples; call after a SUCCESSFUL update only."""
        self.num_steps += int(increment)

    _KEYS = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
             "wsd_decay_steps", "lr_wsd_decay_style", "decoupled_lr", "decoupled_min_lr", "num_steps")

    def state_dict(self) -> dict:
        """Plain Python values (JSON- and weights_only-safe), Megatron's key names where it has them."""
        return {k: getattr(self, k) for k in self._KEYS}

    def load_state_dict(self, state: dict, *, override: bool = False, use_checkpoint: bool = False) -> None:
        """Restore the position. As Megatron: by default the settings must match this run's (a
        mismatch is one line naming the setting); `use_checkpoint` (--use-checkpoint-opt_param-scheduler)
        takes the checkpoint's settings, `override` (--override-opt_param-scheduler) keeps this run's."""
        if override and use_checkpoint:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "contradict each other: give one")
        for k in self._KEYS:
            if k == "num_steps" or k not in state or override or state[k] == getattr(self, k):
                continue
            if not use_checkpoint:
                raise ConfigError(f"the checkpoint's learning-rate schedule has {k}={state[k]!r} but this run "
                                  f"has {getattr(self, k)!r}: use the checkpoint's flags, or "
                                  f"--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler")
            setattr(self, k, state[k])
        self.num_steps = int(state["num_steps"])
