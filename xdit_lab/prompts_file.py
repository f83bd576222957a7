"""A prompts file: every image a run at research scale asks for, each with its own id and seed.

    xdit-lab run --prompts prompts.txt --images-per-prompt 4 --seed 0 --output out/ ...

The file is read as JSON lines when its name ends in `.jsonl`, otherwise as text, one prompt per line:

    prompts.txt                         prompts.jsonl
    a red cat                           {"prompt": "a red cat", "id": "cat", "seed": 11}
    a blue dog                          {"prompt": "a blue dog", "negative_prompt": "blurry"}

Blank lines are skipped in both. A JSON line holds `prompt` (text) and may hold `negative_prompt` (text),
`seed` (a whole number) and `id` (letters, digits, `.`, `_`, `-`): the prompt's name in the output folder.
Without one, a prompt's id is its number among the file's prompts, from 0 (`00000`, `00001`, ...).

Each prompt gives `images_per_prompt` images, and each image is one ImageJob:

    prompt "cat" (seed 11), images_per_prompt 3   ->   cat-0 (seed 11), cat-1 (seed 12), cat-2 (seed 13)
    prompt 1 (no seed), --seed 0                   ->   00001-0 (image_seed(0, 1, 0)), 00001-1 (image_seed(0, 1, 1))

An image's noise is drawn from its own seed alone (a CPU generator per image), so the image is the same whatever
the batch it is drawn in, the dp degree, or the point a run resumed from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
JSON_FIELDS = ("prompt", "negative_prompt", "seed", "id")


class PromptsFileError(ValueError):
    """The prompts file is missing, empty, or has a line that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class ImageJob:
    """One image a prompts file asks for: its id (the output file's stem, the key of its record), its text, its
    seed, and where it came from (the file's line, the prompt's number, the image's number for that prompt)."""

    id: str
    prompt: str
    negative_prompt: str | None
    seed: int
    line: int
    prompt_index: int
    image_index: int


def image_seed(seed: int, prompt_index: int, image_index: int) -> int:
    """The seed of image `image_index` of prompt `prompt_index` in a run seeded with `seed`: a hash of the three,
    so that neighbouring images do not share noise and the seed does not depend on how the run is batched."""
    digest = hashlib.sha256(f"xdit-lab/{seed}/{prompt_index}/{image_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def read_prompts_file(path, images_per_prompt: int = 1, seed: int = 0) -> list[ImageJob]:
    """Every image the file asks for, in the file's order (a prompt's images together), checked: an empty file, a
    line that is not a JSON object with a text `prompt`, an unknown field, a seed that is not a whole number, an id
    that is not a plain file name or that two prompts share are each refused, naming the file and line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise PromptsFileError(
            f"--prompts {path}: {'a folder' if path.is_dir() else 'no such file'}; give a text file with one prompt "
            f"per line, or a .jsonl file with one JSON object per line"
        )
    if not isinstance(images_per_prompt, int) or images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be a whole number >= 1; got {images_per_prompt!r}")
    as_json = path.suffix == ".jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise PromptsFileError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    prompts, first_line_of = [], {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        entry = _json_entry(path, number, text) if as_json else {"prompt": text.strip()}
        prompt_id = entry.get("id", f"{len(prompts):05d}")
        if prompt_id in first_line_of:
            raise PromptsFileError(
                f"{path}:{number}: id {prompt_id!r} is also the id of line {first_line_of[prompt_id]}: each prompt's "
                f"id names its images' files, so give each prompt its own"
            )
        first_line_of[prompt_id] = number
        prompts.append((number, prompt_id, entry))
    if not prompts:
        raise PromptsFileError(
            f"{path} holds no prompt: give one prompt per line"
            + (' (JSON lines: {"prompt": "..."})' if as_json else "")
        )
    return _image_jobs(prompts, images_per_prompt, seed)


def prompt_list_jobs(prompts, images_per_prompt: int = 1, seed: int = 0) -> list[ImageJob]:
    """The images a list of prompts (texts) asks for, as read_prompts_file gives a text file's: a prompt's `line`
    is its place in the list, from 1."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of texts, or a prompts file's path; got {prompts!r:.80}")
    if not isinstance(images_per_prompt, int) or images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be a whole number >= 1; got {images_per_prompt!r}")
    entries = [(number, f"{number - 1:05d}", {"prompt": p.strip()}) for number, p in enumerate(prompts, start=1)]
    return _image_jobs(entries, images_per_prompt, seed)


def _image_jobs(prompts: list[tuple[int, str, dict]], images_per_prompt: int, seed: int) -> list[ImageJob]:
    """(line, prompt id, entry) per prompt -> its images, a prompt's images together."""
    jobs = []
    for prompt_index, (number, prompt_id, entry) in enumerate(prompts):
        for image_index in range(images_per_prompt):
            own_seed = entry.get("seed")
            jobs.append(
                ImageJob(
                    id=f"{prompt_id}-{image_index}",
                    prompt=entry["prompt"],
                    negative_prompt=entry.get("negative_prompt"),
                    seed=own_seed + image_index
                    if own_seed is not None
                    else image_seed(seed, prompt_index, image_index),
                    line=number,
                    prompt_index=prompt_index,
                    image_index=image_index,
                )
            )
    return jobs


def _json_entry(path: Path, number: int, text: str) -> dict:
    """One JSON line, checked field by field."""
    where = f"{path}:{number}"
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as error:
        raise PromptsFileError(
            f"{where}: not JSON ({error.msg} at column {error.colno}): each line of a .jsonl prompts file is one "
            f'object, e.g. {{"prompt": "a red cat", "seed": 3}}'
        ) from None
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
        raise PromptsFileError(f'{where}: expected an object with a non-empty text "prompt", got {text.strip()[:80]!r}')
    unknown = sorted(set(entry) - set(JSON_FIELDS))
    if unknown:
        raise PromptsFileError(
            f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; a line "
            f"may hold {', '.join(JSON_FIELDS)}"
        )
    negative = entry.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise PromptsFileError(f"{where}: negative_prompt must be text, got {negative!r}")
    seed = entry.get("seed")
    if "seed" in entry and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise PromptsFileError(f"{where}: seed must be a whole number >= 0, got {seed!r}")
    prompt_id = entry.get("id")
    if "id" in entry and not (isinstance(prompt_id, str) and ID_PATTERN.fullmatch(prompt_id)):
        raise PromptsFileError(
            f"{where}: id {prompt_id!r} cannot name a file: use letters, digits, '.', '_' and '-' only"
        )
    return entry


def prompts_digest(jobs: list[ImageJob]) -> str:
    """A SHA-256 of every image's id, text and seed: what a resumed run checks it is given the same images (the same
    for a file and for a list that ask for the same)."""
    fields = [(job.id, job.prompt, job.negative_prompt, job.seed) for job in jobs]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()
