"""Loss scaling for fp16: Megatron's dynamic scaler (growth interval, hysteresis, minimum).

The overflow verdict is agreed by all ranks before it reaches the scaler (the engine all-reduces
"found inf" over the whole world), so every rank skips the same steps and keeps the same scale.
"""
from __future__ import annotations


class ConstantLossScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])


class DynamicLossScaler:
    """On overflow: after `hysteresis` consecutive overflows, scale *= backoff (not below min).
    After `growth_interval` clean steps in a row: scale *= growth."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError("loss scales must be positive")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])
