"""A run's output folder: checked before anything loads, every file written whole, and a record per image that lets
a long run resume.

    out/
      run.json         what the run draws (model, prompts file's digest, steps, seed, sizes, configuration but dp):
                       a rerun into this folder must ask for the same, or it is refused naming what differs; a run
                       that drew nothing (it failed before its first image) binds no rerun: the next one replaces it
      records.jsonl    one line per image whose file is in place: id, prompt, seed, file, configuration, timings
      cat-0.png ...    each written to a temporary name and renamed, then recorded
      report.json      throughput and time per phase, written when the run ends (not after a failed write: the
                       records say what is done, and the same command resumes)

The order is the guarantee: an image's file is renamed into place before its record is appended, and a record is
one `write` of one line, synced. A run killed at any point leaves whole files and whole records, plus at most an
image without its record (drawn again on resume, its file replaced) and a torn last line (dropped on resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

RUN_FILE = "run.json"
RECORDS_FILE = "records.jsonl"


class OutputFolderError(ValueError):
    """--output names a folder this rank cannot create or write in, or one that holds another run (found before
    anything is loaded)."""


class OutputWriteError(OSError):
    """Writing an output failed after the generation; the message names the file and what was written."""


def atomic_write(path: Path, write) -> Path:
    """Call write(temporary_path), then rename it to `path`: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 would hide the outputs from the user's group
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def check_output_folder(output_dir) -> Path:
    """The output folder, proven writable by writing and removing a file in it; folders this check had to create
    are removed again, so a run that fails before it writes leaves nothing behind (the first write creates them)."""
    folder = Path(output_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"--output {folder} is a file: give a folder for the images and report.json")
    missing = [f for f in (folder, *folder.parents) if not f.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".xdit-lab-write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise OutputFolderError(
            f"cannot write the outputs to {folder} ({error.strerror or error}): give --output a folder you can "
            f"write (it is created if missing)"
        ) from None
    finally:
        for created in missing:
            with contextlib.suppress(OSError):  # not empty: another process wrote there meanwhile
                created.rmdir()
    return folder


def _umask() -> int:
    """This process's umask (read by setting it, the only way POSIX offers, and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_run(folder: Path, identity: dict) -> dict[str, dict]:
    """Start or resume the run `identity` describes in `folder` (checked writable first); return the records of
    the images already done, by id. A folder holding images of a run with another identity is refused, naming
    each argument that differs; one whose run drew nothing (it failed before its first image) is taken over, so
    the corrected command needs no manual step. Records whose file is gone, and a torn last line, are dropped
    (rewritten atomically), so that their images are drawn again and recorded once; temporaries a killed write
    left are removed."""
    folder = check_output_folder(folder)
    run_file = folder / RUN_FILE
    done, kept_lines, dropped = _read_records(folder)
    differing = []
    if run_file.exists():
        try:
            before = json.loads(run_file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise OutputFolderError(f"{run_file} cannot be read ({error}): give another --output") from None
        differing = differences(before, identity)
        if differing and done:
            detail = "; ".join(f"{key}: {there!r} there, {now!r} now" for key, there, now in differing)
            raise OutputFolderError(
                f"--output {folder} holds {len(done)} image(s) of a run with other arguments ({detail}): resume it "
                f"with the same arguments (the batch size and the dp degree may change), or give another --output"
            )
    elif any(path.is_file() for suffix in (".png", ".gif", ".pt", ".jsonl") for path in folder.glob(f"*{suffix}")):
        raise OutputFolderError(
            f"--output {folder} holds outputs but no {RUN_FILE}, so nothing says which run made them: give an "
            f"empty or new folder"
        )
    if not run_file.exists() or differing:
        atomic_write(run_file, lambda p: p.write_text(json.dumps(identity, indent=2, sort_keys=True)))
    for temporary in folder.glob(".*.partial"):  # atomic_write's, left by a run killed mid-write
        temporary.unlink(missing_ok=True)
    if dropped:
        atomic_write(folder / RECORDS_FILE, lambda p: p.write_text("".join(f"{line}\n" for line in kept_lines)))
    return done


def _read_records(folder: Path) -> tuple[dict[str, dict], list[str], int]:
    """records.jsonl read: the complete records by id (a line whose file is in the folder, each id once), their
    lines, and how many lines were dropped (a torn last line, a record whose file is gone, a repeat)."""
    done, kept_lines, dropped = {}, [], 0
    records = folder / RECORDS_FILE
    for line in records.read_text().splitlines() if records.exists() else []:
        try:
            record = json.loads(line)
            complete = isinstance(record, dict) and (folder / record["file"]).is_file()
        except (json.JSONDecodeError, KeyError, TypeError):
            complete = False  # a line torn by a kill mid-write
        if complete and record["id"] not in done:
            done[record["id"]] = record
            kept_lines.append(line)
        else:
            dropped += 1
    return done, kept_lines, dropped


def differences(before, now, prefix: str = "") -> list[tuple[str, object, object]]:
    """(key, value there, value now) for each leaf that differs between two run identities, nested keys dotted
    ("config.ulysses"), so that a refusal names the argument and not two whole dictionaries."""
    if not (isinstance(before, dict) and isinstance(now, dict)):
        return [] if before == now else [(prefix.rstrip("."), before, now)]
    found = []
    for key in sorted(set(before) | set(now)):
        found += differences(before.get(key), now.get(key), f"{prefix}{key}.")
    return found


def append_record(folder: Path, record: dict) -> None:
    """Append one image's record to records.jsonl as one synced write; a write that fails (a full disk) is cut
    back off, so the file keeps whole lines only."""
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(Path(folder) / RECORDS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(28, "No space left on device (a short write)")
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
