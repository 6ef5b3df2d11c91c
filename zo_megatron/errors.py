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
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
# How long a rank that does not print a refusal waits before exiting (let_the_first_rank_report)
REPORT_GRACE_S = 3.0


def is_first_rank() -> bool:
    """Whether this process is global rank 0 by its launcher's variables, readable before
    torch.distributed starts (a bad flag is reported once per job, not once per rank)."""
    for name in _RANK_VARS:
        if name in os.environ:
            return os.environ[name].strip() == "0"
    return True


def let_the_first_rank_report() -> None:
    """On a rank that does not print the job's refusal, wait REPORT_GRACE_S before exiting.

    A launcher ends the whole job at the first non-zero exit (Open MPI's prterun, torchrun's agent).
    A silent rank that exits at once can get the printing rank killed before its one line is out:
    `mpirun -n 2 pretrain_gpt.py --lr -1` showed only prterun's notice naming rank 1. The wait costs
    a refused multi-rank launch 3 s; a world of one never waits."""
    sizes = [os.environ[n] for n in _SIZE_VARS if n in os.environ]
    try:
        world = int(sizes[0]) if sizes else 1
    except ValueError:
        world = 2                     # unreadable: assume a world, waiting is the safe side
    if world <= 1:
        return
    import signal

    def exit_now(signum, frame):      # the launcher's teardown once the printing rank is out
        sys.stderr.flush()
        os._exit(2)                   # this rank's status stays the refusal's, not -15 (SIGTERM)

    old = signal.signal(signal.SIGTERM, exit_now)
    try:
        time.sleep(REPORT_GRACE_S)
    finally:
        signal.signal(signal.SIGTERM, old)


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
