"""Bad input anywhere -- flags, data, tokenizer files, checkpoints, the launcher's environment --
is one line naming the offending value or file and the fix, exit status 2, no traceback, and
nothing written. One process runs the whole table through pretrain_gpt.py's main() in turn."""
import contextlib
import io
import json
import os
import shutil

from tests.harness import next_port, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0",
        "--no-progress-bar", "--split", "100,0,0"]


def _cases(d):
    """(name, extra argv, environment changes, text the one error line must hold)."""
    data = ["--data-path", f"{d}/sotu_text_document"]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    ck = f"{d}/ck"
    return [
        # flags
        ("negative lr", ["--lr", "-0.001"], {}, "--lr -0.001 is out of range"),
        ("min lr above lr", ["--min-lr", "0.1"], {}, "--min-lr 0.1 exceeds --lr"),
        ("dropout above 1", ["--hidden-dropout", "1.5"], {}, "--hidden-dropout 1.5"),
        ("beta2 above 1", ["--adam-beta2", "1.5"], {}, "--adam-beta2 1.5"),
        ("global batch 0", ["--global-batch-size", "0"], {}, "--global-batch-size"),
        ("batch not a multiple", ["--global-batch-size", "3"], {}, "--global-batch-size 3"),
        ("TP does not divide heads", ["--tensor-parallel", "3"], {"WORLD_SIZE": "3"},
         "--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"),
        ("dpu without offload", ["--dpu"], {}, "--dpu delays the CPU optimizer's update: add --zero-offload"),
        ("offload fraction 1.5", ["--zero-offload", "--optimizer-offload-fraction", "1.5"], {},
         "--optimizer-offload-fraction 1.5"),
        ("weight prediction without dpu", ["--zero-offload", "--dpu-weight-prediction"], {},
         "--dpu-weight-prediction extrapolates the delayed update's parameters: add --dpu"),
        ("dpu corrector without dpu", ["--zero-offload", "--dpu-corrector", "weight-prediction"], {},
         "--dpu-corrector weight-prediction corrects the delayed parameter update: add --dpu"),
        ("dpu corrector none with prediction", ["--zero-offload", "--dpu", "--dpu-corrector", "none",
                                                "--dpu-weight-prediction"], {},
         "--dpu-corrector none contradicts --dpu-weight-prediction"),
        ("offload fraction with dpu", ["--zero-offload", "--dpu", "--optimizer-offload-fraction", "0.5"], {},
         "cannot be combined with --dpu"),
        ("timeout 0", ["--distributed-timeout-minutes", "0"], {}, "--distributed-timeout-minutes 0.0 is out of range"),
        ("negative skip limit", ["--max-skipped-iters", "-1"], {}, "--max-skipped-iters -1"),
        ("pipeline parallel", ["--pipeline-model-parallel-size", "2"], {}, "pipeline parallelism is not supported"),
        ("ckpt format torch", ["--ckpt-format", "torch"], {}, "--ckpt-format torch"),
        ("query groups not divisible by TP", ["--group-query-attention", "--num-query-groups", "2",
                                              "--tensor-parallel", "4"], {"WORLD_SIZE": "4"},
         "use --tensor-model-parallel-size <= 2 that divides 2"),
        ("sliding window on the local attention", ["--window-size", "4095,0", "--attention-backend", "local"], {},
         "--window-size 4095,0 with megatron-core's local attention"),
        ("sliding window to the right", ["--window-size", "4095,8", "--use-flash-attn"], {},
         "--window-size 4095,8: only causal windows are supported"),
        ("bf16 states without offload", ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"], {},
         "add --zero-offload"),
        # data
        ("missing data prefix", ["--data-path", f"{d}/nope_text_document"], {}, f"{d}/nope_text_document"),
        ("truncated index", ["--data-path", f"{d}/cut_text_document"], {}, f"{d}/cut_text_document.idx"),
        # tokenizer
        ("vocab with the wrong hash", [*data, "--vocab-file", f"{d}/vocab.json"], {}, f"{d}/vocab.json"),
        ("missing merges file", [*data, "--merge-file", f"{d}/missing_merges.txt"], {}, "missing_merges.txt"),
        ("HF tokenizer without --tokenizer-model", [*data, "--tokenizer-type", "HuggingFaceTokenizer"], {},
         "needs --tokenizer-model"),
        ("--tokenizer-model with GPT-2's BPE", [*data, "--tokenizer-model", f"{d}/hf"], {},
         "only read with --tokenizer-type HuggingFaceTokenizer"),
        ("HF tokenizer dir without tokenizer.json", [*data, *hf, f"{d}/hf_no_json"], {}, "has no tokenizer.json"),
        ("HF tokenizer needing remote code", [*data, *hf, f"{d}/hf_remote"], {}, "trust_remote_code"),
        ("data ids beyond the vocabulary (another tokenizer)", [*data, *hf, f"{d}/hf"], {},
         "preprocessed with GPT2BPETokenizer"),
        # issue 35, item 17: ids that fit but mean other text were two warnings, now one refusal
        ("data of another tokenizer whose ids fit", ["--data-path", f"{d}/hfdata_text_document"], {},
         "add --allow-other-tokenizer-data"),
        # checkpoints
        # (issue 35: without --exit-on-missing-checkpoint a --load with no checkpoint starts fresh, as
        # Megatron-LM; the refusal is now that flag's)
        ("load a missing directory", [*data, "--load", f"{d}/no_such_ckpt", "--exit-on-missing-checkpoint"], {},
         "no_such_ckpt"),
        ("load without latest", [*data, "--load", f"{d}/empty_ckpt", "--exit-on-missing-checkpoint"], {},
         "empty_ckpt"),
        ("load a garbage latest", [*data, "--load", f"{d}/garbage_ckpt"], {}, "garbage_ckpt"),
        ("load another architecture", [*data, "--load", ck, "--hidden-size", "64"], {},
         "--hidden-size: 32 in the checkpoint, 64 here"),
        ("load with --swiglu a checkpoint trained without", [*data, "--zero-offload", "--load", ck, "--swiglu"], {},
         "--swiglu: False in the checkpoint, True here"),
        ("load a damaged manifest", [*data, "--load", f"{d}/damaged_ckpt"], {}, "checkpoint.json"),
        ("load a data file damaged in place", [*data, "--zero-offload", "--load", f"{d}/flipped_ckpt"], {},
         "checksum mismatch"),
        ("load an offload checkpoint into the baseline", [*data, "--load", ck], {}, "--zero-offload"),
        # --save
        ("save onto a file", [*data, "--save", f"{d}/a_file"], {}, f"--save {d}/a_file"),
        # Megatron-LM flags: every refusal of one command line in one line (#28)
        ("refused Megatron flags together", ["--moe-enable-deepep", "--fp8-format", "hybrid"], {},
         "(2 flags refused)"),
        # mixture of experts (issue 39): Megatron-LM's rules, one line each; what the job does not do with experts
        ("top-k above the experts", ["--num-experts", "4", "--moe-router-topk", "5"], {},
         "--moe-router-topk 5 with --num-experts 4"),
        ("EP not dividing the experts", ["--num-experts", "6", "--expert-model-parallel-size", "4"], {},
         "--expert-model-parallel-size 4 does not divide --num-experts 6"),
        ("an MoE flag without --num-experts", ["--moe-router-topk", "4"], {}, "add --num-experts"),
        ("expert padding without a capacity factor", ["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], {},
         "--moe-pad-expert-input-to-capacity pads each expert's input to its capacity: add --moe-expert-capacity-factor"),
        ("MoE at TP 2 without sequence parallelism", ["--num-experts", "4", "--tensor-model-parallel-size", "2"], {},
         "need --sequence-parallel"),
        ("MoE at EP 2 without ZeRO-Offload (the baseline's DDP does not reduce experts over expert DP)",
         ["--num-experts", "4", "--expert-model-parallel-size", "2"], {},
         "--num-experts with --expert-model-parallel-size 2 trains with the ZeRO-Offload engine only"),
        ("an MoE checkpoint loaded with dense flags", [*data, "--load", f"{d}/moe_ck"], {},
         "--num-experts: 4 in the checkpoint, None here"),
        # data paths (#28)
        ("odd blend list", ["--data-path", "0.7", f"{d}/sotu_text_document", "0.3"], {}, "0.3 has no prefix after it"),
        ("vocab file is a directory", [*data, "--vocab-file", d], {}, f"--vocab-file {d} is a directory"),
        ("evaluation of an empty validation split", [*data, "--split", "969,30,1", "--eval-iters", "100"], {},
         "use --split 91,9,0 (gives it at least one document), or --eval-iters 0"),
        # checkpoints (#28)
        ("extend a finished run", [*data, "--zero-offload", "--load", ck, "--train-iters", "4"], {},
         "--override-opt_param-scheduler` (this run's schedule replaces the checkpoint's"),
        ("checkpoint args disagree", [*data, "--zero-offload", "--use-checkpoint-args", "--load", ck, "--num-layers", "3"],
         {}, "--num-layers: 2 in the checkpoint, 3 here"),
        ("save directory in use", [*data, "--save", f"{d}/locked"], {}, f"--save {d}/locked is in use by another job"),
        # the launcher's environment
        ("rank outside the world", [*data], {"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5"),
        ("cpu adam threads not a number", [*data], {"ZO_CPU_ADAM_THREADS": "abc"}, "ZO_CPU_ADAM_THREADS='abc'"),
    ]


def _run_table(rank, d):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "pretrain"))
    import pretrain_gpt

    def run(argv, env):
        next_port()               # chosen now, just before this run's rendezvous (and before a case's RANK)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                try:
                    rc = pretrain_gpt.main(argv)
                except SystemExit as exc:           # argparse
                    rc = exc.code
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        return rc, err.getvalue(), out.getvalue()

    # a real offload checkpoint to load from
    rc, err, _ = run([*TINY, "--zero-offload", "--data-path", f"{d}/sotu_text_document", "--save", f"{d}/ck"], {})
    assert rc == 0, err
    shutil.copytree(f"{d}/ck", f"{d}/damaged_ckpt")
    (manifest,) = [os.path.join(r, "checkpoint.json") for r, _, f in os.walk(f"{d}/damaged_ckpt") if "checkpoint.json" in f]
    with open(manifest, "r+b") as f:
        f.truncate(os.path.getsize(manifest) // 2)
    shutil.copytree(f"{d}/ck", f"{d}/flipped_ckpt")     # a data file damaged in place, size unchanged
    (data,) = [os.path.join(r, n) for r, _, fs in os.walk(f"{d}/flipped_ckpt") for n in fs if n == "__0_0.distcp"]
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    results = []
    for name, extra, env, needle in _cases(d):
        save = f"{d}/save_{len(results)}"
        argv = [*TINY, *extra] + ([] if "--save" in extra else ["--save", save])
        rc, err, out = run(argv, env)
        results.append(dict(name=name, rc=rc, err=err, needle=needle, wrote=os.path.exists(save)))
    return results


def _moe_checkpoint(directory):
    """A weights-only checkpoint of TINY's GPT-2 shape with 4 experts in every layer (issue 39)."""
    import torch

    from zo_megatron.checkpoint.arch import full_meta, param_shapes
    from zo_megatron.checkpoint.convert import _write_weights_checkpoint

    meta = full_meta(dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50257,
                          max_position_embeddings=16, num_experts=4))
    weights = {k: torch.zeros(shape) for k, shape in param_shapes(meta).items()}
    _write_weights_checkpoint(directory, weights, meta, tp=1, converted_from="test", args={}, force=False,
                              log=lambda _line: None)


def test_bad_input_table(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=6), f"{d}/sotu", progress=False)
    shutil.copy(f"{d}/sotu_text_document.bin", f"{d}/cut_text_document.bin")
    idx = open(f"{d}/sotu_text_document.idx", "rb").read()
    open(f"{d}/cut_text_document.idx", "wb").write(idx[: len(idx) // 2])
    open(f"{d}/vocab.json", "w").write(json.dumps({"a": 0}))
    os.makedirs(f"{d}/empty_ckpt")
    os.makedirs(f"{d}/garbage_ckpt")
    open(f"{d}/garbage_ckpt/latest_checkpointed_iteration.txt", "w").write("not a number\n")
    open(f"{d}/a_file", "w").write("x")
    from tests.hf_tokenizer import make_hf_tokenizer

    make_hf_tokenizer(f"{d}/hf")
    from zo_megatron.data import build_tokenizer

    preprocess(extract_corpus(f"{d}/txt", limit=2), f"{d}/hfdata", progress=False,
               tokenizer=build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=f"{d}/hf"))
    make_hf_tokenizer(f"{d}/hf_no_json", without=("tokenizer.json",))
    make_hf_tokenizer(f"{d}/hf_remote", config_update={"auto_map": {"AutoTokenizer": ["t.Tok", None]}})
    _moe_checkpoint(f"{d}/moe_ck")

    import socket

    os.makedirs(f"{d}/locked")                       # held by a live process on this host: this one
    open(f"{d}/locked/zo_megatron.lock", "w").write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                                 "started": 0}))
    results = run_world(_run_table, 1, d, timeout=500)[0]
    assert len(results) >= 25
    failures = []
    for r in results:
        errors = [ln for ln in r["err"].splitlines() if "error:" in ln]
        ok = (r["rc"] == 2 and len(errors) == 1 and r["needle"] in errors[0] and "Traceback" not in r["err"]
              and not r["wrote"])
        if not ok:
            failures.append(f"{r['name']}: rc={r['rc']} wrote={r['wrote']} stderr={r['err'][-600:]!r}")
    assert not failures, "\n".join(failures)
