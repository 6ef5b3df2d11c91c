"""Writes docs/megatron_compat.md's flag table from the job's parser:

    python -m zo_megatron.training.megatron_doc              # print the table
    python -m zo_megatron.training.megatron_doc --write-doc  # replace it in docs/megatron_compat.md

It sits above the argument modules, which form a one-way chain (issue 36): megatron_flag_list (the
generated data) <- megatron_flags (the classification tables and the functions that read them) <-
megatron_compat (the compatibility flags and checks) <- arguments (the parser). None of them imports
this module or anything above it; the table functions take the parser and REFUSED as arguments.
"""
from __future__ import annotations

import os
import sys

from zo_megatron.training.arguments import build_parser
from zo_megatron.training.megatron_compat import REFUSED
from zo_megatron.training.megatron_flags import BEGIN, END, markdown

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "megatron_compat.md")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = markdown(build_parser(), REFUSED)
    if "--write-doc" in argv:
        old = open(DOC).read()
        new = old.split(BEGIN)[0] + text + old.split(END, 1)[1] if BEGIN in old else old.rstrip() + "\n\n" + text + "\n"
        open(DOC, "w").write(new)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
