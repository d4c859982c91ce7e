"""Loading rows from files, ``datasets`` folders and hub ids, with mixing and validation.

Sources are JSONL/JSON, Parquet and CSV files (through ``datasets.load_dataset``), folders written by
``Dataset.save_to_disk`` (``datasets.load_from_disk``), and hub dataset ids (``load_dataset(id)``).
Several sources mix with ``dataset_probs`` (``datasets.interleave_datasets``), as in OpenRLHF.
Every row is checked before any training starts; an error names the source, the row, the field,
the value and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset is missing, empty or has a row that does not fit the configured keys."""


class DataConfig(BaseModel):
    """Where the rows come from and how their fields map to prompts, responses and labels."""

    model_config = ConfigDict(extra="forbid")

    paths: list[str]
    dataset_probs: list[float] | None = None
    split: str = "train"
    max_samples: int | None = Field(None, ge=1)
    # Field names in the rows (OpenRLHF's --input_key etc.). For SFT, `input_key` may hold a list of
    # chat messages (multi-turn; loss on assistant turns only) and `output_key` may then be null.
    input_key: str = "input"
    output_key: str | None = "output"
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    label_key: str = "label"
    margin_key: str | None = None
    apply_chat_template: bool = True
    # Used instead of the chat template when apply_chat_template is false, e.g. "User: {}\nAssistant: ".
    input_template: str | None = None
    max_len: int = Field(512, ge=2)
    overflow: Literal["truncate", "drop"] = "drop"
    packing: bool = False
    pretrain_mode: bool = False
    seed: int = 0

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
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"max_samples: {self.max_samples} must be positive")
        return self


def load_source(path: str, split: str = "train"):
    """One source as a ``datasets.Dataset``."""
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
            return datasets.load_dataset(builder, data_files=str(p), split="train")
        if p.suffix.lower() in _FILE_BUILDERS or path.startswith((".", "/")):
            raise DataError(f"{path}: file not found")
        return datasets.load_dataset(path, split=split)
    except DataError:
        raise
    except Exception as e:  # malformed JSON, unreachable hub, ...: say which source
        raise DataError(f"{path}: could not be loaded ({type(e).__name__}: {e})") from e


def load_rows(config: DataConfig, check_row=None) -> list[dict]:
    """All rows of all sources, each validated with ``check_row(row, where)``, mixed and capped.

    ``check_row`` raises :class:`DataError`; ``where`` reads like ``data/sft.jsonl row 17``
    (1-based, the line number for JSONL files).
    """
    import datasets

    parts = []
    for path in config.paths:
        ds = load_source(path, config.split)
        if len(ds) == 0:
            raise DataError(f"{path}: dataset is empty (split '{config.split}')")
        if check_row is not None:
            for i, row in enumerate(ds):
                check_row(row, f"{path} row {i + 1}")
        parts.append(ds)
    if len(parts) == 1:
        mixed = parts[0]
    else:
        common = set(parts[0].column_names).intersection(*(p.column_names for p in parts[1:]))
        parts = [p.select_columns(sorted(common)) for p in parts]
        probs = config.dataset_probs or [1.0] * len(parts)
        total = sum(probs)
        mixed = datasets.interleave_datasets(
            parts,
            probabilities=[p / total for p in probs],
            seed=config.seed,
            stopping_strategy="first_exhausted",
        )
    if config.max_samples is not None:
        mixed = mixed.select(range(min(config.max_samples, len(mixed))))
    return list(mixed)


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
