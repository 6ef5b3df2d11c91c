#!/usr/bin/env python
"""Pretrain a GPT with Megatron tensor parallelism + ZeRO-Offload data parallelism.

    torchrun --nproc-per-node 16 pretrain/pretrain_gpt.py --tensor-parallel 16 --zero-offload ...

Megatron-LM's flag names work as they do there (`--help` lists them by group). With no model or
data flags it trains a small GPT-2 on the embedded State of the Union corpus (the README demo).
Bad input prints one `error:` line and exits with status 2 (torchrun itself then exits 1 and
names that line as the root cause in its summary: docs/launch.md).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    # First, before anything can start CUDA (parsing the flags may): CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1
    from zo_megatron.training.cuda_connections import set_cuda_device_max_connections

    set_cuda_device_max_connections(argv)
    from zo_megatron.errors import UserError, is_first_rank, let_the_first_rank_report, report_error

    try:
        from zo_megatron.training.loop import pretrain

        return pretrain(argv)
    except UserError as exc:
        rank0 = is_first_rank() or getattr(exc, "every_rank", False)
        report_error(str(exc), print_it=rank0 and not getattr(exc, "reported", False))
        if not rank0:
            let_the_first_rank_report()   # the launcher ends the job at the first exit: rank 0's line first
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # torch elastic's @record: an unexpected exception's traceback becomes torchrun's root cause too
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
