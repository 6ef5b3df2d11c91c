"""Issue 37's long mode of tools/dpu_convergence.py: its tokenizer (a 4096-token byte-level BPE of
the embedded corpus, tools/dpu_report.corpus_tokenizer) is deterministic, has the vocabulary
MODES asks and is one the job accepts; the mode's flags carry it; complete runs' logs are kept
gzip-compressed and --reuse reads them instead of running the job (seconds: no training)."""
import gzip
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from tests.cli import run_tool
from tests.seeds import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import dpu_convergence as conv  # noqa: E402
import dpu_report  # noqa: E402

VOCAB = dpu_report.MODES["long"]["vocab"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The long mode's tokenizer, trained once for this module into a fresh cache."""
    return dpu_report.corpus_tokenizer(VOCAB, str(tmp_path_factory.mktemp("tokenizers")))


def test_the_corpus_tokenizer_is_deterministic_and_has_the_vocabulary_asked(tokenizer_dir, tmp_path):
    from zo_megatron.data.corpus import iter_corpus_documents
    from zo_megatron.data.tokenizer import HuggingFaceTokenizer

    again = dpu_report.train_corpus_tokenizer(str(tmp_path / "again"), VOCAB)   # a second training
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tokenizer_dir, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), f"two trainings wrote different {name}"
    # Cached: asking again returns the same entry without training (its file is not rewritten).
    stamp = os.stat(os.path.join(tokenizer_dir, "tokenizer.json")).st_mtime_ns
    assert dpu_report.corpus_tokenizer(VOCAB, os.path.dirname(tokenizer_dir)) == tokenizer_dir
    assert os.stat(os.path.join(tokenizer_dir, "tokenizer.json")).st_mtime_ns == stamp

    tok = HuggingFaceTokenizer(tokenizer_dir)           # the job's own loader (refuses auto_map, needs eos)
    assert VOCAB == 4096 and tok.vocab_size == VOCAB
    assert tok.eod == json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))["model"]["vocab"][dpu_report.EOS_TOKEN]
    docs = [text for _, text in iter_corpus_documents()]
    rng = random.Random(fresh_seed("corpus tokenizer round trip"))
    for _ in range(5):                                  # byte-level: any corpus slice round-trips exactly
        doc = rng.choice(docs)
        i = rng.randrange(len(doc))
        piece = doc[i:i + rng.randrange(1, 400)] + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(8))
        ids = tok.encode(piece)
        assert all(0 <= t < VOCAB for t in ids) and tok.decode(ids) == piece
        assert tok.eod not in ids
    assert tok.eod not in tok.encode(dpu_report.EOS_TOKEN)   # eos text in a document stays text
    # Merges were learnt: well under one id per byte on the corpus's own text.
    sample = docs[len(docs) // 2]
    assert len(tok.encode(sample)) < len(sample.encode()) / 3


def test_the_long_mode_flags_carry_the_tokenizer(tokenizer_dir, tmp_path):
    from zo_megatron.data.tokenizer import build_tokenizer

    flags = conv.mode_flags("long", None, None, tokenizer_cache=os.path.dirname(tokenizer_dir))
    assert flags[flags.index("--tokenizer-type") + 1] == "HuggingFaceTokenizer"
    assert flags[flags.index("--tokenizer-model") + 1] == tokenizer_dir
    m = dpu_report.MODES["long"]
    for flag, want in (("--train-iters", m["train_iters"]), ("--hidden-size", m["hidden"]), ("--num-layers", m["layers"]),
                       ("--seq-length", m["seq"]), ("--lr", "1e-3"), ("--min-lr", "1e-4"), ("--lr-warmup-iters", 30)):
        assert flags[flags.index(flag) + 1] == str(want), flag
    tok = build_tokenizer(tokenizer_type=flags[flags.index("--tokenizer-type") + 1],
                          tokenizer_model=flags[flags.index("--tokenizer-model") + 1])
    assert tok.vocab_size == VOCAB
    assert "--tokenizer-model" not in conv.mode_flags("demo", None, None)      # the demo keeps GPT-2's
    # A log names the tokenizer by content: a copy elsewhere (another cache, another checkout) is
    # the same run, another tokenizer is not.
    other = shutil.copytree(tokenizer_dir, str(tmp_path / "elsewhere"))
    swapped = [other if f == tokenizer_dir else f for f in flags]
    assert conv.canonical_flags(swapped) == conv.canonical_flags(flags)
    assert conv.canonical_flags(flags)[flags.index("--tokenizer-model") + 1].startswith("sha256:")
    with open(os.path.join(other, "tokenizer.json"), "a") as f:
        f.write(" ")
    assert conv.canonical_flags(swapped) != conv.canonical_flags(flags)


def _fake_job(seed, calls):
    """Stands in for torchrun pretrain_gpt.py: writes a complete log (header, every iteration, the
    evaluations) of random numbers to --log-jsonl, and the diagnostics a --dpu run writes."""
    rng = random.Random(seed)

    def run(cmd, capture_output, text, env):
        calls.append(cmd)
        log = cmd[cmd.index("--log-jsonl") + 1]
        iters = int(cmd[cmd.index("--train-iters") + 1])
        every = int(cmd[cmd.index("--eval-interval") + 1])
        rows = [{"kind": "header", "git_commit": "f" * 40}]
        for it in range(1, iters + 1):
            rows.append({"kind": "train", "iteration": it, "loss": rng.uniform(5, 8), "grad_norm": rng.uniform(0, 2),
                         "tokens_per_s": rng.uniform(1e3, 1e4), "step_time_s": rng.uniform(0.1, 0.3),
                         "host_model_state_bytes": 1000, "device_model_state_bytes": 100, "host_peak_bytes_max": 5000})
            if it % every == 0:
                rows.append({"kind": "eval", "iteration": it, "val_loss": rng.uniform(5, 8), "split": "validation"})
        with open(log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if "--dpu" in cmd:
            diag = env["ZO_DPU_DIAGNOSTICS"].rsplit(":", 1)[0]
            with open(diag, "w") as f:
                f.writelines(json.dumps({"update": u, "weight_error": rng.uniform(0, 1)}) + "\n" for u in range(10, iters + 1, 10))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_a_complete_run_is_kept_compressed_and_reuse_reads_it(tokenizer_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(conv.subprocess, "run", _fake_job(fresh_seed("fake job"), calls))
    runs, live = str(tmp_path / "runs"), str(tmp_path / "live")
    os.makedirs(runs)
    os.makedirs(live)
    flags = [*conv.mode_flags("long", 60, 20, tokenizer_cache=os.path.dirname(tokenizer_dir)),
             "--dpu", "--dpu-warmup-steps", "40"]
    first = conv.run_one("dpu", 7, flags, 1, runs, True, live)
    assert len(calls) == 1 and os.listdir(live) == []                  # the live logs are gone
    assert sorted(os.listdir(runs)) == ["dpu_seed7.diag.jsonl.gz", "dpu_seed7.jsonl.gz"]
    with gzip.open(os.path.join(runs, "dpu_seed7.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    head = rows[0]
    assert head["argv"] == conv.canonical_flags([*flags, "--seed", "7"])           # no path of this machine
    assert first["final_val_loss"] == [r for r in rows if r["kind"] == "eval"][-1]["val_loss"]
    assert [it for it, _ in first["weight_error"]] == [10, 20, 30, 40, 50, 60] and len(first["train"]) == 60
    with open(os.path.join(runs, "dpu_seed7.jsonl.gz"), "rb") as f:
        blob = f.read()

    again = conv.run_one("dpu", 7, flags, 1, runs, True, live)           # reused: no job
    assert len(calls) == 1 and {k: v for k, v in again.items() if k != "wall_s"} == \
        {k: v for k, v in first.items() if k != "wall_s"}
    conv.run_one("dpu", 7, [*flags, "--adam-beta1", "0.8"], 1, runs, True, live)     # other settings: rerun
    assert len(calls) == 2
    conv.run_one("dpu", 7, flags, 1, runs, False, live)                  # without --reuse: rerun
    assert len(calls) == 3
    with open(os.path.join(runs, "dpu_seed7.jsonl.gz"), "rb") as f:
        assert f.read() != blob                                             # a new run's numbers
    conv.write_gz(rows[:-1], os.path.join(runs, "dpu_seed7.jsonl.gz"))   # no last evaluation: not complete
    conv.run_one("dpu", 7, flags, 1, runs, True, live)
    assert len(calls) == 4


COMMITTED = os.path.join(ROOT, "docs", "img", "dpu_runs", "dpu_convergence_long_fp32")


def test_reuse_reads_the_committed_long_mode_logs(tmp_path, monkeypatch):
    """The committed logs of seed 1234 (docs/img/dpu_runs, exact and --dpu) are complete for today's
    long-mode flags and the tool's CLI reports from them without starting a job. Fails when MODES, the recipe or the
    tokenizer change: the committed measurement then no longer describes the tool."""
    def no_job(*a, **k):
        raise AssertionError(f"--reuse started a job: {a[0] if a else k}")

    monkeypatch.setattr(conv.subprocess, "run", no_job)
    monkeypatch.setenv("ZO_MEGATRON_CACHE", str(tmp_path / "cache"))     # the tokenizer trained afresh
    out = tmp_path / "out"
    r = run_tool("dpu_convergence", "--mode", "long", "--seeds", "1", "--precision", "fp32", "--reuse",
                 "--mitigation", "none", "--runs-dir", os.path.dirname(COMMITTED), "--out-dir", str(out))
    assert r.returncode in (0, 1), r.stderr
    report = json.load(open(out / "dpu_convergence_long_fp32.json"))
    assert report["seeds"] == [1234] and report["train_iters"] == 2000
    assert sorted(report["summary"]) == ["dpu", "exact"]
    for arm in ("exact", "dpu"):
        with gzip.open(os.path.join(COMMITTED, f"{arm}_seed1234.jsonl.gz"), "rt") as f:
            evals = [json.loads(line) for line in f if '"kind": "eval"' in line]
        assert report["summary"][arm]["final_val_loss"]["mean"] == evals[-1]["val_loss"]
