"""Loading rows from files, ``datasets`` folders and hub ids, with mixing and validation.

Sources are JSONL/JSON, Parquet and CSV files (through ``datasets.load_dataset``), folders written by
``Dataset.save_to_disk`` (``datasets.load_from_disk``), and hub dataset ids (``load_dataset(id)``).
Several sources mix with ``dataset_probs`` (``datasets.interleave_datasets``), as in OpenRLHF.
Every row is checked before any training starts; an error names the source, the row, the field,
the value and what was expected.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset is missing, empty or has a row that does not fit the configured keys."""


class DataConfig(BaseModel):
    """Where the rows come from and how their fields map to prompts, responses and labels."""

    model_config = ConfigDict(extra="forbid")

    paths: list[str] = Field(description="local files (JSONL, JSON, Parquet, CSV), save_to_disk folders or hub dataset ids; one or several (relative paths resolve against the working directory)")
    dataset_probs: list[float] | None = Field(None, description="mix several paths with these sampling weights (OpenRLHF's --dataset_probs); None: concatenate")
    split: str = Field("train", description="the split of a hub dataset or save_to_disk folder")
    subset: str | None = Field(None, description="a hub dataset's configuration name (load_dataset's `name`, e.g. \"main\" for openai/gsm8k)")
    revision: str | None = Field(None, description="hub dataset ids: the branch, tag or commit to load (null: the default branch). Resolved to its commit sha for the run's identity (from the hub, or offline from the local Hugging Face cache), and the data is loaded at that commit")
    max_samples: int | None = Field(None, ge=1, description="keep at most this many rows (after mixing)")
    input_key: str = Field("input", description="Field names in the rows (OpenRLHF's --input_key etc.). For SFT, `input_key` may hold a list of chat messages (multi-turn; loss on assistant turns only) and `output_key` may then be null.")
    output_key: str | None = Field("output", description="the response field (SFT); null when input_key holds chat messages")
    prompt_key: str | None = Field("prompt", description="preference pairs: null takes the prompt from the pair itself (the messages chosen and rejected share, or for transcripts the common prefix up to the last `prompt_marker`, as TRL's extract_prompt)")
    chosen_key: str = Field("chosen", description="preference pairs: the preferred response (text or chat messages)")
    rejected_key: str = Field("rejected", description="preference pairs: the other response")
    label_key: str = Field("label", description="RL and eval prompts: the reference answer a grader or reward function checks against")
    margin_key: str | None = Field(None, description="preference pairs: a per-pair margin column for the reward model's margin loss")
    score_keys: tuple[str, str] | None = Field(None, description="the margin as score_chosen - score_rejected from two score columns, e.g. [score_chosen, score_rejected]")
    prompt_marker: str = Field("Assistant:", description="transcripts without a prompt column: the text that ends the prompt (the last occurrence in the shared prefix)")
    apply_chat_template: bool = Field(True, description="wrap prompts and responses in the tokenizer's chat template; false: input_template (or the text as it is) for data that carries its own role markers")
    input_template: str | None = Field(None, description="Used instead of the chat template when apply_chat_template is false, e.g. \"User: {}\\nAssistant: \".")
    max_len: int = Field(512, ge=2, description="the longest tokenized example (prompt + response)")
    overflow: Literal["truncate", "drop"] = Field("drop", description="longer examples: drop them (counted) or truncate them to max_len")
    packing: bool = Field(False, description="pack several examples into one row (position ids restart; no cross-example attention)")
    pretrain_mode: bool = Field(False, description="SFT: plain text, loss on every token (OpenRLHF's --pretrain_mode)")
    seed: int = Field(0, description="shuffling and mixing")
    image_key: str | None = Field(None, description="the images of a row (OpenRLHF's --data.image_key; a vision-language model's data): a file path (relative paths against the data file's folder, then the working directory), a list of paths, image bytes, base64 text or a data: URI, or a datasets Image value; null or missing: a text-only row. A text prompt gets the images before its text; chat messages keep their {type: image} parts")
    max_images_per_prompt: int = Field(1, ge=1, description="a row with more images is an error (and vLLM's limit_mm_per_prompt)")

    @field_validator("paths", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if not self.paths:
            raise ValueError("paths: at least one dataset path or hub id is required")
        if self.dataset_probs is not None:
            if len(self.dataset_probs) != len(self.paths):
                raise ValueError(
                    f"dataset_probs: {len(self.dataset_probs)} values for {len(self.paths)} paths; give one per path"
                )
            if any(p < 0 for p in self.dataset_probs) or sum(self.dataset_probs) <= 0:
                raise ValueError(f"dataset_probs: {self.dataset_probs} must be non-negative with a positive sum")
        if self.input_template is not None and "{}" not in self.input_template:
            raise ValueError(f"input_template: {self.input_template!r} must contain '{{}}' where the input goes")
        if self.margin_key is not None and self.score_keys is not None:
            raise ValueError(f"margin_key ({self.margin_key!r}) and score_keys ({list(self.score_keys)}) both give the margin; set one")
        if not self.prompt_marker:
            raise ValueError("prompt_marker: must be non-empty text (where a transcript's prompt ends, e.g. 'Assistant:')")
        if self.image_key is not None and (self.packing or self.pretrain_mode):
            raise ValueError(f"image_key ({self.image_key!r}) with {'packing' if self.packing else 'pretrain_mode'}: rows with "
                             "images are neither packed nor plain text (as OpenRLHF: no packing for vision-language models)")
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"max_samples: {self.max_samples} must be positive")
        return self


def _kind(value: Any) -> str | None:
    """The JSON type of a value as a column sees it (int and float are both numbers; null has none)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def scan_json_rows(path: Path) -> list[int]:
    st = path.stat()
    return list(_scan_json_rows(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=32)
def _scan_json_rows(name: str, mtime_ns: int, size: int) -> tuple[int, ...]:
    """Check a JSON-lines file (or a .json file holding one array) line by line before ``datasets`` reads it,
    and return the line number of each row.

    A line that is not UTF-8, not JSON or not an object, and a field whose JSON type differs from the one it
    had in an earlier row (``datasets`` would coerce the column, or fail without saying where), raise a
    :class:`DataError` naming the file, the line, the field and the reason.
    """
    path = Path(name)
    raw = path.read_bytes()
    rows, lines = _json_array(path, raw) if path.suffix.lower() == ".json" and raw.lstrip()[:1] == b"[" else _json_lines(path, raw)
    first: dict[str, tuple[str, str]] = {}  # field -> (its JSON type, where it was first seen)
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{path} {where}: a JSON {_kind(row) or 'null'} ({json.dumps(row)[:60]}); expected an object with named fields")
        _check_field_types(path, where, row, first)
    return tuple(lines)


def _json_array(path: Path, raw: bytes) -> tuple[list[tuple[str, Any]], list[int]]:
    """The items of a .json file holding one array, as (where, row), and their numbers."""
    try:
        items = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from e
    return [(f"item {i + 1}", item) for i, item in enumerate(items)], list(range(1, len(items) + 1))


def _json_lines(path: Path, raw: bytes) -> tuple[list[tuple[str, Any]], list[int]]:
    """The rows of a JSON-lines file, as (where, row), and their line numbers (blank lines skipped)."""
    rows, lines = [], []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path} line {n}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})") from e
        try:
            rows.append((f"line {n}", json.loads(text)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: not valid JSON ({e.msg}, column {e.colno}; line starts {text[:60]!r})") from e
        lines.append(n)
    return rows, lines


def _check_field_types(path: Path, where: str, row: dict, first: dict[str, tuple[str, str]]) -> None:
    """Each field's JSON type is the one it had where it was first seen (``first``, updated here)."""
    for key, value in row.items():
        kind = _kind(value)
        if kind is None:
            continue
        seen = first.setdefault(key, (kind, where))
        if seen[0] != kind:
            raise DataError(f"{path} {where}: field '{key}' is a JSON {kind} (value {json.dumps(value)[:60]}); "
                            f"it is a {seen[0]} in {seen[1]}, and a column holds one type")


def _cause(e: BaseException) -> BaseException:
    """The innermost exception behind ``e`` (``datasets`` wraps a parser's error in DatasetGenerationError)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return e


def looks_local(path: str) -> bool:
    """Whether ``path`` names a local file or folder (else it may be a hub dataset id)."""
    return Path(path).suffix.lower() in _FILE_BUILDERS or path.startswith((".", "/", "~"))


def looked_for(p: Path) -> str:
    """Where a missing path was looked for, for an error: its absolute form and, if relative, against what."""
    where = "" if p.is_absolute() else f"; relative paths resolve against the working directory {Path.cwd()}"
    return f"looked for {p.resolve()}{where}"


def check_path(path: str, field: str) -> None:
    """A data path that names a local file must exist (checked before any stage process starts); the error says
    where a relative path was looked for."""
    p = Path(path).expanduser()
    if p.exists() or not looks_local(path):
        return
    raise DataError(f"{field}: {path}: file not found ({looked_for(p)})")


def is_hub_id(path: str) -> bool:
    """A data path that names no local file or folder and does not look like one: a hub dataset id."""
    return not Path(path).expanduser().exists() and not looks_local(path)


def hub_revision(repo_id: str, revision: str | None = None) -> str:
    """The commit sha a hub dataset id resolves to at ``revision`` (:func:`checkpoints.hub.hub_commit`, the one
    resolution for models and datasets); unresolvable: a :class:`DataError` naming the id."""
    from checkpoints.hub import hub_commit
    from checkpoints.store import CheckpointError

    try:
        return hub_commit(repo_id, revision, "dataset")
    except CheckpointError as e:
        raise DataError(str(e)) from None


def load_source(path: str, split: str = "train", subset: str | None = None, revision: str | None = None):
    """One source as a ``datasets.Dataset`` (a hub id at the commit ``revision`` resolves to)."""
    import datasets

    p = Path(path)
    try:
        if p.is_dir():
            if (p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
                ds = datasets.load_from_disk(str(p))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise DataError(f"{path}: no split '{split}' (has {sorted(ds)})")
                    ds = ds[split]
                return ds
            return datasets.load_dataset(str(p), split=split)
        if p.is_file():
            builder = _FILE_BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(f"{path}: unsupported file type '{p.suffix}' (expected one of {sorted(_FILE_BUILDERS)})")
            if builder == "json":
                scan_json_rows(p)
            return datasets.load_dataset(builder, data_files=str(p), split="train")
        if p.suffix.lower() in _FILE_BUILDERS or path.startswith((".", "/")):
            raise DataError(f"{path}: file not found")
        return datasets.load_dataset(path, subset, split=split, revision=hub_revision(path, revision))
    except DataError:
        raise
    except Exception as e:  # malformed file, unreachable hub, ...: say which source and the parser's reason
        inner = _cause(e)
        reason = f"{type(e).__name__}: {e}" if inner is e else f"{type(inner).__name__}: {inner}"
        raise DataError(f"{path}: could not be loaded ({reason})") from e


def load_rows(config: DataConfig, check_row=None) -> list[dict]:
    """All rows of all sources, each validated with ``check_row(row, where)``, mixed and capped.

    ``check_row`` raises :class:`DataError`; ``where`` reads like ``data/sft.jsonl row 17``
    (1-based, the line number for JSONL files).
    """
    parts = []
    for path in config.paths:
        ds = load_source(path, config.split, config.subset, config.revision)
        if len(ds) == 0:
            raise DataError(f"{path}: dataset is empty (split '{config.split}')")
        if check_row is not None:
            _check_rows(path, ds, check_row)
        parts.append(ds)
    mixed = parts[0] if len(parts) == 1 else _mix(parts, config)
    if config.max_samples is not None:
        mixed = mixed.select(range(min(config.max_samples, len(mixed))))
    return list(mixed)


def _check_rows(path: str, ds, check_row) -> None:
    """``check_row(row, where)`` on every row of one source (a JSON file's rows named by their line too)."""
    p = Path(path)
    lines = scan_json_rows(p) if p.is_file() and _FILE_BUILDERS.get(p.suffix.lower()) == "json" else None
    for i, row in enumerate(ds):
        line = f" (line {lines[i]})" if lines is not None and i < len(lines) and lines[i] != i + 1 else ""
        check_row(row, f"{path} row {i + 1}{line}")


def _mix(parts: list, config: DataConfig):
    """Several sources interleaved by ``dataset_probs`` (their shared columns), until the first runs out."""
    import datasets

    common = set(parts[0].column_names).intersection(*(p.column_names for p in parts[1:]))
    parts = [p.select_columns(sorted(common)) for p in parts]
    probs = config.dataset_probs or [1.0] * len(parts)
    total = sum(probs)
    return datasets.interleave_datasets(parts, probabilities=[p / total for p in probs], seed=config.seed,
                                        stopping_strategy="first_exhausted")


def require_text(row: dict, key: str, where: str, role: str, allow_messages: bool = False) -> Any:
    """The value of ``row[key]``: a non-empty string (or a message list if allowed), else a DataError."""
    if row.get(key) is None:  # datasets fills a key absent from some rows with None
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: key '{key}' missing ({role}='{key}'; row has {present})")
    value = row[key]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field '{key}' is an empty string; expected text ({role}='{key}')")
        return value
    if allow_messages and isinstance(value, list):
        check_messages(value, where, key)
        return value
    expected = "a string or a list of chat messages" if allow_messages else "a string"
    raise DataError(f"{where}: field '{key}' has type {type(value).__name__} (value {value!r:.60}); expected {expected}")


def check_prompt_label_row(config: DataConfig):
    """Row check for prompt datasets with a label (RL prompts, eval prompts)."""

    def check(row: dict, where: str) -> None:
        if config.prompt_key is None:
            raise DataError(f"{where}: prompt_key is null, but prompts are read from a column here; name it (e.g. prompt_key: prompt)")
        require_text(row, config.prompt_key, where, "prompt_key", allow_messages=True)
        if row.get(config.label_key) is None:
            raise DataError(f"{where}: key '{config.label_key}' missing (label_key='{config.label_key}')")

    return check


def check_messages(messages: list, where: str, key: str) -> None:
    if not messages:
        raise DataError(f"{where}: field '{key}' is an empty message list")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: field '{key}' message {j}: expected {{'role': ..., 'content': ...}}, got {m!r:.80}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: field '{key}' message {j}: unknown role {m['role']!r}")
        if not isinstance(m["content"], str) or (m["role"] == "assistant" and not m["content"].strip()):
            raise DataError(f"{where}: field '{key}' message {j}: content {m['content']!r:.60} must be non-empty text")
