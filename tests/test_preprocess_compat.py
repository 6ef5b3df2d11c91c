"""preprocess_data.py on the JSON-lines inputs Megatron users bring (issue 17, item 17)."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from zo_megatron.data.tokenizer import BUNDLED_MERGE_FILE, BUNDLED_VOCAB_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(capsys, caplog, *args):
    """tools/preprocess_data.py's main, in this process (its CLI wrapper only imports it)."""
    from zo_megatron.data.preprocess import main

    with caplog.at_level("INFO"):
        rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err + caplog.text)


def test_a_lone_surrogate_is_one_error_line_with_file_and_line(tmp_path, capsys, caplog):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "also fine \\ud83d\\ude00"}\n{"text": "broken \\ud800 here"}\n')
    r = _cli(capsys, caplog, "--input", str(src), "--output-prefix", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if "Traceback" in ln or ln.startswith("error")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}:3: ") and "surrogate" in lines[0], r.stderr
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("name", ["docs.jsonlines", "docs.data"])
def test_json_lines_under_another_name_are_read_as_json_lines(tmp_path, name, capsys, caplog):
    transformers = pytest.importorskip("transformers")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = ["First document.\nWith two lines.", "Second: ünïcode and \"quotes\" 😀", "third"]
    src = tmp_path / name
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    r = _cli(capsys, caplog, "--input", str(src), "--output-prefix", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    if not name.endswith(".jsonlines"):
        assert "read as JSON lines" in r.stderr
    d = tmp_path / "gpt2"
    d.mkdir()
    shutil.copy(BUNDLED_VOCAB_FILE, d / "vocab.json")
    shutil.copy(BUNDLED_MERGE_FILE, d / "merges.txt")
    hf = transformers.GPT2TokenizerFast.from_pretrained(str(d))
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    got = [np.asarray(ds[i]).tolist() for i in range(len(ds))]
    assert got == [hf.encode(t) + [hf.eos_token_id] for t in texts]


def test_a_plain_text_file_stays_one_document(tmp_path, capsys, caplog):
    src = tmp_path / "notes.txt"
    src.write_text('{"title": "not the text key"}\nand then prose.\n')
    r = _cli(capsys, caplog, "--input", str(src), "--output-prefix", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "JSON lines" not in r.stderr
