"""The offload engine's optimizer state as checkpoints see it: per-parameter fragments of this DP
rank's partition (fp32 master, exp_avg, exp_avg_sq), wherever they live (the host partition, or the
device tail with --optimizer-offload-fraction < 1). A mixin of `engine.ZeroOffloadEngine`, which
provides `layout`, `_state_pieces`, `flush`, `reload_params_from_master` and the counters.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from zo_megatron.errors import ConfigError


class EngineState:
    def _refuse_nvme(self) -> None:
        if getattr(self, "_nvme", None) is not None:
            raise ConfigError("state_dict() of optimizer states on disk would copy them all into memory: save and "
                              "load them with the DCP checkpoint (--save/--load), which streams them")

    def state_dict(self) -> dict:
        """This DP rank's optimizer state, keyed by parameter name.

        Each entry holds the piece of the (TP-local, flattened) parameter this rank owns --
        `fragment` = (start, end) -- with the parameter's TP split axis and shard offset, so a
        resharder can place it in the full tensor for any TP x DP layout.
        """
        self._refuse_nvme()
        self.flush()                       # a checkpoint holds nothing pending
        params: dict[str, dict] = {}
        for s, host, pstart, n in self.layout.host_fragments():
            p = s.param
            axis = int(getattr(p, "partition_dim", 0)) if getattr(p, "tensor_model_parallel", False) else None
            params[s.name] = {
                "local_shape": tuple(p.shape), "tp_axis": axis,
                # where this TP shard starts along tp_axis in the full (vocab-padded) tensor
                "tp_offset": 0 if axis is None else self.tp_rank * p.shape[axis],
                "fragment": (pstart, pstart + n),
                **{key: torch.cat([piece[2 + j].cpu() for piece in self._state_pieces(host, n)]).clone()
                   for j, key in enumerate(("master", "exp_avg", "exp_avg_sq"))},
            }
        return {"step": self.step_count, "adam": asdict(self.adam), "precision": self.precision,
                "dp_size": self.dp_size, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank,
                "loss_scaler": self.loss_scaler.state_dict(), "params": params}

    def host_state_views(self):
        """(name, param, start, n, views) for every piece of a parameter this DP rank owns:
        elements [start, start + n) of the flattened TP-local parameter, with `views` the matching
        slices of the host "master", "exp_avg" and "exp_avg_sq" buffers. A checkpoint writes from
        and reads into these views in place (no copy of the optimizer state); after reading, set
        step_count and the loss scaler and call reload_params_from_master()."""
        self.flush()                       # nothing may be in flight while the state is read or written
        nvme = getattr(self, "_nvme", None)
        in_memory = {k: getattr(self, k) for k in ("master", "exp_avg", "exp_avg_sq") if getattr(self, k) is not None}
        for s, host, pstart, n in self.layout.host_fragments():
            # with a partial offload a piece may be split: its tail's views live on the device
            for off, m, master, exp_avg, exp_avg_sq in self._state_pieces(host, n):
                if nvme is not None and host + off < self._cut:   # on disk: views over the mapped state files
                    yield from nvme.fragment_views([(s, host + off, pstart + off, m)], in_memory)
                    continue
                yield s.name, s.param, pstart + off, m, {"master": master, "exp_avg": exp_avg,
                                                         "exp_avg_sq": exp_avg_sq}

    def load_state_dict(self, sd: dict) -> None:
        """Inverse of state_dict() for the same layout; refuses anything that does not match."""
        self._refuse_nvme()
        params = sd.get("params", {})
        for s, host, pstart, n in self.layout.host_fragments():
            entry = params.get(s.name)
            if entry is None:
                raise ConfigError(f"optimizer state has no entry for parameter {s.name!r}")
            if tuple(entry["local_shape"]) != tuple(s.param.shape) or tuple(entry["fragment"]) != (pstart, pstart + n):
                raise ConfigError(f"optimizer state for {s.name!r} was saved for another layout "
                                  f"(shape {tuple(entry['local_shape'])}, fragment {tuple(entry['fragment'])}; "
                                  f"here {tuple(s.param.shape)}, {(pstart, pstart + n)}): reshard it first")
            for off, m, *views in self._state_pieces(host, n):
                for view, key in zip(views, ("master", "exp_avg", "exp_avg_sq")):
                    view.copy_(entry[key][off:off + m])
        self.step_count = int(sd["step"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.reload_params_from_master()
