"""--use-checkpoint-args (Megatron's): resume and fine-tune from a checkpoint without repeating its
model flags, at another TP size; flags that disagree are one line naming each with both values;
without the flag, a mismatch names the flags and suggests it, and demo defaults say they are."""
import json
import os

from tests.harness import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
RUN = ["--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-iters", "6", "--eval-iters", "0", "--no-progress-bar",
       "--split", "100,0,0", "--zero-offload", "--fp32"]


def _main(rank, argv):
    """One rank of the job, its (exit status, stdout, stderr): tests/test_pretrain.py's _rank_job."""
    from tests.test_pretrain import _rank_job

    return _rank_job(rank, argv, {})


def _losses(path):
    with open(path) as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


def test_resume_and_finetune_without_shape_flags_at_another_tp(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=4), f"{d}/sotu", progress=False)
    data = ["--data-path", f"{d}/sotu_text_document"]
    ck = f"{d}/ck"
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--train-iters", "2", "--save", ck,
                                        "--ffn-hidden-size", "48"], timeout=300)[0]
    assert rc == 0, err
    # resume at TP 2 with no model flag at all: shape, ffn size, seq length from the checkpoint
    log = f"{d}/resume.jsonl"
    outs = run_world(_main, 2, ["--use-checkpoint-args", "--load", ck, "--tensor-parallel", "2", *RUN, *data,
                                "--train-iters", "4", "--log-interval", "1", "--log-jsonl", log], timeout=300)
    rc, out, err = outs[0]
    assert rc == 0 and outs[1][0] == 0, err + outs[1][2]
    assert "resumed from" in out and "at iteration 2" in out, out
    model_line = next(ln for ln in out.splitlines() if ln.startswith(" model:"))
    assert "2 layers x 32 hidden x 4 heads, seq 16" in model_line and "from the checkpoint" in model_line, model_line
    assert "--num-layers" in model_line and "--ffn-hidden-size" in model_line, model_line
    assert len(_losses(log)) == 2
    # fine-tune at TP 2, weights only, a new schedule; no model flag
    rc, out, err = run_world(_main, 2, ["--use-checkpoint-args", "--finetune", "--load", ck, "--tensor-parallel", "2",
                                        *RUN, *data, "--train-iters", "2", "--lr", "1e-4"], timeout=300)[0]
    assert rc == 0, err
    assert "at iteration 0" in out, out
    # a disagreeing flag: one line naming each flag with both values
    rc, out, err = run_world(_main, 1, ["--use-checkpoint-args", "--load", ck, "--num-layers", "4",
                                        "--hidden-size", "32", "--seq-length", "16", *RUN, *data,
                                        "--train-iters", "4"], timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "--num-layers: 2 in the checkpoint, 4 here" in lines[0] and "--hidden-size" not in lines[0], lines[0]
    # without --use-checkpoint-args and without shape flags: the demo shape, named as such, and the fix
    rc, out, err = run_world(_main, 1, ["--load", ck, *RUN, *data, "--train-iters", "4", "--lr-warmup-iters", "0",
                                        "--seq-length", "16"], timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "--num-layers: 2 in the checkpoint, 4 here (demo default)" in lines[0], lines[0]
    assert "--hidden-size: 32 in the checkpoint, 256 here (demo default)" in lines[0], lines[0]
    assert "--ffn-hidden-size: 48 in the checkpoint, 1024 here" in lines[0], lines[0]
    assert "--use-checkpoint-args" in lines[0], lines[0]


def test_values_the_user_did_not_give_say_they_are_demo_defaults():
    import pytest

    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.user_report import value_sources as _value_sources

    with pytest.raises(ConfigError) as e:
        parse_args(["--train-iters", "3"])
    assert str(e.value).startswith("--lr-warmup-iters 30 (demo default) exceeds --train-iters 3:"), e.value
    with pytest.raises(ConfigError) as e:
        parse_args([*SHAPE, "--lr", "1e-3", "--train-iters", "3", "--lr-warmup-iters", "5"])
    assert str(e.value).startswith("--lr-warmup-iters 5 exceeds --train-iters 3:"), e.value   # typed: no origin
    args = parse_args(["--lr", "1e-4"])
    line = _value_sources(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
    assert line == " (demo default: --num-layers, --hidden-size, --num-attention-heads, --seq-length)", line
    assert "--lr" not in _value_sources(args, ("lr", "train_iters")) and "--train-iters" in _value_sources(
        args, ("lr", "train_iters"))
    with pytest.raises(ConfigError, match="--use-checkpoint-args reads the model from the checkpoint given by --load"):
        parse_args(["--use-checkpoint-args"])


def test_the_launch_line_repeated_with_use_checkpoint_args_agrees_with_its_own_vocab_size(tmp_path):
    """NullTokenizer's --vocab-size N builds a model of N + 1 rows (its ids and the EOD id): the same
    flag repeated with --use-checkpoint-args agrees with the checkpoint (it was compared with the rows,
    N + 1, and refused), and another N is one line naming both flag values."""
    ck = str(tmp_path / "ck")
    line = [*SHAPE, *RUN, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--save", ck]
    rc, out, err = run_world(_main, 1, [*line, "--train-iters", "2"], timeout=300)[0]
    assert rc == 0, err
    rc, out, err = run_world(_main, 1, [*line, "--train-iters", "4", "--use-checkpoint-args", "--load", ck],
                             timeout=300)[0]
    assert rc == 0 and "resumed from" in out, err
    # a converted checkpoint (from-megatron, from-hf) records no --vocab-size or tokenizer among its args:
    # the typed NullTokenizer's N still names the model's N + 1 rows
    from zo_megatron.checkpoint.verify import MANIFEST, read_manifest

    it_dir, manifest = read_manifest(ck)
    manifest["args"] = {k: v for k, v in manifest["args"].items() if k not in ("vocab_size", "tokenizer_type")}
    with open(os.path.join(it_dir, MANIFEST), "w") as f:
        json.dump(manifest, f)
    rc, out, err = run_world(_main, 1, [*line, "--train-iters", "5", "--use-checkpoint-args", "--load", ck],
                             timeout=300)[0]
    assert rc == 0 and "resumed from" in out, err
    # --rope-type rope without multi-latent attention changes nothing (recorded as none): typed, it agrees
    rc, out, err = run_world(_main, 1, [*line, "--train-iters", "6", "--use-checkpoint-args", "--load", ck,
                                        "--rope-type", "rope"], timeout=300)[0]
    assert rc == 0 and "resumed from" in out, err
    other = [a if a != "95" else "94" for a in line]
    rc, out, err = run_world(_main, 1, [*other, "--train-iters", "7", "--use-checkpoint-args", "--load", ck],
                             timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "--vocab-size: 95 in the checkpoint, 94 here" in lines[0], lines[0]


def test_a_zero_centred_gamma_model_resumes_with_use_checkpoint_args_alone(tmp_path):
    """The checkpoint records --apply-layernorm-1p as GPTConfig's layernorm_zero_centered_gamma: with
    --use-checkpoint-args it comes back as the flag (it used to be set under the field's name, which no
    flag reads, and the resume was refused), and a resume without it names the flag, not the field."""
    ck = str(tmp_path / "ck")
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--save", ck]
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--apply-layernorm-1p", "--train-iters", "2"],
                             timeout=300)[0]
    assert rc == 0, err
    # no model flag, the tokenizer and vocabulary from the checkpoint too
    rc, out, err = run_world(_main, 1, ["--use-checkpoint-args", "--load", ck, *RUN, "--mock-data", "--save", ck,
                                        "--train-iters", "4"], timeout=300)[0]
    assert rc == 0 and "resumed from" in out, err
    rc, out, err = run_world(_main, 1, ["--load", ck, *SHAPE, *RUN, *data, "--train-iters", "6"], timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "--apply-layernorm-1p: True in the checkpoint, False here" in lines[0], lines[0]
