"""Prompt/answer rows from a dataset on disk, read through Hugging Face ``datasets``.

``task.name=dataset:<source>`` where ``<source>`` is

* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with ``datasets.load_from_disk``);
* a ``.json`` / ``.jsonl`` file (``datasets.load_dataset("json")``) or a ``.parquet`` file
  (``datasets.load_dataset("parquet")``).

``task.name=jsonl:<file>`` is the same as ``dataset:<file>`` for a JSON-lines file.  A JSON-lines file is first scanned
line by line, so a bad line is reported as ``file:line`` (not UTF-8, not JSON, not an object, a missing or bad field).

Columns: ``task.prompt_column`` (strings) and ``task.answer_column`` (strings or numbers, read as text).  With
``task.answer_format=gsm8k`` the reference answer is the text after the last ``####`` of the answer column (commas
removed: ``1,000`` -> ``1000``), the GSM8K convention; every row must have one.  Refused with one line naming the
source (and the row or line): a missing source, an unknown file type, no rows, a missing column, a prompt that is not
a string, an empty prompt or answer, a missing split.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from .vocabulary import ANSWER_FORMATS
JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet", ".pq")


def scan_json_lines(path: str) -> list[int]:
    """Line number of every non-blank line of the JSON-lines file ``path``; each must be a UTF-8 JSON object
    (else ``ValueError`` ``"path:line: ..."``)."""
    lines: list[int] = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text") from None
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            lines.append(lineno)
    return lines


def _quiet_load(fn, *args, **kwargs):
    """Call a ``datasets`` loader with its progress bars off (restored afterwards)."""
    import datasets.utils as ds_tqdm
    from datasets.utils import logging as ds_logging

    was_off = ds_tqdm.are_progress_bars_disabled()
    level = ds_logging.get_verbosity()
    ds_tqdm.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        return fn(*args, **kwargs)
    finally:
        ds_logging.set_verbosity(level)
        if not was_off:
            ds_tqdm.enable_progress_bars()


def open_source(source: str, json_lines: bool = False) -> Any:
    """The ``datasets.Dataset`` or ``DatasetDict`` at ``source`` (module docstring); ``ValueError`` naming it.
    ``json_lines`` reads a file of any name as JSON lines (the ``jsonl:`` shorthand)."""
    import datasets

    if not source:
        raise ValueError("task.name='dataset:' needs a folder or a file, e.g. task.name=dataset:data/train.jsonl")
    if os.path.isdir(source):
        if not any(os.path.isfile(os.path.join(source, f)) for f in ("dataset_info.json", "dataset_dict.json",
                                                                     "state.json")):
            raise ValueError(f"{source!r} is a folder but not a saved dataset (Dataset.save_to_disk writes "
                             "dataset_info.json / dataset_dict.json); for files name the file itself")
        try:
            return _quiet_load(datasets.load_from_disk, source)
        except Exception as exc:  # noqa: BLE001 - datasets' own errors, one line naming the folder
            raise ValueError(f"{source!r}: datasets.load_from_disk failed: {_first_line(exc)}") from None
    if not os.path.isfile(source):
        raise ValueError(f"task file {source!r} does not exist")
    lower = source.lower()
    if json_lines or lower.endswith(JSON_SUFFIXES):
        builder = "json"
    elif lower.endswith(PARQUET_SUFFIXES):
        builder = "parquet"
    else:
        raise ValueError(f"{source!r}: unknown file type; expected .json, .jsonl, .parquet or a save_to_disk folder")
    if _holds_no_rows(source, builder):      # datasets' own message for this is "Instruction 'train' ... no data"
        raise ValueError(f"task file {source!r} has no records")
    try:
        return _quiet_load(datasets.load_dataset, builder, data_files=source)
    except Exception as exc:  # noqa: BLE001 - datasets' own errors, one line naming the file
        raise ValueError(f"{source!r}: datasets.load_dataset({builder!r}) failed: {_first_line(exc)}") from None


def _holds_no_rows(source: str, builder: str) -> bool:
    """True for a Parquet file of 0 rows, a blank file, or a JSON file holding an empty list."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(source).metadata.num_rows == 0
        except Exception:  # noqa: BLE001 - not Parquet: datasets reports it
            return False
    with open(source, "rb") as fh:
        head = fh.read(1 << 16)
    if not head.strip():
        return True
    if head.lstrip().startswith(b"["):
        try:
            with open(source, encoding="utf-8") as fh:
                return json.load(fh) == []
        except ValueError:
            return False
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def pick_split(data: Any, split: str, source: str, key: str = "task.split") -> Any:
    """Split ``split`` of a ``DatasetDict``; a single ``Dataset`` is its own ``train`` split."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{key}={split!r}: {source!r} has no split {split!r} (splits: {', '.join(data)})")
        return data[split]
    if split != "train":
        raise ValueError(f"{key}={split!r}: {source!r} holds a single dataset (no named splits); use 'train'")
    return data


def gsm8k_final(text: str) -> Optional[str]:
    """The final answer of a GSM8K answer: the text after the last ``####``, first line, commas removed."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip().replace(",", "") if tail else ""


def read_rows(table: Any, source: str, *, prompt_column: str = "prompt", answer_column: str = "answer",
              answer_format: str = "plain", lines: Optional[Sequence[int]] = None) -> list[tuple[str, str, dict]]:
    """``(prompt, reference answer, row)`` of every row of the ``datasets.Dataset`` ``table``, ``row`` being the dict
    of all its columns as stored.  ``lines`` (JSON-lines files) maps row ``i`` to its line number
    for messages.  Raises ``ValueError`` naming the source and row on every problem of the module docstring."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"task.answer_format={answer_format!r} is not one of {ANSWER_FORMATS}")
    where = (lambda i: f"{source}:{lines[i]}") if lines is not None else (lambda i: f"{source}: row {i}")
    if len(table) == 0:
        raise ValueError(f"task file {source!r} has no records")
    names = list(table.column_names)
    for key, col in (("task.prompt_column", prompt_column), ("task.answer_column", answer_column)):
        if col not in names:
            raise ValueError(f"{key}={col!r}: {source!r} has no column {col!r} (columns: {', '.join(names)})")
    rows = table.to_list()
    out = []
    for i, row in enumerate(rows):
        prompt, answer = row[prompt_column], row[answer_column]
        if not isinstance(prompt, str):
            raise ValueError(f"{where(i)}: column {prompt_column!r} is {type(prompt).__name__} {prompt!r}, "
                             "expected a string prompt")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where(i)}: column {answer_column!r} is {type(answer).__name__} {answer!r}, "
                             "expected a string (or a number)")
        answer = answer if isinstance(answer, str) else str(answer)
        if answer_format == "gsm8k":
            final = gsm8k_final(answer)
            if final is None:
                raise ValueError(f"{where(i)}: task.answer_format=gsm8k but column {answer_column!r} has no '####'")
            answer = final
        for key, text in (("prompt", prompt), ("answer", answer)):
            if not text.strip():
                raise ValueError(f"{where(i)}: empty '{key}'")
        out.append((prompt, answer, row))
    return out


def load_rows(source: str, *, split: str = "train", prompt_column: str = "prompt", answer_column: str = "answer",
              answer_format: str = "plain", key: str = "task.split",
              json_lines: bool = False) -> list[tuple[str, str, dict]]:
    """:func:`open_source` + :func:`pick_split` + :func:`read_rows` (JSON-lines files, named ``.jsonl`` or read with
    ``json_lines``, are scanned first)."""
    lines = None
    if os.path.isfile(source) and (json_lines or source.lower().endswith(".jsonl")):
        lines = scan_json_lines(source)
        if not lines:
            raise ValueError(f"task file {source!r} has no records")
    table = pick_split(open_source(source, json_lines), split, source, key)
    if lines is not None and len(lines) != len(table):
        lines = None
    return read_rows(table, source, prompt_column=prompt_column, answer_column=answer_column,
                     answer_format=answer_format, lines=lines)
