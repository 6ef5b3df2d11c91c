"""The job's model and datasets built in one process, as pretrain_gpt.py builds them from its flags:
the starting point of the single-process torch references that tests hold the job's runs to."""
from __future__ import annotations

import dataclasses
import os


def job_model_and_data(argv: list[str], cache: str, dp: int, **config_changes):
    """(args, tokenizer, model, train dataset, validation dataset) of the job `argv` launched on `dp`
    data-parallel ranks (TP 1), in this process (a 1-rank world: tests.harness.run_world). The model is
    the one the job's seed gives (the same full tensors at any layout), built from the job's own
    GPTConfig, with `config_changes` applied to it; the datasets hold Megatron-LM's samples in its order."""
    os.environ["ZO_MEGATRON_CACHE"] = cache
    from zo_megatron.data import build_tokenizer
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training import components
    from zo_megatron.training.arguments import check_batch_sizes, parse_args
    from zo_megatron.training.prelaunch import model_vocab_size

    args = parse_args(argv)
    check_batch_sizes(args, dp)
    init_parallel(1, seed=args.seed)
    tok = build_tokenizer(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size if args.tokenizer_type == "NullTokenizer" else None)
    args.model_vocab_size = model_vocab_size(args, tok)
    cfg = dataclasses.replace(components.model_config(args), **config_changes)
    model = build_gpt_model(cfg, 0, 1, args.seed)
    train_ds, valid_ds = components.build_datasets(args, tok, args.data_path, dp)   # --data-path, or mock data
    return args, tok, model, train_ds, valid_ds
