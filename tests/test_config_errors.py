"""Impossible layouts fail with one clear line before any process-group work."""
import pytest
import torch.distributed as dist

from zo_megatron.errors import ConfigError
from zo_megatron.model import GPTConfig
from zo_megatron.parallel import init_parallel, validate_parallel_config


@pytest.mark.parametrize("world,tp,heads,hidden,fragment", [
    (4, 3, 12, 768, "world size 4 is not divisible by --tensor-parallel 3"),
    (8, 8, 12, 768, "--num-attention-heads 12 is not divisible by --tensor-parallel 8"),
    (16, 16, 12, 768, "--tensor-parallel 16 exceeds --num-attention-heads 12"),
    (2, 2, 12, 770, "--hidden-size 770 is not divisible by --num-attention-heads 12"),
    (2, 0, 12, 768, "--tensor-parallel must be >= 1"),
])
def test_bad_layouts(world, tp, heads, hidden, fragment):
    with pytest.raises(ConfigError) as exc:
        validate_parallel_config(world, tp, heads, hidden)
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value)


def test_init_parallel_refuses_before_creating_groups(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: reaching the rendezvous would hang
    with pytest.raises(ConfigError, match="world size 3 is not divisible by --tensor-parallel 2"):
        init_parallel(2, num_attention_heads=4, hidden_size=64)
    assert not dist.is_initialized()


def test_model_config_errors():
    with pytest.raises(ConfigError, match="not divisible by --num-attention-heads"):
        GPTConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ConfigError, match="label smoothing"):
        GPTConfig(label_smoothing=0.1)
    with pytest.raises(ConfigError, match="precision"):
        GPTConfig(precision="fp8")


def test_vocab_padding_rule():
    cfg = GPTConfig(vocab_size=50257)
    assert [cfg.padded_vocab_size(t) for t in (1, 2, 4, 16)] == [50304, 50432, 50688, 51200]


def test_cpu_default_precision_follows_native_bf16(monkeypatch, tmp_path):
    """On CPU, bf16 only where the CPU runs it natively (AVX512_BF16 or AMX) and, since issue 35
    item 18, measures it faster (here: a measurement that says so; tests/test_cpu_precision.py has
    the slower case); fp32 otherwise. A flag always wins."""
    import torch

    from zo_megatron.training import arguments, cpu_precision

    monkeypatch.setenv("ZO_MEGATRON_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_precision, "matmul_gflops", lambda d: {"bf16": 200.0, "fp32": 100.0}[d])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: {"avx2", "fma"})
    assert arguments.parse_args([]).precision == "fp32"
    assert "without native bf16" in arguments.parse_args([]).precision_reason
    for native in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(cpu_precision, "cpu_flags", lambda native=native: {"avx2", native})
        args = arguments.parse_args([])
        assert args.precision == "bf16" and native in args.precision_reason
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: {"avx2"})
    assert arguments.parse_args(["--bf16"]).precision == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert arguments.parse_args([]).precision == "bf16"


def test_gradient_precision_flags():
    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args

    assert parse_args(["--bf16"]).accumulate_allreduce_grads_in_fp32 is True       # Megatron's bf16 rule
    assert parse_args(["--fp16"]).accumulate_allreduce_grads_in_fp32 is False
    assert parse_args(["--bf16", "--no-accumulate-allreduce-grads-in-fp32"]).accumulate_allreduce_grads_in_fp32 is False
    assert parse_args(["--bf16", "--zero-offload", "--main-grads-dtype", "fp32"]).main_grads_dtype == "fp32"
    for argv, msg in [(["--fp16", "--zero-offload", "--main-grads-dtype", "bf16"], "use fp32 or fp16"),
                      (["--fp16", "--zero-offload", "--main-grads-dtype", "fp32"], "--accumulate-allreduce-grads-in-fp32"),
                      (["--bf16", "--accumulate-grads-on-host"], "add --zero-offload")]:
        with pytest.raises(ConfigError, match=msg.replace("-", r"\-")):
            parse_args(argv)


@pytest.mark.parametrize("argv,needle", [
    (["--lr", "-0.001"], "--lr -0.001 is out of range: it must be > 0"),
    (["--lr", "5e-5"], "--min-lr 0.0001 (demo default) exceeds --lr 5e-05"),   # the demo default, named
    (["--lr-warmup-iters", "400"], "--lr-warmup-iters 400 exceeds --train-iters 300"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout 1.5 is out of range: it must be in [0, 1)"),
    (["--attention-dropout", "-0.1"], "--attention-dropout -0.1 is out of range"),
    (["--adam-beta2", "1.5"], "--adam-beta2 1.5 is out of range: it must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps 0.0 is out of range: it must be > 0"),
    (["--global-batch-size", "0"], "--global-batch-size 0 is out of range: it must be >= 1"),
    (["--weight-decay", "-1"], "--weight-decay -1.0 is out of range"),
    (["--clip-grad", "nan"], "--clip-grad nan is out of range"),
    (["--eval-iters", "-1"], "--eval-iters -1 is out of range"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale 0.0 is out of range: it must be > 0"),
])
def test_numeric_flags_are_range_checked_in_one_line(argv, needle):
    from zo_megatron.training.arguments import parse_args

    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_eval_iters_zero_is_allowed_as_in_megatron():
    from zo_megatron.training.arguments import parse_args

    assert parse_args(["--eval-iters", "0"]).eval_iters == 0


def test_abbreviated_flags_are_refused_and_argparse_errors_print_on_rank_0_only(monkeypatch, capsys):
    from zo_megatron.training.arguments import parse_args

    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            parse_args(["--seq", "128"])              # Megatron disables abbreviations too
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert ("unrecognized arguments: --seq 128" in err) == printed, err


def test_save_must_be_a_creatable_directory(tmp_path):
    from zo_megatron.errors import UserError
    from zo_megatron.training.prelaunch import check_save_dir

    check_save_dir(str(tmp_path / "new" / "deeper"))          # creatable: fine, nothing created
    assert not (tmp_path / "new").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_save_dir(str(afile))
    with pytest.raises(UserError, match="cannot be created"):
        check_save_dir(str(afile / "sub"))
