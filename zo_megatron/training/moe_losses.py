"""The router's auxiliary losses in the job (docs/moe.md): the scale of their gradient and their log.

megatron-core's router adds the load-balancing loss and the z-loss to the gradient through
`MoEAuxLossAutoScaler`, whose backward ignores the loss the job backpropagates and hands the aux
loss the gradient `main_loss_backward_scale`. Megatron-LM's schedule sets it before each backward to
the loss scale / the number of micro-batches (schedules.py, forward_step), the factor the language
model's loss gets: without it the aux loss's gradient is too large by the micro-batches and, under
fp16, too small by the loss scale. `set_scale` does the same.

The log is Megatron-LM's (training.py's training_log -> megatron-core's track_moe_metrics): each
loss the router saved in megatron-core's tracker (per layer, the coefficient divided out), summed over
the tracker's reduce group, averaged over DP where that group has no DP ranks, times 1 / micro-batches,
summed over the layers / the MoE layers; the console line and the --log-jsonl rows show its mean over
the log interval under megatron-core's names (`load_balancing_loss`, `seq_load_balancing_loss`,
`z_loss`). The tracker keeps adding over the interval and is reduced once at its end (the same sums:
every step is linear), with sum-then-divide in place of ReduceOp.AVG, which gloo lacks. `loss`
stays the language model's loss (Megatron-LM's "lm loss").

The row also has the tokens each expert received per iteration (`tokens_per_expert_min` / `_mean`
/ `_max` over every MoE layer's experts): a forward hook on each router adds up its routing map
(token, expert) during training forwards (not evaluation; a recomputed forward once: the first runs
without grad), summed over the world at the row (each rank routes its own tokens: its DP share, its
sequence-parallel share of them). The mean is tokens x top-k / experts; min and max show the balance.
"""
from __future__ import annotations

import torch

from zo_megatron.offload.device import host_value
from zo_megatron.parallel import collectives


def tracked_names(cfg) -> list[str]:
    """Megatron-LM's track_names: the load-balancing loss of its type, the z-loss when it has a coefficient."""
    names = []
    if "aux_loss" in cfg.moe_router_load_balancing_type:      # Megatron's test: seq_aux_loss counts both
        names.append("load_balancing_loss")
    if cfg.moe_router_load_balancing_type == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if cfg.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class MoELosses:
    """The job's aux-loss component: `set_scale` before each iteration's backward, `window(iterations)`
    when a log row is written (a collective over the world: every rank calls it)."""

    def __init__(self, cfg, ps, model=None, per_layer: bool = False):
        self.names = tracked_names(cfg)
        self.per_layer = per_layer                  # --moe-per-layer-logging: each layer's value too
        self.num_layers, self.moe_layers = cfg.num_layers, sum(cfg.moe_layers())
        self.ps = ps
        # each tracked loss summed over the window's iterations, each iteration's micro-batches averaged
        # (end_iteration): a --rampup-batch-size window mixes iterations of different micro-batch counts
        self.window_sums = {name: torch.zeros(self.num_layers, dtype=torch.float64, device=ps.device)
                            for name in self.names}
        self.routed: list[torch.Tensor] = []                # per router: (token, expert) pairs per expert
        # the gradient scale lives in one device scalar refilled when it changes: a tensor built from a
        # Python float every iteration is a blocking pageable host-to-device copy on CUDA (issue 34, 2.6)
        self._scale, self._scale_value = None, None
        self.hooks = [] if model is None else [self._count(m) for m in _routers(model)]

    def _count(self, router):
        counts = torch.zeros(router.config.num_moe_experts, dtype=torch.float64, device=self.ps.device)
        self.routed.append(counts)

        def hook(module, _inputs, output):
            if module.training and torch.is_grad_enabled():
                counts.add_(output[1].sum(dim=0).to(counts.dtype))
        return router.register_forward_hook(hook)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def set_scale(self, loss_scale: float, micro_batches: float) -> None:
        """The aux losses' gradient: the loss scale / the iteration's micro-batches, as the LM loss's
        (set every iteration: a dynamic fp16 scale moves, a batch ramp adds micro-batches)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        value = loss_scale / micro_batches
        if self._scale is None:
            self._scale = torch.full((), value, dtype=torch.float32, device=self.ps.device)
        elif value != self._scale_value:            # rounded to fp32 by fill_ as torch.full rounds it
            self._scale.fill_(value)
        self._scale_value = value
        if MoEAuxLossAutoScaler.main_loss_backward_scale is not None and \
                MoEAuxLossAutoScaler.main_loss_backward_scale.device != self._scale.device:
            MoEAuxLossAutoScaler.main_loss_backward_scale = None       # another run's, on another device
        MoEAuxLossAutoScaler.set_loss_scale(self._scale)

    def end_iteration(self, micro_batches: int) -> None:
        """Move this iteration's tracker sums into the window as their mean over its micro-batches
        (device adds, no host read; the tracker's reduce groups stay for `window`)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        for name in self.names:
            entry = tracker.get(name)
            if entry is not None:
                self.window_sums[name] += entry["values"].detach().double() / micro_batches
                entry["values"].zero_()

    def window(self, iterations: int) -> dict[str, float]:
        """The mean per iteration of each tracked loss since the last call; the tracker starts over."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        out, layers = {}, []
        for name in self.names:
            entry = tracker.get(name)
            values = self.window_sums[name].clone()
            self.window_sums[name].zero_()
            layers.append(_reduced(values, entry or {}, self.ps))
        if layers:
            # one host read for every name, timed (on CUDA the sums sit behind NCCL all-reduces: a plain
            # .item() would wait for a dead peer until NCCL's watchdog aborts; issue 34, 2.2)
            sums = host_value(torch.stack(layers)).tolist()            # [names][layers], over the window
            for name, by_layer in zip(self.names, sums):
                per_layer = [v / max(iterations, 1) for v in by_layer]
                out[name] = sum(per_layer) / max(self.moe_layers, 1)
                if self.per_layer:              # megatron-core's track_moe_metrics names (dense layers: 0)
                    out.update({f"moe/{name}_layer_{j}": v for j, v in enumerate(per_layer)})
        clear_aux_losses_tracker()
        if self.routed:
            counts = collectives.all_reduce(host_value(torch.stack(self.routed)))   # [routers, E], over the world
            counts /= max(iterations, 1)
            out.update(tokens_per_expert_min=counts.min().item(), tokens_per_expert_mean=counts.mean().item(),
                       tokens_per_expert_max=counts.max().item())
            for c in self.routed:
                c.zero_()
        return out


def _routers(model) -> list:
    """megatron-core's routers of the model's MoE layers, in layer order."""
    from megatron.core.transformer.moe.router import Router

    return [m for m in model.modules() if isinstance(m, Router)]


def _reduced(values: torch.Tensor, entry: dict, ps) -> torch.Tensor:
    """megatron-core's reduce_aux_losses_tracker_across_ranks for one loss (no pipeline stages here)."""
    group = entry.get("reduce_group")
    if group is not None:
        collectives.all_reduce(values, group=group)
        if not entry.get("reduce_group_has_dp", False):
            values /= collectives.group_size(ps.dp_group)
            collectives.all_reduce(values, group=ps.dp_group)
    avg = entry.get("avg_group")
    if avg is not None:
        values /= collectives.group_size(avg)
        collectives.all_reduce(values, group=avg)
    return values
