"""Paths users type: preprocessing a folder of Markdown or a glob, no empty output folder after a
failed preprocessing, the --data-path suggestion shell-quoted, and from-hf given a Hub id."""
import os
import shlex
import subprocess
import sys

import pytest

from zo_megatron.data.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_folder_of_markdown_and_a_glob_are_documents(tmp_path):
    from zo_megatron.data.preprocess import preprocess, resolve_inputs

    notes = tmp_path / "my notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.md").write_text("# Title\n\nSome text.\n")
    (notes / "sub" / "b.rst").write_text("Other text\n==========\n")
    (notes / "c.org").write_text("* heading\n")
    assert [os.path.basename(s.path) for s in resolve_inputs([str(notes)])] == ["a.md", "b.rst"]
    assert [os.path.basename(s.path) for s in resolve_inputs([str(notes / "*.org")])] == ["c.org"]
    with pytest.raises(DataError, match="the pattern matches no files"):
        resolve_inputs([str(notes / "*.tex")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"directory has no text files \(.txt .md"):
        resolve_inputs([str(tmp_path / "empty")])
    res = preprocess([str(notes)], str(tmp_path / "out dir" / "notes"), progress=False)
    assert res.documents == 2


def test_a_failed_preprocessing_leaves_no_output_folder_and_the_suggestion_is_quoted(tmp_path):
    (tmp_path / "blank.txt").write_text("")
    out = tmp_path / "new" / "deeper" / "data"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                        str(tmp_path / "blank.txt"), "--output-prefix", str(out)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and "nothing to write" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "doc.txt").write_text("hello world\n")
    out = tmp_path / "with space" / "data"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                        str(tmp_path / "doc.txt"), "--output-prefix", str(out)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    prefix = f"{out}_text_document"
    assert f"--data-path {shlex.quote(prefix)}" in r.stderr and shlex.split(f"--data-path {shlex.quote(prefix)}")[1] \
        == prefix, r.stderr


def test_from_hf_given_a_hub_id_says_how_to_get_a_local_directory(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "from-hf", "--input",
                        "gpt2", "--output", str(tmp_path / "ck"), "--tensor-parallel", "1"], capture_output=True,
                       text=True, timeout=120,
                       cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT})
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "reads a local model directory" in lines[0] and "huggingface-cli download gpt2 --local-dir gpt2" in lines[0]
    assert not (tmp_path / "ck").exists()
