"""--vocab-size: a model whose vocabulary is larger than its tokenizer (Qwen2: 151936 rows, 151646
tokens) converted with `convert_checkpoint.py from-hf` loads into the job and trains.

A tiny random Qwen2 (config vocabulary = the test tokenizer's 2000 tokens + 37) goes through from-hf;
the job (1 rank, fp32) loads it with the printed flags (--vocab-size 2037 among them) and the HF
tokenizer, and its first loss -- computed by the loaded weights before any update -- equals
transformers' loss on the same sample (the data is one document as long as a sample, so every
sample is that document; fp32, 1e-5 relative). Without --vocab-size, or with one below the
tokenizer's size, the job stops with one line naming the fix.
"""
import json
import os

import pytest
import torch

from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

VOCAB = HF_VOCAB_SIZE + 37            # the config's vocabulary exceeds the tokenizer's, as Qwen2's does
TEXT = ("Mr. Speaker, Mr. Vice President, Members of the Congress, I come before you tonight to report "
        "on the state of the Union, and the state of the Union is strong.")



def one_document_dataset(tmp_path, tok_dir: str, text: str):
    """`text` as one document preprocessed with the Hugging Face tokenizer in tok_dir: (the dataset
    prefix, its token ids BOS ... EOS as a tensor), the file checked against the tokenizer."""
    import numpy as np

    from zo_megatron.data import build_tokenizer
    from zo_megatron.data.preprocess import preprocess

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "doc.txt").write_text(text)
    prefix = preprocess([str(tmp_path / "txt" / "doc.txt")], str(tmp_path / "data"), progress=False,
                        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir).prefixes["text"]
    tok = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    doc = torch.tensor([*tok.encode(text), tok.eod])                        # BOS ... EOS
    assert np.fromfile(prefix + ".bin", dtype=np.uint16).tolist() == doc.tolist()   # < 65500 tokens: uint16
    return prefix, doc

def _qwen2(directory, seed):
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
                                   use_sliding_window=False, attention_dropout=0.0,
                                   rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(str(directory))
    make_hf_tokenizer(directory)
    return str(directory)


def test_a_qwen2_from_hf_loads_with_vocab_size_and_its_first_loss_is_transformers(tmp_path):

    from tests.harness import run_world
    from tests.test_checkpoint_resume import _run_jobs
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("qwen2 --vocab-size")
    hf_dir = _qwen2(tmp_path / "hf", seed)
    ck = str(tmp_path / "ck")
    lines = []
    convert.from_hf(hf_dir, ck, tensor_parallel=1, log=lines.append)
    (flags,) = [ln.removeprefix("  model flags: ") for ln in lines if ln.startswith("  model flags: ")]
    assert flags.endswith(f" --vocab-size {VOCAB}"), flags
    tok_dir = os.path.join(ck, "iter_0000000", "tokenizer")

    prefix, doc = one_document_dataset(tmp_path, tok_dir, TEXT)
    seq = len(doc)
    assert 16 < seq <= 128 and int(doc.max()) < HF_VOCAB_SIZE

    flags = [f for f in flags.split() if f]
    without_vocab = []
    skip = False
    for f in flags:                                  # the printed flags minus --vocab-size N
        if skip:
            skip = False
            continue
        if f == "--vocab-size":
            skip = True
            continue
        without_vocab.append(f)
    common = [*without_vocab, "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
              "--lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "2", "--log-interval", "1",
              "--eval-iters", "0", "--no-progress-bar", "--split", "100,0,0", "--fp32", "--skip-memory-check",
              "--seed", str(seed), "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", tok_dir, "--load", ck]
    log = str(tmp_path / "log.jsonl")
    jobs = [("job", common),                                        # no --vocab-size: refused
            ("job", [*common, "--vocab-size", str(HF_VOCAB_SIZE - 1)]),   # below the tokenizer
            ("job", [*common, "--vocab-size", str(VOCAB), "--save", str(tmp_path / "out"),
                           "--log-jsonl", log])]
    out = run_world(_run_jobs, 1, jobs, str(tmp_path / "cache"), timeout=400)[0]

    msg = out[0].get("error", "")
    assert "\n" not in msg and f"the checkpoint's vocabulary has {VOCAB} tokens" in msg, out[0]
    assert msg.endswith(f"launch with --vocab-size {VOCAB}"), msg
    msg = out[1].get("error", "")
    assert msg == (f"--vocab-size {HF_VOCAB_SIZE - 1} is smaller than the tokenizer's {HF_VOCAB_SIZE} tokens: "
                   f"use --vocab-size >= {HF_VOCAB_SIZE} (or drop it to use the tokenizer's size)"), out[1]
    assert out[2].get("rc") == 0, out[2]
    assert "loaded weights only" in out[2]["stdout"], out[2]["stdout"][-2000:]

    with open(log) as f:
        losses = {r["iteration"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
    assert sorted(losses) == [1, 2]
    # One document of exactly one sample's length: every sample is its tokens followed by its first.
    tokens, labels = doc[None, :], torch.cat([doc[1:], doc[:1]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf(tokens).logits[0].double(), labels).item()
    assert losses[1] == pytest.approx(ref, rel=1e-5), (losses[1], ref)

    with open(os.path.join(tmp_path / "out", "iter_0000002", "checkpoint.json")) as f:
        manifest = json.load(f)
    assert manifest["model"]["vocab_size"] == VOCAB and manifest["args"]["vocab_size"] == VOCAB


@pytest.mark.parametrize("saved, model, tokenizer, files, want", [
    (VOCAB, HF_VOCAB_SIZE, HF_VOCAB_SIZE, True, f"launch with --vocab-size {VOCAB}"),
    (VOCAB, VOCAB + 5, HF_VOCAB_SIZE, True, f"launch with --vocab-size {VOCAB}"),      # a wrong --vocab-size
    (1500, HF_VOCAB_SIZE, HF_VOCAB_SIZE, True,
     "use the tokenizer it was trained with (--tokenizer-type HuggingFaceTokenizer --tokenizer-model "),
    (1500, HF_VOCAB_SIZE, HF_VOCAB_SIZE, False,
     "use the tokenizer it was trained with (--tokenizer-type GPT2BPETokenizer and its --vocab-file/--merge-file)"),
])
def test_the_vocabulary_mismatch_names_the_fix(saved, model, tokenizer, files, want, tmp_path):
    from zo_megatron.checkpoint.load import _check_model
    from zo_megatron.errors import UserError

    where = str(tmp_path / "iter_0000002" / "checkpoint.json")
    manifest = {"model": {"vocab_size": saved}, "args": {},
                **({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_files": ["tokenizer/tokenizer.json"]}
                   if files else {"tokenizer_type": "GPT2BPETokenizer"})}
    with pytest.raises(UserError) as e:
        _check_model(manifest, {"vocab_size": model}, where, tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{where}: the checkpoint's vocabulary has {saved} tokens"), msg
    assert want in msg, msg
    if files:
        assert str(tmp_path / "iter_0000002" / "tokenizer") in msg or "vocab-size" in want, msg
