"""--load as Megatron-LM users expect it (issue 35, items 1 and 2).

`--save X --load X` works from the first launch: no checkpoint under X -> a warning and random
weights (Megatron-LM's behaviour), unless --exit-on-missing-checkpoint; then the next launch
resumes. A target that is not a checkpoint root gets its fix in one line, never "drop --load"."""
import argparse
import json
import os

import pytest

from tests.test_pretrain import TINY, _rows, _single, sotu_prefix  # noqa: F401 (a fixture)
from zo_megatron.errors import UserError
from zo_megatron.training.load_target import check_load_target


def _args(load, **kw):
    return argparse.Namespace(load=load, exit_on_missing_checkpoint=kw.get("exit", False),
                              use_checkpoint_args=kw.get("use_args", False))


def test_no_checkpoint_yet_warns_and_starts_fresh(tmp_path):
    for d, why in ((tmp_path / "nowhere", "no such directory"), (tmp_path, "no latest_checkpointed_iteration.txt")):
        a = _args(str(d))
        note = check_load_target(a)
        assert a.load is None and note.startswith("warning: --load") and why in note
        assert "--exit-on-missing-checkpoint" in note and "drop --load" not in note


@pytest.mark.parametrize("flag,match", [("exit", "--exit-on-missing-checkpoint is given"),
                                        ("use_args", "--use-checkpoint-args takes the model")])
def test_a_missing_checkpoint_is_refused_where_asked_or_needed(tmp_path, flag, match):
    a = _args(str(tmp_path / "ck"), **{flag: True})
    with pytest.raises(UserError, match=match) as e:
        check_load_target(a)
    assert "\n" not in str(e.value)


def test_an_iteration_directory_is_answered_with_its_parent(tmp_path):
    root = tmp_path / "ck"
    (root / "iter_0000070").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("70")
    (root / "iter_0000070" / "checkpoint.json").write_text("{}")
    with pytest.raises(UserError) as e:
        check_load_target(_args(str(root / "iter_0000070")))
    msg = str(e.value)
    assert f"pass its parent directory (--load {root})" in msg and "drop --load" not in msg
    assert check_load_target(_args(str(root))) is None                 # the root itself: resume


def test_a_hugging_face_model_directory_is_answered_with_the_conversion(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError) as e:
        check_load_target(_args(str(tmp_path)))
    msg = str(e.value)
    assert "a Hugging Face model (LlamaForCausalLM)" in msg and "convert_checkpoint.py from-hf --input" in msg


@pytest.mark.parametrize("fmt", ["torch_dist", "torch", "torch-release"])
def test_a_megatron_lm_checkpoint_is_answered_with_the_conversion(tmp_path, fmt):
    """Megatron-LM's checkpoint roots have the same tracker file as ours; --load of one used to end in
    "checkpoint.json is missing: the checkpoint is incomplete". Now it names the format and the fix."""
    root = tmp_path / "megatron_ckpt"
    sub = "release" if fmt.endswith("release") else "iter_0000200"
    d = root / sub
    if fmt == "torch_dist":
        d.mkdir(parents=True)
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (d / "common.pt").write_bytes(b"")
    else:
        (d / "mp_rank_00").mkdir(parents=True)
        (d / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text("release" if sub == "release" else "200")
    with pytest.raises(UserError) as e:
        check_load_target(_args(str(root)))
    msg = str(e.value)
    assert "\n" not in msg and f"a Megatron-LM checkpoint ({fmt.split('-')[0]} format" in msg, msg
    assert f"convert_checkpoint.py from-megatron --input {root} --output CKPT --tensor-parallel N" in msg, msg
    assert "--finetune" in msg and "incomplete" not in msg, msg


@pytest.mark.parametrize("tracker", ["\u00b2".encode(), b"\x80\xff"], ids=["superscript-two", "not-utf8"])
def test_a_tracker_that_is_not_an_iteration_is_left_to_the_load_s_one_line(tmp_path, tracker):
    """The Megatron-LM check reads the tracker first: a Unicode digit ('\u00b2'.isdigit() is true, int()
    refuses it) or bytes that are not UTF-8 must not raise there; the load's own check names the file."""
    from zo_megatron.checkpoint.verify import find_latest

    (tmp_path / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    assert check_load_target(_args(str(tmp_path))) is None
    with pytest.raises(UserError, match="expected an iteration number"):
        find_latest(str(tmp_path))


def test_save_x_load_x_trains_on_the_first_launch_and_resumes_on_the_second(sotu_prefix, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    common = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, "--save", str(ck), "--load", str(ck),
              "--save-interval", "2", "--log-jsonl", str(log), *TINY]
    first = _single([*common, "--train-iters", "4", "--exit-interval", "2"], tmp_path)     # stops after 2
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"warning: --load {ck}: no checkpoint there yet (no such directory); starting from randomly" in first.stdout
    assert os.path.isfile(ck / "latest_checkpointed_iteration.txt")
    second = _single([*common, "--train-iters", "4"], tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "warning: --load" not in second.stdout
    iters = [r["iteration"] for r in _rows(log, "train")]
    assert iters == [1, 2, 3, 4], iters                              # the second launch resumed at 3
    refused = _single([*common, "--train-iters", "4", "--load", str(tmp_path / "empty"),
                       "--exit-on-missing-checkpoint"], tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("error:") == 1, refused.stderr[-2000:]


def test_ckpt_step_resumes_from_that_iteration(sotu_prefix, tmp_path):
    """--ckpt-step N (Megatron-LM's flag; a no-op before issue 35) loads iteration N, not the latest;
    an iteration the directory does not hold is one line naming those it does."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    common = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, "--save", str(ck), "--save-interval", "2",
              "--train-iters", "4", *TINY]
    r = _single([*common, "--log-jsonl", str(tmp_path / "first.jsonl")], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    again = _single([*common, "--load", str(ck), "--ckpt-step", "2", "--log-jsonl", str(log)], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [row["iteration"] for row in _rows(log, "train")] == [3, 4]
    first = {row["iteration"]: row["loss"] for row in _rows(tmp_path / "first.jsonl", "train")}
    assert {row["iteration"]: row["loss"] for row in _rows(log, "train")} == {3: first[3], 4: first[4]}
    missing = _single([*common, "--load", str(ck), "--ckpt-step", "3"], tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("error:") == 1, missing.stderr[-2000:]
    assert "no committed checkpoint of iteration 3" in missing.stderr and "(it holds 2, 4)" in missing.stderr


def test_a_missing_lr_says_why_the_demo_defaults_do_not_apply():
    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args

    with pytest.raises(ConfigError, match=r"--lr is required: the model shape is given \(--num-layers --hidden-size --num-attention-heads\)"):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                    "--train-iters", "3"])


def test_a_resume_that_changes_the_run_says_so_one_line_each(sotu_prefix, tmp_path):
    """Issue 35, item 4: precision, global batch and sequence length that differ from the
    checkpoint's are named with both values; an unchanged resume says nothing."""
    ck = tmp_path / "ck"
    common = ["--zero-offload", "--data-path", sotu_prefix, "--save", str(ck), "--save-interval", "2",
              "--train-iters", "4", "--lr-decay-iters", "4", *TINY]
    r = _single([*common, "--fp32", "--exit-interval", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    same = _single([*common, "--fp32", "--load", str(ck), "--exit-interval", "3", "--save-interval", "100"], tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "this resume changes" not in same.stdout
    changed = _single([*common, "--bf16", "--load", str(ck), "--global-batch-size", "8", "--seq-length", "32",
                       "--max-position-embeddings", "64"],
                      tmp_path)
    assert changed.returncode == 0, changed.stderr[-3000:]
    lines = [ln.strip() for ln in changed.stdout.splitlines() if "this resume changes" in ln]
    assert lines == ["warning: this resume changes the precision: fp32 in the checkpoint, bf16 now (the 16-bit "
                     "weights are re-derived from the fp32 master)",
                     "warning: this resume changes --global-batch-size: 4 in the checkpoint, 8 now (samples per "
                     "step change: consumed samples and the schedule keep counting, tokens per step do not match "
                     "the earlier steps)",
                     "warning: this resume changes --seq-length: 64 in the checkpoint, 32 now (tokens per sample "
                     "change)"], lines


def test_use_checkpoint_args_takes_the_checkpoints_own_tokenizer(tmp_path, hf_tokenizer_dir):
    """Issue 35, item 3: --use-checkpoint-args resumed with the tokenizer path typed at the first
    launch, so a resume where that path no longer exists failed though the checkpoint holds its
    own fingerprinted copy; it now uses the copy."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, tok)
    ck = tmp_path / "ck"
    first = _single(["--zero-offload", "--fp32", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     str(tok), "--save", str(ck), "--train-iters", "3", "--exit-interval", "2", *TINY], tmp_path,
                    timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tok)                                   # the typed path is gone
    again = _single(["--zero-offload", "--fp32", "--load", str(ck), "--use-checkpoint-args", "--train-iters", "3",
                     "--use-checkpoint-opt_param-scheduler"], tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and f"HuggingFaceTokenizer {ck}/iter_0000002/tokenizer" in again.stdout


LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "learned"])
def test_a_rope_model_may_continue_at_a_longer_context(sotu_prefix, tmp_path, rope):
    """Issue 35, item 5: RoPE has no position table, so --max-position-embeddings above the
    checkpoint's is a longer context, not another model; a learned table must still match."""
    ck = tmp_path / "ck"
    arch = LLAMA if rope else []
    base = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, "--train-iters", "3", "--lr-decay-iters", "3",
            *TINY, *arch]
    first = _single([*base, "--save", str(ck), "--exit-interval", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    longer = _single([*base, "--load", str(ck), "--seq-length", "128", "--max-position-embeddings", "128",
                      "--override-opt_param-scheduler"], tmp_path)
    if rope:
        assert longer.returncode == 0, longer.stderr[-3000:]
        assert "resumed from" in longer.stdout and "--seq-length: 64 in the checkpoint, 128 now" in longer.stdout
    else:
        assert longer.returncode == 2 and "--max-position-embeddings: 64 in the checkpoint, 128 here" in longer.stderr


def _pretrained_args(load, pretrained, step=None):
    return argparse.Namespace(load=load, pretrained_checkpoint=pretrained, ckpt_step=step, finetune=False,
                              exit_on_missing_checkpoint=False, use_checkpoint_args=False)


def _fake_root(d):
    (d / "iter_0000004").mkdir(parents=True)
    (d / "iter_0000004" / "checkpoint.json").write_text("{}")
    (d / "latest_checkpointed_iteration.txt").write_text("4")
    return str(d)


def test_pretrained_checkpoint_is_read_only_while_load_holds_none(tmp_path):
    """Megatron-LM's load_checkpoint: --load's own checkpoint wins; without one, --pretrained-checkpoint's is
    loaded as --finetune; a pretrained directory that is no checkpoint root gets --load's fixes, named for it."""
    pre, own = _fake_root(tmp_path / "pre"), _fake_root(tmp_path / "own")
    for load in (str(tmp_path / "nowhere"), None):
        a = _pretrained_args(load, pre)
        note = check_load_target(a)
        assert a.load == pre and a.finetune is True, vars(a)
        assert f"fine-tuning from --pretrained-checkpoint {pre}" in note and not note.startswith("warning")
    a = _pretrained_args(own, pre)
    assert check_load_target(a) is None and a.load == own and a.finetune is False
    with pytest.raises(UserError) as e:
        check_load_target(_pretrained_args(str(tmp_path / "nowhere"), str(tmp_path / "missing")))
    assert f"--pretrained-checkpoint {tmp_path / 'missing'}: no checkpoint there" in str(e.value)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UserError) as e:
        check_load_target(_pretrained_args(None, str(tmp_path / "hf")))
    assert f"--pretrained-checkpoint {tmp_path / 'hf'}: a Hugging Face model (Qwen2ForCausalLM)" in str(e.value)
    assert "\n" not in str(e.value)


def test_pretrained_checkpoint_fine_tunes_on_the_first_launch_and_resumes_on_the_second(sotu_prefix, tmp_path):
    """--pretrained-checkpoint P --load X --save X: the first launch is `--load P --finetune` (the same
    losses, to the bit), the second resumes X where the first stopped."""
    pre, ck = tmp_path / "pre", tmp_path / "ck"
    base = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, *TINY]
    r = _single([*base, "--train-iters", "2", "--save", str(pre), "--save-interval", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = _single([*base, "--train-iters", "4", "--load", str(pre), "--finetune", "--log-jsonl",
                   str(tmp_path / "ref.jsonl")], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    common = [*base, "--train-iters", "4", "--pretrained-checkpoint", str(pre), "--load", str(ck), "--save", str(ck),
              "--save-interval", "2", "--log-jsonl", str(tmp_path / "log.jsonl")]
    first = _single([*common, "--exit-interval", "2"], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"--load {ck} holds no checkpoint yet: fine-tuning from --pretrained-checkpoint {pre}" in first.stdout
    second = _single(common, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "fine-tuning from --pretrained-checkpoint" not in second.stdout
    got = {row["iteration"]: row["loss"] for row in _rows(tmp_path / "log.jsonl", "train")}
    want = {row["iteration"]: row["loss"] for row in _rows(tmp_path / "ref.jsonl", "train")}
    assert list(got) == [1, 2, 3, 4] and got == want, (got, want)


def test_skip_train_evaluates_the_loaded_model_and_trains_nothing(sotu_prefix, tmp_path):
    """--skip-train (Megatron-LM's): --load's model evaluated on --eval-iters global batches of the validation
    data, no training, no optimizer state read. Reference: the run that saved the checkpoint at iteration 2,
    evaluating at that very iteration (the same weights, the same validation samples: the checkpoint was saved
    before any evaluation, and every run here builds the same datasets: one --train-iters, one --eval-interval)."""
    ck = tmp_path / "ck"
    base = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, *TINY, "--train-iters", "4", "--eval-iters", "2",
            "--eval-interval", "2"]
    saved = _single([*base, "--save", str(ck), "--save-interval", "2", "--exit-interval", "2", "--eval-iters", "0"],
                    tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    ref = _single([*base, "--exit-interval", "2", "--log-jsonl", str(tmp_path / "ref.jsonl")], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = _single([*base, "--load", str(ck), "--skip-train", "--log-jsonl", str(tmp_path / "eval.jsonl")], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipping training (--skip-train): evaluating the model of iteration 2" in r.stdout
    assert _rows(tmp_path / "eval.jsonl", "train") == []
    got, want = _rows(tmp_path / "eval.jsonl", "eval"), _rows(tmp_path / "ref.jsonl", "eval")
    assert [(g["iteration"], g["val_loss"]) for g in got] == [(w["iteration"], w["val_loss"]) for w in want] \
        and len(got) == 1, (got, want)
    bad = _single([*base, "--skip-train", "--eval-iters", "0"], tmp_path)
    assert bad.returncode == 2 and "--skip-train only evaluates" in bad.stderr and bad.stderr.count("error:") == 1
