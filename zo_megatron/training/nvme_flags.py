"""The NVMe tier's flags (issue 38, docs/nvme.md): --optimizer-nvme-path and its companions, their
checks, and the engine's NvmeConfig they give. arguments.py adds them to the job's parser
(tools/estimate_memory.py inherits them from there).
"""
from __future__ import annotations

import os

from zo_megatron.errors import ConfigError, UserError
from zo_megatron.offload.nvme_store import (DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, KERNEL_CUT, RAM_FILESYSTEMS,
                                             NvmeConfig, filesystem_type)


def add_nvme_flags(g) -> None:
    g.add_argument("--optimizer-nvme-path", default=None, metavar="DIR",
                   help="ZeRO-Offload: keep each rank's Adam moments (exp_avg, exp_avg_sq, in --exp-avg-dtype) in "
                        "files under DIR (a directory on an NVMe disk) instead of host memory, streamed through a "
                        "ring of I/O buffers for each CPU step; bitwise the in-memory run (docs/nvme.md)")
    g.add_argument("--optimizer-nvme-master", action="store_true",
                   help="with --optimizer-nvme-path: the fp32 master weights on disk too (host memory then holds "
                        "about 2 bytes/param plus the I/O buffers)")
    g.add_argument("--optimizer-nvme-buffer-count", type=int, default=DEFAULT_BUFFER_COUNT, metavar="N",
                   help="with --optimizer-nvme-path: I/O buffers in the ring (reads ahead of the CPU Adam and "
                        f"writes behind it share them; default: {DEFAULT_BUFFER_COUNT})")
    g.add_argument("--optimizer-nvme-buffer-size", type=int, default=DEFAULT_BUFFER_SIZE, metavar="ELEMENTS",
                   help="with --optimizer-nvme-path: partition elements per I/O buffer, a multiple of "
                        f"{KERNEL_CUT} (default: {DEFAULT_BUFFER_SIZE}; each buffer holds that many elements of "
                        "every state on disk)")


def check_nvme_flags(args) -> None:
    """One line per conflict. The CPU-step overlap resolves with the tier as without it (the planner
    counts its rollback state: the chunks' other places on disk, the in-memory master's backup)."""
    if args.optimizer_nvme_path is None:
        for flag in ("master", "buffer_count", "buffer_size"):
            if f"optimizer_nvme_{flag}" in getattr(args, "given", ()):
                raise ConfigError(f"--optimizer-nvme-{flag.replace('_', '-')} applies to the optimizer states on disk: "
                                  "add --optimizer-nvme-path DIR")
        return
    if not args.zero_offload:
        raise ConfigError("--optimizer-nvme-path puts the CPU optimizer's states on disk: add --zero-offload")
    nvme_config(args).check(need_dir=False)     # the directory: check_nvme_space, before launch


def check_nvme_space(args) -> None:
    """Before launch: DIR is a writable directory with room for the state files of this node's ranks
    (the memory plan's disk line); one line, exit 2, otherwise."""
    path = args.optimizer_nvme_path
    if path is None:
        return
    if not os.path.isdir(path):
        raise UserError(f"--optimizer-nvme-path {path} is not a directory: create it (on the NVMe disk)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"--optimizer-nvme-path {path} is not writable: fix its permissions or choose another directory")
    plan = getattr(args, "memory_plan", None)
    need = plan.disk_bytes_per_node if plan is not None else 0
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need:
        from zo_megatron.training.metrics import human_bytes

        raise UserError(f"--optimizer-nvme-path {path}: {human_bytes(free)} free on its filesystem, the optimizer "
                        f"states of this node's ranks need {human_bytes(need)}: free space there or use a larger disk")


def nvme_config(args) -> NvmeConfig | None:
    """The engine's `nvme` argument from the job's flags (None without --optimizer-nvme-path)."""
    if args.optimizer_nvme_path is None:
        return None
    return NvmeConfig(args.optimizer_nvme_path, master=args.optimizer_nvme_master,
                      buffer_count=args.optimizer_nvme_buffer_count, buffer_size=args.optimizer_nvme_buffer_size)


def nvme_banner_lines(args, optimizer, world_size: int = 1) -> list[str]:
    """The banner's lines for the tier: what lives where, the ring, the I/O mode, what the run will write
    (over `world_size` ranks); a RAM-backed DIR warned."""
    store = getattr(optimizer, "_nvme", None)
    if store is None:        # --optimizer-offload-fraction 0 (or auto's 0): no optimizer state on the host
        return [f" optimizer states on disk: none, the whole optimizer is on the device (--optimizer-offload-fraction "
                f"{args.optimizer_offload_fraction:g}): {args.optimizer_nvme_path} is not used"] \
            if args.optimizer_nvme_path is not None and getattr(optimizer, "offload_fraction", None) == 0 else []
    from zo_megatron.training.metrics import human_bytes

    states = ", ".join(("fp32 master" if k == "master" else f"{k} ({args.exp_avg_dtype})") for k in store.dtypes)
    lines = [f" optimizer states on disk: {states} in {args.optimizer_nvme_path}, {human_bytes(store.disk_bytes)} per rank; "
             f"I/O ring {len(store.ring)} x {args.optimizer_nvme_buffer_size} elements = "
             f"{human_bytes(store.buffer_bytes)} host per rank; "
             + ("O_DIRECT" if store.direct else "buffered I/O (the filesystem refuses O_DIRECT: the page cache "
                                                "holds another copy)")]
    # Before any step: what the run will write (consumer SSDs are rated for a few hundred TB in all);
    # the pace per day follows once steps have run (nvme_endurance_line).
    world = world_size
    run = store.bytes_per_pass * args.train_iters * world
    lines.append(f" optimizer states on disk: each step reads and writes {store.bytes_per_pass / 1e9:.3g} GB per rank: "
                 f"the run's {args.train_iters} iterations write about {run / 1e12:.3g} TB over its {world} ranks "
                 "(the TB per day follows once steps have run)")
    fs = filesystem_type(args.optimizer_nvme_path)
    if fs in RAM_FILESYSTEMS:
        lines.append(f" warning: --optimizer-nvme-path {args.optimizer_nvme_path} is on {fs}, which is host memory: "
                     "the states on it save no RAM (point it at an NVMe disk)")
    return lines


def nvme_step_fields(optimizer, last: dict, steps: int) -> dict:
    """The log row's I/O of the tier, per step of the window (none without it): bytes read and written
    and the seconds the CPU step waited for the disk (the I/O it could not hide). `last` keeps the
    store's counters at the previous row (cumulative, never reset: a delayed update may be running)."""
    store = getattr(optimizer, "_nvme", None)
    if store is None:
        return {}
    now = {"read": store.read_bytes, "written": store.written_bytes, "wait": store.wait_s}
    delta = {k: v - last.get(k, 0) for k, v in now.items()}
    last.update(now)
    n = max(steps, 1)
    return {"nvme_read_bytes_per_step": delta["read"] // n, "nvme_written_bytes_per_step": delta["written"] // n,
            "nvme_io_wait_s_per_step": delta["wait"] / n}


def nvme_endurance_line(row: dict, step_time_s: float, world_size: int) -> str | None:
    """Once, after the first log row with the tier: what the disk is written per day at this pace
    (consumer SSDs are rated for a few hundred TB written in total). None without the tier's fields."""
    written = row.get("nvme_written_bytes_per_step")
    if written is None or step_time_s <= 0:
        return None
    per_day = written * world_size * 86400 / step_time_s
    return (f" optimizer states on disk: {written / 1e9:.3g} GB written per step per rank; at this pace the job writes "
            f"about {per_day / 1e12:.3g} TB per day over its {world_size} ranks (check your SSDs' endurance rating)")
