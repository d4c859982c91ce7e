"""Vision-language models: which checkpoints are one, their model class and processor, the tokens sampling must not
produce, the pixel inputs of a batch, and what training may leave frozen.

A checkpoint is a vision-language model when its ``config.json`` has a ``vision_config`` (OpenRLHF's test): it loads
as ``AutoModelForImageTextToText`` with the ``AutoProcessor`` saved beside it. Tested here: Idefics3 (SmolVLM's
architecture: a SigLIP tower, a pixel-shuffle connector, a Llama language model), the ``tiny-vl`` preset, which runs
in vLLM's CPU build without torchvision (Qwen-VL's vLLM code imports it; ``docs/vision.md``).

Prompts reach vLLM with one image token per image and ``multi_modal_data`` (vLLM expands each into the image's
block); vLLM hands back the expanded prompt, which is what the learners see, with the same images' pixel tensors.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

# what an image processor's output may hold that a model's forward takes (the rest, e.g. Idefics3's rows/cols,
# only builds the prompt)
PIXEL_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")
# the added tokens a processor places and sampling must not produce: Idefics3's <image>, <fake_token_around_image>,
# <global-img>, <row_i_col_j>; Qwen-VL's <|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>; LLaVA's <image>
VISION_TOKEN = re.compile(r"image|vision|video|<row_\d+_col_\d+>|<global-img>")


def is_vision(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` is a vision-language model (its config has a ``vision_config``)."""
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def model_class(path: str | Path):
    """The transformers auto class a policy checkpoint loads with."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision(path) else AutoModelForCausalLM


def load_policy(path: str | Path, dtype=None):
    """The policy model at ``path`` (fp32 unless ``dtype``), text or vision-language."""
    import torch

    return model_class(path).from_pretrained(str(path), dtype=dtype or torch.float32, use_safetensors=True)


@lru_cache(maxsize=8)
def load_processor(path: str):
    """The checkpoint's ``AutoProcessor`` (a vision-language model's: image processor, tokenizer, chat template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def tokenizer_or_processor(path: str):
    """What a stage saves beside trained weights: the processor of a vision-language model, else the tokenizer."""
    from transformers import AutoTokenizer

    return load_processor(path) if is_vision(path) else AutoTokenizer.from_pretrained(path)


def vision_token_ids(tokenizer) -> list[int]:
    """The special tokens only a processor may place (image pads, their delimiters, tile markers): never sampled.
    A young policy gives them mass, and one sampled image token breaks the learner's forward (image features and
    image tokens must match)."""
    ordinary = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    ids = {i for t, i in tokenizer.get_added_vocab().items() if VISION_TOKEN.search(t)}
    return sorted(i for i in ids if i is not None and i not in ordinary)


@lru_cache(maxsize=4096)
def _block(path: str, ref: str) -> tuple[int, ...]:
    from datasets_prep.images import open_image

    processor = load_processor(path)
    out = processor(text=processor.image_token, images=[open_image(ref)], add_special_tokens=False)
    return tuple(out["input_ids"][0])


def _image_id(processor_path: str) -> int:
    processor = load_processor(processor_path)
    return processor.tokenizer.convert_tokens_to_ids(processor.image_token)


def image_block(processor_path: str, ref: str) -> list[int]:
    """The token ids one image takes in the model's input (the processor's expansion of one image token)."""
    return list(_block(processor_path, ref))


def _expand(ids: list[int], refs: list[str], processor_path: str) -> tuple[list[int], list[int]]:
    """``ids`` with each image token (one per image, in order) replaced by its image's block, and where each of
    ``ids`` (and the end) starts in the result."""
    image_id = _image_id(processor_path)
    out, starts, it = [], [], iter(refs)
    for t in ids:
        starts.append(len(out))
        if t != image_id:
            out.append(t)
            continue
        ref = next(it, None)
        if ref is None:
            raise ValueError(f"more image tokens than the {len(refs)} images given")
        out += image_block(processor_path, ref)
    if next(it, None) is not None:
        raise ValueError(f"{len(refs)} images for {ids.count(image_id)} image tokens")
    return out, [*starts, len(out)]


def expand_images(ids: list[int], mask: list[int], refs: list[str], processor_path: str) -> tuple[list[int], list[int]]:
    """``ids`` with each image token (one per image, in order) replaced by its image's block, out of the loss."""
    out, starts = _expand(ids, refs, processor_path)
    image_id, out_mask = _image_id(processor_path), [0] * len(out)
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if t != image_id:
            out_mask[starts[i]] = m
    return out, out_mask


def expand_episode(ids: list[int], ranges: list[tuple[int, int]], logps: list[float] | None, refs: list[str],
                   processor_path: str) -> tuple[list[int], list[tuple[int, int]], list[float] | None]:
    """A multi-turn trajectory with one image token per image (the prompt's and the environment's, in order) as the
    model sees it: every image token replaced by its block, the actions' spans moved with them, the log-probs 0.0 on
    the blocks. An action holding an image token is refused (sampling bans them)."""
    out, starts = _expand(ids, refs, processor_path)
    image_id, moved = _image_id(processor_path), []
    for a, b in ranges:
        if image_id in ids[a:b]:
            raise ValueError(f"the action at tokens {a}..{b} holds an image token")
        moved.append((starts[a], starts[b]))
    if logps is None:
        return out, moved, None
    lp = [0.0] * len(out)
    for i, (t, x) in enumerate(zip(ids, logps, strict=True)):
        if t != image_id:
            lp[starts[i]] = x
    return out, moved, lp


def expanded_length(ids: list[int], refs: list[str], processor_path: str) -> int:
    """How many tokens ``ids`` (one image token per image of ``refs``) take once the images are expanded."""
    return len(ids) + sum(len(image_block(processor_path, r)) - 1 for r in refs)


def collapse_images(ids: list[int], refs: list[str], processor_path: str) -> list[int]:
    """The inverse of :func:`expand_images`: each image's block in ``ids`` (in order) back to one image token, as
    vLLM takes a prompt with its images."""
    image_id = _image_id(processor_path)
    out, at = [], 0
    for ref in refs:
        block = image_block(processor_path, ref)
        start = next((i for i in range(at, len(ids) - len(block) + 1) if ids[i : i + len(block)] == block), None)
        if start is None:
            raise ValueError(f"no block of image {ref[:60]!r} in the sequence after position {at}")
        out += ids[at:start] + [image_id]
        at = start + len(block)
    return out + ids[at:]


def pixel_inputs(processor_path: str, images: list[list[str]]) -> dict:
    """The image processor's tensors for a batch (``images``: each row's image references, in order) that the
    model's forward takes; empty when no row has an image."""
    from datasets_prep.images import open_image

    if not any(images):
        return {}
    processor = load_processor(processor_path)
    out = processor.image_processor(images=[[open_image(r) for r in refs] for refs in images], return_tensors="pt")
    return {k: out[k] for k in PIXEL_KEYS if k in out}


def vision_tower_names(model) -> list[str]:
    """The parameter-name prefixes of the vision tower and its connector (what ``train.freeze_vision_tower`` freezes)."""
    names = []
    for n, _ in model.named_modules():
        leaf = n.rsplit(".", 1)[-1]
        if leaf in ("vision_model", "visual", "vision_tower", "connector", "multi_modal_projector"):
            if not any(n.startswith(p + ".") for p in names):
                names.append(n)
    return names


def freeze_vision_tower(model) -> int:
    """Freeze the vision tower and its connector; the number of parameters frozen."""
    frozen = 0
    for prefix in vision_tower_names(model):
        for p in model.get_submodule(prefix).parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def language_lora_targets(model, targets) -> str:
    """LoRA on the language model only: the target module names as a regular expression over the language model's
    modules (peft's ``target_modules`` as a string); ``all-linear`` is every linear layer there but the head."""
    import torch

    towers = vision_tower_names(model)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and not any(n.startswith(p + ".") or n == p for p in towers) and not n.endswith("lm_head")]
    if targets != "all-linear":
        names = [n for n in names if n.rsplit(".", 1)[-1] in targets]
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"
