"""User-facing errors: one line that names the problem and the fix.

The CLI catches `UserError` and prints `error: <message>` with exit code 2, never a traceback.
Under torchrun the same line is also written to torch elastic's error file
(`TORCHELASTIC_ERROR_FILE`), so torchrun's own failure summary names it as the root cause instead
of "error_file: <N/A>" (docs/launch.md).
"""
import json
import os
import sys
import time


class UserError(ValueError):
    """Bad input from the user (flags, files, environment)."""


class ConfigError(UserError):
    """An impossible parallel/model/batch configuration."""


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Each launcher's global-rank variable, in parallel/launch_env.py's order of precedence.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def is_first_rank() -> bool:
    """Whether this process is global rank 0 by its launcher's variables, readable before
    torch.distributed starts (a bad flag is reported once per job, not once per rank)."""
    for name in _RANK_VARS:
        if name in os.environ:
            return os.environ[name].strip() == "0"
    return True


def record_error_line(line: str) -> None:
    """Write `line` where torchrun's agent reads a worker's root cause (a no-op outside torchrun).

    Every rank writes it, printed or not: torchrun names the FIRST rank to exit as the root
    cause, and that is often not rank 0. The format is torch elastic's ErrorHandler record
    (message + extraInfo.py_callstack, which is what the summary prints as "traceback")."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass                      # the launcher's summary is a convenience: never fail over it


def report_error(message: str, *, print_it: bool = True) -> None:
    """`error: <message>` on stderr (when `print_it`) and in torchrun's error file (always)."""
    line = f"error: {message}"
    if print_it:
        print(line, file=sys.stderr, flush=True)
    record_error_line(line)
