"""The training job's entry: `pretrain(argv)` parses, runs the pre-launch checks, starts the
process groups and hands over to the Trainer.

    pretrain(argv)
      environment defaults that must precede CUDA (cuda_connections.py)
      parse_args                       Megatron-LM's flag names (arguments.py)
      prelaunch.check_launch           flags against the launcher's world, no process group yet
      init_parallel                    TP x DP groups (parallel/state.py)
      prelaunch.check_inputs           tokenizer, data, --save, memory plan, free disk; all ranks agree
      Trainer(...).run()               components and the loop (trainer.py)

Every check that can fail on bad input runs before any model or checkpoint directory is created,
so a mistake costs seconds and leaves nothing behind.
"""
from __future__ import annotations

from zo_megatron.parallel import collectives
from zo_megatron.parallel.megatron_notices import hide_known_megatron_notices
from zo_megatron.training.arguments import parse_args
from zo_megatron.training.cpu_precision import agree_across_ranks
from zo_megatron.training.cuda_connections import set_cuda_device_max_connections, set_nccl_memory_defaults
from zo_megatron.training.prelaunch import check_inputs, check_launch, hidden_check


def pretrain(argv=None) -> int:
    """Run the job; 0 done (or stopped cleanly), 1 a failed save or a run of skipped steps;
    bad input raises errors.UserError (pretrain_gpt.py prints its one line and exits 2)."""
    # CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1 (training/cuda_connections.py): pretrain_gpt.py's main()
    # sets it first thing; here again, before parsing (which may start CUDA), for callers of pretrain().
    set_cuda_device_max_connections(argv)
    set_nccl_memory_defaults()                   # NVLS off unless asked: its buffers are not planned
    hide_known_megatron_notices()                # before megatron-core is first imported
    args = parse_args(argv)
    env = check_launch(args)
    import torch

    from zo_megatron.parallel import destroy_parallel, init_parallel
    from zo_megatron.training.host_allocator import keep_host_memory_plannable
    from zo_megatron.training.trainer import Trainer

    keep_host_memory_plannable(not torch.cuda.is_available())   # before the data and the model: as planned

    ps = init_parallel(args.tensor_parallel, seed=args.seed, num_attention_heads=args.num_attention_heads,
                       hidden_size=hidden_check(args), timeout_s=args.distributed_timeout_minutes * 60,
                       expert_parallel=args.expert_parallel, expert_tensor_parallel=args.expert_tensor_parallel)
    try:
        agree_across_ranks(args)                 # a CPU precision chosen by measurement: one for all ranks
        with collectives.all_ranks_agree():
            tokenizer, data_path = check_inputs(args, env, env.world_size // args.tensor_parallel)
    except BaseException:
        destroy_parallel()
        raise
    return Trainer(args, env, ps, tokenizer, data_path).run()
