"""Every Megatron-LM flag in docs/megatron_compat.md parses and behaves as the table says."""
import re
import shlex
from pathlib import Path

import pytest

from zo_megatron.errors import ConfigError, UserError
from zo_megatron.training.arguments import build_parser, check_batch_sizes, parse_args
from zo_megatron.training.megatron_compat import check_backend, should_exit
from zo_megatron.training.schedule import LRScheduler

DOC = Path(__file__).resolve().parents[1] / "docs" / "megatron_compat.md"
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--lr", "1e-3", "--micro-batch-size", "2"]


def _rows():
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(implemented|no-op|refused)\s*\|(.*)\|\s*$", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3).strip()))
    return rows


def _job_args(flags, dp=2, cuda=False):
    """What the job does with a command line before it starts: parse, batch sizes, schedule, backend."""
    argv = [*SHAPE, *flags] + ([] if "--train-samples" in flags else ["--train-iters", "50"])
    args = parse_args(argv)
    check_batch_sizes(args, dp)
    LRScheduler.from_args(args)
    check_backend(args, cuda)
    return args


def test_the_table_covers_the_flags_the_issue_lists():
    flags = {f for cell, _, _ in _rows() for f in shlex.split(cell) if f.startswith("--")}
    issue = {"--use-flash-attn", "--sequence-parallel", "--pipeline-model-parallel-size", "--ckpt-format",
             "--log-throughput", "--wandb-project", "--exit-duration-in-mins", "--exit-interval", "--train-samples",
             "--mock-data", "--use-distributed-optimizer", "--distributed-backend", "--transformer-impl",
             "--recompute-method", "--recompute-num-layers", "--lr-warmup-fraction", "--position-embedding-type",
             "--normalization", "--swiglu", "--group-query-attention", "--num-query-groups",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--rotary-base", "--rotary-percent",
             "--use-rope-scaling", "--rope-scaling-factor", "--norm-epsilon", "--kv-channels", "--add-qkv-bias",
             "--qk-layernorm", "--window-size"}
    assert issue <= flags, issue - flags


@pytest.mark.parametrize("cell, status, text", _rows(), ids=[r[0] for r in _rows()])
def test_every_flag_in_the_table_behaves_as_documented(cell, status, text):
    flags = shlex.split(cell)
    if status == "refused":
        with pytest.raises(ConfigError) as e:
            _job_args(flags)
        msg = str(e.value)
        assert "\n" not in msg and msg.split(" ")[0].rstrip(":") in flags, msg
        assert "use " in msg or "drop it" in msg or "add " in msg, msg
    else:
        args = _job_args(flags)
        dests = {o: a.dest for a in build_parser()._actions for o in a.option_strings}
        for f in flags:
            if f.startswith("--"):
                assert hasattr(args, dests[f]), f


def test_implemented_flags_do_what_the_table_says():
    a = _job_args(["--train-samples", "4096", "--global-batch-size", "8"])
    assert a.train_iters == 4096 // 8 and LRScheduler.from_args(a).lr_decay_steps == 4096
    a = _job_args(["--lr-warmup-fraction", "0.1"])
    assert LRScheduler.from_args(a).lr_warmup_steps == int(0.1 * 50 * 4)
    a = _job_args(["--exit-interval", "100", "--exit-duration-in-mins", "30"])
    assert should_exit(a, 100, 0.0) == "--exit-interval 100" and should_exit(a, 99, 0.0) is None
    assert should_exit(a, 7, 30 * 60 + 1) == "--exit-duration-in-mins 30" and should_exit(a, 7, 29 * 60) is None
    with pytest.raises(ConfigError, match="use --distributed-backend nccl"):
        _job_args(["--distributed-backend", "gloo"], cuda=True)
    with pytest.raises(ConfigError, match="use --distributed-backend gloo"):
        _job_args(["--distributed-backend", "nccl"])
    with pytest.raises(ConfigError, match="--train-samples and --train-iters"):
        parse_args([*SHAPE, "--train-samples", "64", "--train-iters", "3"])
    with pytest.raises(ConfigError, match="--data-path and --mock-data"):
        _job_args(["--mock-data", "--data-path", "x"])


def test_wandb_without_the_package_is_one_line():
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    from zo_megatron.training.metrics import Metrics

    with pytest.raises(UserError, match="--wandb-project needs the wandb package"):
        Metrics(enabled=True, total_iters=1, progress_bar=False, wandb=dict(project="p", name=None, dir=None, config={}))


def test_help_shows_real_defaults_never_none():
    from zo_megatron.training.arguments import DEMO_DEFAULTS, MEGATRON_DEFAULTS, build_parser

    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert "default: None" not in text
    for dest, demo in DEMO_DEFAULTS.items():
        flag = next(a.option_strings[0] for a in parser._actions if a.dest == dest)
        meg = MEGATRON_DEFAULTS.get(dest)
        assert f"(demo: {demo} / Megatron: {'required' if meg is None else meg})" in text, flag
    assert "--seed SEED (default: 1234)" in text or "(default: 1234)" in text


def test_architecture_flags_reach_the_model_config():
    """Megatron-LM's architecture flags map onto GPTConfig as Megatron means them."""
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.model_flags import architecture_kwargs

    a = _job_args(["--position-embedding-type", "rope", "--rotary-base", "500000", "--use-rope-scaling",
                   "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention",
                   "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                   "--add-qkv-bias", "--qk-layernorm", "--kv-channels", "32"])
    cfg = GPTConfig(**architecture_kwargs(a), vocab_size=100)
    assert (cfg.position_embedding_type, cfg.rotary_base, cfg.use_rope_scaling, cfg.rope_scaling_factor) == \
        ("rope", 500000, True, 8.0)
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.swiglu, cfg.query_groups, cfg.head_dim) == \
        ("RMSNorm", 1e-6, True, 2, 32)
    assert cfg.untie_embeddings_and_output_weights and not cfg.add_bias_linear and cfg.add_qkv_bias and cfg.qk_layernorm
    assert cfg.ffn_size == int(4 * 64 * 2 / 3 / 64) * 64           # Megatron-LM's SwiGLU rule, h = 64
    # Megatron-LM: --num-query-groups counts only with --group-query-attention
    plain = GPTConfig(**architecture_kwargs(_job_args(["--num-query-groups", "2"])), vocab_size=100)
    assert plain.query_groups == 4 and plain.architecture_name() == "GPT-2"
    assert _job_args(["--layernorm-epsilon", "1e-6"]).layernorm_epsilon == 1e-6
    assert _job_args(["--window-size=-1,-1"]).window_size is None          # full attention (Megatron-LM's -1)
    assert _job_args(["--window-size", "7,0", "--use-flash-attn"]).window_size == [7, 0]


def test_the_table_lists_the_tokenizer_flags():
    rows = {(cell, status) for cell, status, _ in _rows()}
    flags = {f for cell, _ in rows for f in shlex.split(cell) if f.startswith("--")}
    assert {"--tokenizer-type", "--tokenizer-model"} <= flags
    a = _job_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/some/dir"])
    assert (a.tokenizer_type, a.tokenizer_model) == ("HuggingFaceTokenizer", "/some/dir")
    with pytest.raises(ConfigError, match="--vocab-file belong to GPT2BPETokenizer"):
        _job_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "d", "--vocab-file", "v.json"])
    with pytest.raises(SystemExit):                      # argparse: not one of the two choices
        _job_args(["--tokenizer-type", "SentencePieceTokenizer"])


def test_every_megatron_flag_is_in_the_doc_table_with_the_modules_class():
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.megatron_compat import REFUSED
    from zo_megatron.training.megatron_flag_list import FLAGS
    from zo_megatron.training.megatron_flags import parse_doc_table, table

    doc = parse_doc_table(DOC.read_text())
    assert [r[0] for r in doc] == [f for f, *_ in FLAGS] and len(doc) > 600
    live = {f: s for f, _, s, _ in table(build_parser(), REFUSED)}
    wrong = [(f, s, live[f]) for f, _, s, _ in doc if live[f] != s]
    assert not wrong, f"{len(wrong)} rows disagree with the module (rerun --write-doc): {wrong[:10]}"


def _value_for(flag, takes_value, megatron_default):
    if not takes_value:
        return [flag]
    import ast

    try:
        v = ast.literal_eval(megatron_default)
    except (ValueError, SyntaxError):
        v = None
    if v is None or isinstance(v, bool):
        return [flag, "1"]
    return [flag, *(map(str, v) if isinstance(v, (list, tuple)) else [str(v)])]


def test_every_row_of_the_full_table_behaves_as_its_class_says():
    """implemented: the parser defines the flag; no-op: it passes every check of the job and the
    banner lists it (noops_given, nothing else); refused: one line naming it with the table's reason. Rows implemented by another issue's branch are checked
    only once that branch defines them (then as implemented)."""
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.megatron_flag_list import FLAGS
    from zo_megatron.training.megatron_flags import (IMPLEMENTED_ELSEWHERE, NOOP_DEST, REFUSED_DEST, noops_given,
                                                     parse_doc_table)

    parser = build_parser()
    actions = {o: a for a in parser._actions for o in a.option_strings}
    spec = {f: (t, d) for f, _, t, d in FLAGS}
    failures = []
    for flag, _, status, why in parse_doc_table(DOC.read_text()):
        a = actions.get(flag)
        real = a is not None and not a.dest.startswith((NOOP_DEST, REFUSED_DEST))
        if status == "implemented":
            if not real and flag not in IMPLEMENTED_ELSEWHERE:
                failures.append(f"{flag}: implemented but the parser does not define it")
            continue
        argv = _value_for(flag, *spec[flag])
        if flag == "--use-distributed-optimizer":      # its no-op needs --zero-offload (the table says so)
            argv.append("--zero-offload")
        if status == "no-op":
            try:
                args = _job_args(argv)
            except (ConfigError, SystemExit) as exc:
                failures.append(f"{flag}: no-op but refused: {exc}")
                continue
            if noops_given(args) != [flag]:          # the banner lists it (issue 35, item 9)
                failures.append(f"{flag}: a no-op the banner would not list: {noops_given(args)}")
        else:
            try:
                _job_args(argv)
                failures.append(f"{flag}: refused but accepted")
            except ConfigError as exc:
                msg = str(exc)
                if "\n" in msg or not msg.startswith(flag) or why.split(" (")[0][:40] not in msg:
                    failures.append(f"{flag}: {msg!r} does not give the table's reason {why!r}")
            except SystemExit:
                failures.append(f"{flag}: refused by argparse, not with the table's reason")
    assert not failures, "\n".join(failures[:20])


def test_a_copy_pasted_megatron_script_gets_every_refusal_in_one_line_and_its_fusion_flags_pass():
    fusions = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--use-mcore-models",
               "--no-gradient-accumulation-fusion", "--overlap-grad-reduce", "--attention-softmax-in-fp32",
               "--num-workers", "2", "--local-rank", "0", "--log-validation-ppl-to-tensorboard"]
    _job_args(fusions)
    with pytest.raises(ConfigError) as e:
        _job_args([*fusions, "--moe-enable-deepep", "--context-parallel-size", "2",
                   "--pipeline-model-parallel-size",
                   "2", "--fp8-format", "hybrid"])
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("(4 flags refused)"), msg
    # --context-parallel-size is a flag of its own now (1, Megatron's default, is accepted): it names its value
    for f in ("--moe-enable-deepep: this mixture-of-experts option", "--context-parallel-size 2: context parallelism",
              "--pipeline-model-parallel-size 2: pipeline", "--fp8-format: FP8"):
        assert f in msg, (f, msg)


def test_the_banner_names_the_megatron_flags_it_accepted_as_no_ops():
    """Issue 35, item 9: a copied launch script sees which of its flags do nothing here, in one line;
    a command line without any gets no such line."""
    from zo_megatron.training.user_report import noop_lines

    args = _job_args(["--use-mcore-models", "--no-persist-layer-norm", "--log-throughput", "--zero-offload",
                      "--use-distributed-optimizer", "--lr-decay-style", "cosine"])
    (line,) = noop_lines(args)
    head, flags = line.split("): ", 1)
    assert head == " accepted as no-ops (nothing to do in this job; docs/megatron_compat.md says why for each"
    assert sorted(flags.split(" ")) == sorted(["--use-mcore-models", "--no-persist-layer-norm", "--log-throughput",
                                               "--use-distributed-optimizer"])
    assert noop_lines(_job_args(["--zero-offload"])) == []


# every interpreter of the launch: a wandb whose init fails as it does without an API key on a non-tty
NO_WANDB_LOGIN = """
import sys, types
wandb = types.ModuleType("wandb")
def _init(**kwargs):
    raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
wandb.init = _init
sys.modules["wandb"] = wandb
"""


def test_a_wandb_that_cannot_start_is_one_line_on_every_rank(tmp_path):
    """Rank 0 alone starts W&B; its wandb.init failing (no API key under a launcher, no network) was
    a traceback on rank 0 while the other ranks went on to their first collective and lost contact
    (found by review on 2026-12-07). Now: one line naming the fix, from rank 0, exit 2, no traceback."""
    from tests.test_pretrain import TINY, _run_with_fault

    r = _run_with_fault(tmp_path, ["--zero-offload", "--mock-data", *TINY, "--train-iters", "2", "--wandb-project", "p"],
                        NO_WANDB_LOGIN)
    assert "lost contact" not in r.stdout + r.stderr, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("error: rank 0: --wandb-project p: starting Weights & Biases failed (RuntimeError: "
                                "api_key not configured (no-tty)"), errors[0]
    assert "WANDB_MODE=offline" in errors[0] and "/zo_megatron/training" not in r.stderr       # no traceback
