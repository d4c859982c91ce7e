"""SFT examples: templating, tokenization with the prompt masked from the loss, and the length policy.

A row becomes ``Example(input_ids, loss_mask)``. Three row shapes, chosen by the data config:

- prompt/response: ``input_key`` text and ``output_key`` text; the prompt is rendered with the chat
  template as a user turn (or with ``input_template``), the response is the rest of the rendering
  (so the template's end-of-turn token is learned);
- multi-turn: ``input_key`` holds a list of chat messages; every assistant turn is in the loss,
  everything else is masked. Each turn is rendered as the difference between the template applied to
  the conversation up to and including it and the conversation before it;
- pretrain mode: ``input_key`` text, every token in the loss.

Sequences longer than ``max_len`` are truncated or dropped (``overflow``) and counted in the report. A row
whose text is longer than :func:`char_bound` characters cannot fit in ``max_len`` tokens whatever the
tokenizer does; it is dropped, or its text clipped to the bound, before it is rendered or tokenized (a
10 MB row costs no more than a short one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets_prep.loading import DataConfig, DataError, load_rows, require_text


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target
    images: list[str] = field(default_factory=list)  # image references (datasets_prep.images), each's block in input_ids


@dataclass
class PrepReport:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    clipped: int = 0  # rows whose text was cut to the character bound before tokenizing (then truncated as usual)
    loss_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.rows} rows -> {self.kept} examples ({self.truncated} truncated, {self.dropped} dropped over max_len"
        text += f"; {self.clipped} clipped to the character bound first)" if self.clipped else ")"
        return text + (f", {self.loss_tokens} loss tokens" if self.loss_tokens else "")


def data_base(config: DataConfig):
    """The folder relative image paths resolve against: the first data file's."""
    from pathlib import Path

    first = Path(config.paths[0]).expanduser()
    return first.parent if first.is_file() else first if first.is_dir() else None


def row_images(row: dict, config: DataConfig, where: str) -> list[str]:
    """A row's image references (``data.image_key``), each opened; [] without an image key."""
    if config.image_key is None:
        return []
    from datasets_prep.images import image_refs

    return image_refs(row, config.image_key, where, data_base(config), config.max_images_per_prompt)


def prompt_images(row: dict, config: DataConfig, key: str, where: str) -> tuple:
    """A prompt row's ``key`` field with its images' parts (``data.image_key``), and the images' references."""
    refs = row_images(row, config, where)
    if not refs:
        return row[key], []
    from datasets_prep.images import with_images

    return with_images(row[key], len(refs), where), refs


def check_sft_row(config: DataConfig):
    def check(row: dict, where: str) -> None:
        value = require_text(row, config.input_key, where, "input_key", allow_messages=not config.pretrain_mode)
        if config.image_key is not None:
            from datasets_prep.images import with_images

            with_images(value, len(row_images(row, config, where)), where)
        if config.pretrain_mode:
            return
        if row.get("tools") is not None:
            check_tools_column(row["tools"], where)
        if isinstance(value, list):
            if config.output_key and config.output_key in row:
                require_text(row, config.output_key, where, "output_key")
            elif not any(m["role"] == "assistant" for m in value):
                raise DataError(f"{where}: field '{config.input_key}' has no assistant turn to train on")
            if not config.apply_chat_template:
                raise DataError(f"{where}: chat messages need apply_chat_template: true")
            return
        if config.output_key is None:
            raise DataError(f"{where}: text input needs output_key (or pretrain_mode: true)")
        require_text(row, config.output_key, where, "output_key")

    return check


def check_tools_column(tools, where: str) -> None:
    """A row's ``tools``: JSON schemas (``{"type": "function", "function": {"name": ...}}``), as a list or its JSON text."""
    if isinstance(tools, str):
        import json

        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise DataError(f"{where}: field 'tools' is {tools!r:.80}; expected a list of tool JSON schemas "
                        '({"type": "function", "function": {"name": ..., "parameters": ...}}, as get_json_schema gives)')


def char_bound(tokenizer, max_len: int) -> int:
    """Characters beyond which a text cannot fit in ``max_len`` tokens: no token spells more characters than
    the longest string in the vocabulary (byte-level vocabularies spell a token with one symbol per byte)."""
    key = (id(tokenizer), max_len)
    if key not in _BOUNDS:
        _BOUNDS[key] = max_len * max(len(t) for t in tokenizer.get_vocab())
    return _BOUNDS[key]


_BOUNDS: dict[tuple[int, int], int] = {}


def text_chars(value) -> int:
    """Characters of a text field (a string, or a list of chat messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(m.get("content") or "") for m in value if isinstance(m, dict))
    return 0


def clip_text(value, bound: int):
    """The first ``bound`` characters of a text field (of each message's content for a message list)."""
    if isinstance(value, str):
        return value[:bound]
    if isinstance(value, list):
        return [{**m, "content": (m.get("content") or "")[:bound]} for m in value]
    return value


def bound_row(row: dict, keys: list[str], bound: int, overflow: str, report: PrepReport) -> dict | None:
    """``row`` as it may be tokenized: None (dropped, counted) or with its text clipped (counted) when its
    fields ``keys`` hold more than ``bound`` characters; else unchanged."""
    if sum(text_chars(row.get(k)) for k in keys) <= bound:
        return row
    if overflow == "drop":
        report.dropped += 1
        return None
    report.clipped += 1
    return {**row, **{k: clip_text(row[k], bound) for k in keys if k in row}}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools)


def render_prompt(tokenizer, prompt, config: DataConfig, tools: list[dict] | None = None) -> str:
    """The text a model sees before its response: chat template (with ``tools``: their JSON schemas, rendered by
    the template), input_template or the raw prompt."""
    if isinstance(prompt, list):
        return _render(tokenizer, prompt, add_generation_prompt=True, tools=tools)
    if config.apply_chat_template:
        return _render(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True, tools=tools)
    if config.input_template is not None:
        return config.input_template.format(prompt)
    return prompt


def render_response(tokenizer, prompt, response: str, config: DataConfig) -> str:
    """The response as the template ends it (end-of-turn token included)."""
    if config.apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        head = _render(tokenizer, messages, add_generation_prompt=True)
        full = _render(tokenizer, [*messages, {"role": "assistant", "content": response}], add_generation_prompt=False)
        if not full.startswith(head):
            raise DataError("the chat template does not render the prompt as a prefix of the conversation")
        return full[len(head):]
    return response + (tokenizer.eos_token or "")


def tokenize_conversation(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Example:
    """Token ids of a conversation with the loss on assistant turns only (``tools``: their JSON schemas, rendered
    by the chat template)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
            full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
            if not (head.startswith(done) and full.startswith(head)):
                raise DataError("the chat template does not render conversations incrementally")
            pieces = [(head[len(done):], 0), (full[len(head):], 1)]
        else:
            full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
            if not full.startswith(done):
                raise DataError("the chat template does not render conversations incrementally")
            pieces = [(full[len(done):], 0)]
        for text, in_loss in pieces:
            piece = _ids(tokenizer, text)
            ids += piece
            mask += [in_loss] * len(piece)
        done = full
    return Example(ids, mask)


def row_tools(row: dict) -> list[dict] | None:
    """A row's ``tools`` column (TRL's): the JSON schemas of the tools its conversation may call, or None."""
    tools = row.get("tools")
    if isinstance(tools, str):
        import json

        tools = json.loads(tools)
    return tools or None


def tokenize_sft_row(row: dict, tokenizer, config: DataConfig, processor_path: str | None = None, where: str = "") -> Example:
    """``processor_path``: a vision-language model's (rows with ``data.image_key``): the images' parts in the prompt,
    each image token expanded to its block (out of the loss)."""
    if config.image_key is not None:
        from datasets_prep.images import with_images
        from stages.common.vision import expand_images

        refs = row_images(row, config, where)
        if not refs:
            return _tokenize_text_row(row, tokenizer, config)
        ex = _tokenize_text_row({**row, config.input_key: with_images(row[config.input_key], len(refs), where)}, tokenizer, config)
        return Example(*expand_images(ex.input_ids, ex.loss_mask, refs, processor_path), refs)
    return _tokenize_text_row(row, tokenizer, config)


def _tokenize_text_row(row: dict, tokenizer, config: DataConfig) -> Example:
    value = row[config.input_key]
    if config.pretrain_mode:
        ids = _ids(tokenizer, value) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        return Example(ids, [1] * len(ids))
    if isinstance(value, list):
        messages = list(value)
        if config.output_key and config.output_key in row:
            messages.append({"role": "assistant", "content": row[config.output_key]})
        return tokenize_conversation(tokenizer, messages, row_tools(row))
    prompt_ids = _ids(tokenizer, render_prompt(tokenizer, value, config, tools=row_tools(row)))
    response_ids = _ids(tokenizer, render_response(tokenizer, value, row[config.output_key], config))
    return Example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def apply_length_policy(examples: list[Example], max_len: int, overflow: str, report: PrepReport) -> list[Example]:
    kept = []
    for ex in examples:
        if len(ex.input_ids) > max_len:
            if overflow == "drop":
                report.dropped += 1
                continue
            report.truncated += 1
            if ex.images:  # an image's block cut in two would not match its features
                report.dropped += 1
                continue
            ex = Example(ex.input_ids[:max_len], ex.loss_mask[:max_len])
        if sum(ex.loss_mask[1:]) == 0:  # nothing left to learn from (the first token is never a target)
            report.dropped += 1
            continue
        kept.append(ex)
    return kept


def prepare_sft(config: DataConfig, tokenizer, processor_path: str | None = None) -> tuple[list[Example], PrepReport]:
    """Load, validate and tokenize SFT rows. Raises DataError before any training on bad input. ``processor_path``:
    the model's folder when it is a vision-language model (required by ``data.image_key``)."""
    if config.image_key is not None and processor_path is None:
        raise DataError(f"{', '.join(config.paths)}: data.image_key is {config.image_key!r} but the model is not a vision-language "
                        "model (its config.json has no vision_config); use one (e.g. tiny:tiny-vl) or drop image_key")
    rows = load_rows(config, check_sft_row(config))
    report = PrepReport(rows=len(rows))
    bound = char_bound(tokenizer, config.max_len)
    keys = [k for k in (config.input_key, None if config.pretrain_mode else config.output_key) if k]
    rows = [r for r in (bound_row(r, keys, bound, config.overflow, report) for r in rows) if r is not None]
    examples = [tokenize_sft_row(r, tokenizer, config, processor_path, f"{config.paths[0]} row {i + 1}") for i, r in enumerate(rows)]
    examples = apply_length_policy(examples, config.max_len, config.overflow, report)

    if not examples:
        raise DataError(f"{', '.join(config.paths)}: no example left after the length policy ({report.summary()})")
    report.kept = len(examples)
    report.loss_tokens = sum(sum(e.loss_mask[1:]) for e in examples)
    return examples, report
