"""Ranks started for `xdit-lab run --ranks N`, and an error said once however many ranks meet it.

    xdit-lab run --ranks 2 --model digits --prompt "a 7" --ulysses 2 --output out
        = torchrun --standalone --nproc_per_node 2 -m xdit_lab.cli run --model digits ... (torch's own launcher,
          run in this process), with one difference: a failed run ends in its one error line, not in torchrun's
          traceback (ChildFailedError and its table), which torch's `torchrun` command prints whatever the ranks do.

Every rank checks the same arguments and reads the same folder, so a mistake is met by every rank: `say_once`
prints a message once per node and torchrun job. The ranks of one job on one node share a parent (the launcher's
agent), so the first rank to create a marker named by that parent and the message's digest prints it, and the
others stay quiet; a message that differs (a peer timeout names its own rank) is said by each rank that has it.
Outside torchrun there is one process, which says everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

LAUNCHED = "XDIT_LAB_LAUNCHED"  # set for the ranks `xdit-lab run --ranks N` starts (their --ranks is the launcher's)
OURS = (1, 2)  # the exit codes of an error xdit-lab said (2: the user's input, 1: the run), see cli.cmd_run
MARKERS_KEPT_S = 86_400  # markers of older jobs are removed as new ones are made


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun (or `xdit-lab run --ranks`) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def say_once(text: str, stream=None) -> bool:
    """Print `text` (to stderr) unless another rank of this torchrun job on this node printed the same text; True
    when this call printed it. A marker that cannot be made (an unwritable temporary folder) never silences it."""
    key = _job_key()
    if key is not None:
        folder = Path(tempfile.gettempdir()) / "xdit-lab-said"
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        try:
            folder.mkdir(exist_ok=True)
            _forget_old_markers(folder)
            os.close(os.open(folder / f"{key}-{digest}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            return False
        except OSError:
            pass
    print(text, file=stream or sys.stderr, flush=True)
    return True


def _job_key() -> str | None:
    """What names this torchrun job on this node: its agent's process id and start time (a process id alone is
    reused), or None outside torchrun or where /proc does not say."""
    if not under_torchrun():
        return None
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, IndexError):
        return None
    return f"{parent}-{started}"


def _forget_old_markers(folder: Path) -> None:
    now = time.time()
    for marker in folder.iterdir():
        with contextlib.suppress(OSError):  # another rank removed it first
            if now - marker.stat().st_mtime > MARKERS_KEPT_S:
                marker.unlink()


def launch_ranks(ranks: int, argv: list[str]) -> int:
    """`xdit-lab ARGV` on `ranks` local processes, started by torch's torchrun machinery (a standalone rendezvous on
    a free port); the exit code of the run. The ranks say their own errors (say_once); a rank that ended otherwise
    (killed, crashed) is named here in one line, and torchrun's ChildFailedError is not printed."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for logger in ("torch.distributed.run", "torch.distributed.elastic"):  # its notes and its lines on a failure
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    torchrun = get_args_parser().parse_args(
        ["--standalone", "--nproc_per_node", str(ranks), "-m", "xdit_lab.cli", *argv]
    )
    os.environ[LAUNCHED] = "1"
    try:
        run(torchrun)
    except ChildFailedError as failed:
        codes = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        said = any(code in OURS for code in codes.values())
        for rank, failure in sorted(failed.failures.items()):
            if failure.exitcode in OURS or (said and failure.exitcode < 0):  # the latter stopped by torchrun
                continue
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"xdit-lab run: rank {rank} ended with {how}: see its output above", file=sys.stderr)
        first = next(iter(codes.values()), 1)
        return first if first > 0 else 1
    finally:
        os.environ.pop(LAUNCHED, None)
    return 0
