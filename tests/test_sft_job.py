"""--sft (Megatron-LM's supervised fine-tuning) as the job runs it: its flags' rules, one line each, and a run
on 2 forked gloo ranks (TP 2 + sequence parallelism on torch SDPA, and DP 2 on megatron-core's local attention)
over .jsonl conversations that equals a single-process torch reference which never sees an attention mask: it
runs every conversation of every packed sample through the model ON ITS OWN (a conversation starts where the
sample's positions restart at 0) and weighs the per-token losses with the sample's loss mask (the assistant's
turns; data/sft.py's rules are tests/test_sft_data.py's business); then clip_grad_norm_ and AdamW at
Megatron-LM's rate. A third run packs lines of one conversation each (--sft-pack-lines, ours; the packing
rules are tests/test_sft_packing.py's): the same reference, and several lines per sample.
"""
from __future__ import annotations

import json
import random

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_pretrain import TINY, _job, _rows

ITERS, RTOL = 3, 5e-6
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "96",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-2", "--min-lr", "3e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--train-iters", str(ITERS), "--log-interval", "1",
        "--eval-interval", str(ITERS), "--eval-iters", "1", "--split", "80,20,0", "--zero-offload", "--fp32",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--weight-decay", "0", "--clip-grad", "0.5",
        "--no-progress-bar", "--sft", "--tokenizer-type", "SFTTokenizer", "--sft-tokenizer-prompt-format",
        "chat-template"]
LAYOUTS = {"tp2_sp_sdpa": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-flash-attn"],
           "dp2_local": [],
           # ours: one conversation per line (the Hugging Face layout), several lines packed into each sample
           "dp2_local_packed_lines": ["--sft-pack-lines", "--seq-length", "192"]}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """tests/hf_tokenizer.py's tokenizer with a ChatML chat template and its two special tokens."""
    from transformers import AutoTokenizer

    from tests.hf_tokenizer import make_hf_tokenizer

    d = make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "base")
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    out = str(tmp_path_factory.mktemp("tok") / "chatml")
    tok.save_pretrained(out)
    return out


def _conversations(path, seed: int, lines: int = 120, most: int = 3):
    """`lines` JSONL lines of 1-`most` conversations each, 1-2 user/assistant exchanges each, words from the
    corpus."""
    rng = random.Random(seed)
    words = ("the state of our union is strong we the people work peace freedom nation law year "
             "congress america future").split()

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for _ in range(lines):
            messages = []
            for _ in range(rng.randint(1, most)):
                messages.append({"role": "system", "content": text(1, 3)})
                for _ in range(rng.randint(1, 2)):
                    messages += [{"role": "user", "content": text(1, 4)}, {"role": "assistant", "content": text(1, 5)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def _reference_world(rank, argv, cache, dp):
    """Every conversation of every sample through the model on its own (tests/job_reference.py)."""
    from tests.job_reference import job_model_and_data, separate_pieces_training

    args, tok, model, train_ds, valid_ds = job_model_and_data(argv, cache, dp)

    def starts_of(tokens, positions):
        return [i for i, p in enumerate(positions.tolist()) if p == 0]      # a conversation restarts them

    return separate_pieces_training(args, model, train_ds, valid_ds, starts_of, ITERS)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sft_trains_each_conversation_on_its_own(layout, tmp_path, chat_tokenizer):
    seed = fresh_seed(f"sft job {layout}")
    packed = "--sft-pack-lines" in LAYOUTS[layout]
    data = _conversations(tmp_path / "chat.jsonl", seed, most=1 if packed else 3)
    argv = [*ARGV, "--seed", str(seed), "--tokenizer-model", chat_tokenizer, "--data-path", data, *LAYOUTS[layout]]
    dp = 1 if "--tensor-model-parallel-size" in argv else 2
    log = tmp_path / "run.jsonl"
    r = _job([*argv, "--log-jsonl", str(log)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "supervised fine-tuning (--sft, prompt format chat-template)" in r.stdout
    assert ("lines packed" in r.stdout) == packed
    train = [row["loss"] for row in _rows(log, "train")]
    val = [row["val_loss"] for row in _rows(log, "eval")]
    ref, ref_val, conversations = run_world(_reference_world, 1, argv, str(tmp_path / "cache"), dp, timeout=180)[0]
    samples = (ITERS + 1) * 8                     # the training batches' and the one evaluation's
    assert conversations > samples * 1.5, conversations                # samples pack several conversations
    if packed:      # a line is a conversation: without packing these lines would take this many samples
        assert conversations > samples * 3, conversations
    assert len(train) == ITERS and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(train, ref)), (seed, train, ref)
    assert len(val) == 1 and abs(val[0] - ref_val) <= RTOL * abs(ref_val), (seed, val, ref_val)


@pytest.mark.parametrize("extra,fragment", [
    (["--sft"], "--sft trains on conversations in .jsonl files: add --data-path FILE.jsonl"),
    (["--sft", "--mock-data"], "--sft trains on conversations in .jsonl files (not --mock-data)"),
    (["--sft", "--data-path", "x.jsonl"], "--sft renders conversations with a Hugging Face tokenizer"),
    (["--tokenizer-type", "SFTTokenizer", "--tokenizer-model", "tok"], "SFTTokenizer is Megatron-LM's tokenizer for --sft"),
    (["--sft-tokenizer-prompt-format", "chat-template"], "--sft-tokenizer-prompt-format applies to --sft"),
    (["--sft-pack-lines"], "--sft-pack-lines packs the .jsonl lines of --sft: add --sft, or drop it"),
    (["--sft", "--data-path", "x.jsonl", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", "tok",
      "--reset-position-ids", "--eod-mask-loss"], "drop --reset-position-ids and --eod-mask-loss"),
])
def test_sft_flags_refused_in_one_line(extra, fragment):
    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args

    with pytest.raises(ConfigError) as exc:
        parse_args([*TINY, "--train-iters", "4", *extra])
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_sft_tokenizer_is_megatron_s_name_for_a_hugging_face_one():
    from zo_megatron.training.arguments import parse_args

    args = parse_args([*TINY, "--train-iters", "4", "--sft", "--data-path", "x.jsonl", "--tokenizer-type", "SFTTokenizer",
                       "--tokenizer-model", "tok"])
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.sft_tokenizer_prompt_format == "nemotron-h-aligned"
