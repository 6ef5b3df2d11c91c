"""Every random stream a training rank draws from, captured and restored as plain JSON.

A resume is exact only if all of them continue: Python's `random`, NumPy's legacy global
generator, torch's CPU generator, the CUDA generator when there is one, and megatron-core's named
tracker streams (`model-parallel-rng` drives dropout inside tensor-parallel regions and differs
per TP rank; on CPU the tracker is megatron_cpu.CPURNGStatesTracker). Generator states are byte
tensors, kept as base64 so the file needs no pickle.
"""
from __future__ import annotations

import base64
import random

import numpy as np
import torch

MODEL_PARALLEL_STREAM = "model-parallel-rng"     # megatron's _MODEL_PARALLEL_RNG_TRACKER_NAME


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s.encode("ascii"), validate=True)), dtype=torch.uint8).clone()


def _tracker():
    from megatron.core.tensor_parallel import random as mpu_random

    return mpu_random.get_cuda_rng_tracker()


def capture_rng_state() -> dict:
    """This rank's streams as a JSON-serialisable dict."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": _b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": {name: _b64(s) for name, s in _tracker().get_states().items()},
    }
    return state


def restore_rng_state(state: dict, *, keep_model_parallel_stream: bool = False) -> None:
    """Set every stream from `state` (from capture_rng_state). keep_model_parallel_stream leaves
    this rank's TP-region dropout stream as it is: used when the TP size changed, because a
    stream saved for another TP rank's slice of the weights would repeat or mismatch masks."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    tracker = _tracker()
    current = tracker.get_states()
    states = {name: _unb64(s) for name, s in state["tracker"].items()}
    if keep_model_parallel_stream and MODEL_PARALLEL_STREAM in current:
        states[MODEL_PARALLEL_STREAM] = current[MODEL_PARALLEL_STREAM]
    tracker.set_states(states)
