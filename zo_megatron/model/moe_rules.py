"""GPTConfig's checks of expert capacity and group-limited routing (megatron-core's rules, one line each),
kept apart from model/config.py for its length; `cfg` is the GPTConfig being checked."""
from __future__ import annotations

from zo_megatron.errors import ConfigError

MOE_DROP_POLICIES = ("probs", "position")


def check_group_limited_routing(cfg) -> None:
    """--moe-router-num-groups / --moe-router-group-topk (megatron-core's group_limited_topk), with
    what its router would run silently refused: a group count alone (it routes without groups),
    groups that leave a token fewer than top-k experts (it would pick masked ones), and a top-k
    below the groups picked (a group's score would sum none of its scores)."""
    groups, picked, k, e = cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk, \
        cfg.num_experts
    if groups is None and picked is None:
        return
    if picked is None:
        raise ConfigError(f"--moe-router-num-groups {groups} without --moe-router-group-topk: megatron-core routes "
                          "without groups then; add --moe-router-group-topk (the groups each token may use)")
    if groups is None:
        raise ConfigError(f"--moe-router-group-topk {picked}: add --moe-router-num-groups (megatron-core's rule)")
    if groups < 1 or e % groups:
        raise ConfigError(f"--moe-router-num-groups {groups} does not divide --num-experts {e}: the groups are "
                          "equal; use a divisor (the EP size: device-limited routing)")
    if not 1 <= picked <= groups:
        raise ConfigError(f"--moe-router-group-topk {picked}: choose 1 to --moe-router-num-groups {groups}")
    if k < picked:
        raise ConfigError(f"--moe-router-topk {k} < --moe-router-group-topk {picked}: a group's score sums its "
                          f"top topk // group-topk = 0 scores; use a group top-k <= {k}")
    if k > picked * (e // groups):
        raise ConfigError(f"--moe-router-topk {k} exceeds the {picked * (e // groups)} experts in "
                          f"--moe-router-group-topk {picked} groups of {e // groups}: pick more groups")

def check_capacity(cfg) -> None:
    """Capacity and token dropping (megatron-core's rules, and what its dispatchers can run)."""
    f, k, e = cfg.moe_expert_capacity_factor, cfg.moe_router_topk, cfg.num_experts
    if cfg.moe_token_drop_policy not in MOE_DROP_POLICIES:
        raise ConfigError(f"--moe-token-drop-policy {cfg.moe_token_drop_policy}: choose one of "
                          f"{', '.join(MOE_DROP_POLICIES)}")
    if cfg.moe_pad_expert_input_to_capacity and f is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity pads each expert's input to its capacity: add "
                          "--moe-expert-capacity-factor (megatron-core's rule)")
    if f is None:
        return
    if f == 0:
        raise ConfigError("--moe-expert-capacity-factor 0 gives every expert a capacity of 0 tokens (all dropped): "
                          "use a factor > 0 (1.0: an even share of the routed tokens), or drop it for no dropping")
    if cfg.moe_pad_expert_input_to_capacity and cfg.moe_token_dispatcher_type == "alltoall" and k * f > e:
        raise ConfigError(f"--moe-pad-expert-input-to-capacity with --moe-expert-capacity-factor {f:g} x "
                          f"--moe-router-topk {k} > --num-experts {e}: the capacity exceeds a rank's tokens, which "
                          f"megatron-core's alltoall dispatcher cannot pad to; use a factor <= {e / k:g} (nothing "
                          "is dropped above it) or --moe-token-dispatcher-type allgather")
