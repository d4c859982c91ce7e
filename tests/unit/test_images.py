"""Images in rows (datasets_prep.images), the visual task, and the vision-language helpers on the tiny-vl preset."""

from __future__ import annotations

import base64
import collections
import io

import pytest
from PIL import Image

from datasets_prep.images import DATA_URI, image_refs, open_image, with_images
from datasets_prep.loading import DataError


def _png(colour=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_every_image_form_becomes_a_reference_that_opens_to_the_same_pixels(tmp_path):
    raw = _png()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    forms = ["pics/a.png", str(tmp_path / "pics" / "a.png"), raw, b64, "data:image/png;base64," + b64, {"bytes": raw, "path": None},
             {"bytes": None, "path": str(tmp_path / "pics" / "a.png")}, Image.open(io.BytesIO(raw))]
    want = list(Image.open(io.BytesIO(raw)).convert("RGB").getdata())
    for form in forms:
        (ref,) = image_refs({"images": form}, "images", "f.jsonl row 3", base=tmp_path)
        assert ref.startswith(DATA_URI) or ref == str((tmp_path / "pics" / "a.png").resolve())
        assert list(open_image(ref).getdata()) == want
    assert len(image_refs({"images": ["pics/a.png", raw]}, "images", "w", base=tmp_path, max_images=2)) == 2
    assert image_refs({"images": None}, "images", "w") == [] and image_refs({}, "images", "w") == []


def test_bad_images_are_named_by_row_field_and_value(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    cases = [
        ({"img": "missing.png"}, "f.jsonl row 7: field 'img': image file 'missing.png' does not exist"),
        ({"img": "broken.png"}, "f.jsonl row 7: field 'img': image file .*broken.png is not a readable image"),
        ({"img": b"\x00\x01"}, "f.jsonl row 7: field 'img': 2 bytes that are not an image"),
        ({"img": 3}, "f.jsonl row 7: field 'img': an image value of type int .*expected a file path"),
        ({"img": "data:image/png,abc"}, "a data: URI without base64"),
        ({"img": [_png(), _png()]}, "field 'img' has 2 images; data.max_images_per_prompt is 1"),
    ]
    for row, message in cases:
        with pytest.raises(DataError, match=message):
            image_refs(row, "img", "f.jsonl row 7", base=tmp_path, max_images=1)


def test_prompts_get_their_image_parts_where_trl_and_openrlhf_put_them():
    assert with_images("How many?", 2, "w") == [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                          {"type": "text", "text": "How many?"}]}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q"}]
    assert with_images(msgs, 1, "w")[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Q"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "image"}]}]
    assert with_images(parts, 1, "w") == parts
    with pytest.raises(DataError, match="row 4: the messages have 1 image parts but the row has 2 images"):
        with_images(parts, 2, "row 4")


def test_the_visual_task_cannot_be_answered_from_its_text():
    """The best text-only guess (each question's most common training answer) scores at chance on the held-out rows."""
    from datasets_prep.visual_task import generate
    from stages.common.graders import first_word_correct

    splits = generate(0, {"sft": 2000, "rl_prompts": 10, "eval": 400})
    counts = collections.defaultdict(collections.Counter)
    for r in splits["sft"]:
        counts[r["prompt"]][r["response"]] += 1
    guess = {q: c.most_common(1)[0][0] for q, c in counts.items()}
    hits = [first_word_correct(guess[r["prompt"]], r["answer"]) for r in splits["eval"]]
    assert sum(hits) / len(hits) < 0.33  # chance: 1/4 for every question kind
    assert set(counts) == {"How many shapes?", "What colour is the square?", "What colour is the circle?"}
    assert all(len(c) == 4 for c in counts.values())


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from stages.common.tiny import TinyModelConfig, run_tiny_model

    return run_tiny_model(TinyModelConfig(preset="tiny-vl", output_root=str(tmp_path_factory.mktemp("vl")))).path


def test_image_blocks_expand_and_collapse_and_only_vision_tokens_are_banned(tiny_vl):
    from datasets_prep.images import encode_png
    from stages.common.vision import (
        collapse_images,
        expand_images,
        image_block,
        is_vision,
        load_processor,
        vision_token_ids,
    )

    proc = load_processor(tiny_vl)
    tok = proc.tokenizer
    ref = encode_png(Image.new("RGB", (56, 56), (0, 0, 255)))
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}],
                                    add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expanded, mask = expand_images(ids, [1] * len(ids), [ref], tiny_vl)
    # the processor's own expansion of the whole prompt, and Idefics3's block: <fake><global-img><image>x4<fake>
    assert expanded == proc(text=text, images=[open_image(ref)], add_special_tokens=False)["input_ids"][0]
    block = image_block(tiny_vl, ref)
    assert tok.convert_ids_to_tokens(block) == ["<fake_token_around_image>", "<global-img>"] + ["<image>"] * 4 + ["<fake_token_around_image>"]
    assert mask.count(0) == len(block) and collapse_images(expanded, [ref], tiny_vl) == ids
    banned = set(tok.convert_ids_to_tokens(vision_token_ids(tok)))
    assert {"<image>", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>"} <= banned
    assert not banned & {"<|end|>", "<|assistant|>", "<|user|>", "<|pad|>", "<|bos|>"} and is_vision(tiny_vl)


def test_an_episode_with_two_pictures_expands_to_the_processors_ids_its_actions_moved(tiny_vl):
    """A multi-turn trajectory (prompt picture, action, a turn with a second picture, action): the expansion equals
    the processor's on the same text and pictures; the actions' spans and log-probs move past each 7-token block."""
    from datasets_prep.images import encode_png
    from stages.common.agents import AgentError, episode_of
    from stages.common.vision import expand_episode, expanded_length, load_processor

    proc = load_processor(tiny_vl)
    tok = proc.tokenizer
    refs = [encode_png(Image.new("RGB", (56, 56), c)) for c in ((0, 0, 255), (255, 0, 0))]
    ids = tok(proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
                                       add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    a1, turn, a2 = tok("3", add_special_tokens=False)["input_ids"], tok("<image> Look again.", add_special_tokens=False)["input_ids"], [5, 6]
    seq = ids + a1 + turn + a2
    ranges = [(len(ids), len(ids) + len(a1)), (len(seq) - 2, len(seq))]
    logps = [0.0] * len(ids) + [-0.5] * len(a1) + [0.0] * len(turn) + [-1.0, -2.0]
    out, moved, lp = expand_episode(seq, ranges, logps, refs, tiny_vl)
    images = [open_image(r) for r in refs]
    assert out == proc(text=tok.decode(seq), images=[images], add_special_tokens=False)["input_ids"][0]
    assert len(out) == len(seq) + 12 == expanded_length(seq, refs, tiny_vl)  # each image token -> 7 tokens
    assert moved == [(ranges[0][0] + 6, ranges[0][1] + 6), (ranges[1][0] + 12, ranges[1][1] + 12)]
    assert [lp[i] for a, b in moved for i in range(a, b)] == [-0.5] * len(a1) + [-1.0, -2.0] and sum(lp) == sum(logps)
    result = {"observation_tokens": seq, "action_ranges": ranges, "rollout_log_probs": logps, "images": refs, "reward": 1.0}
    ep = episode_of(result, tok, True, "row 1", tiny_vl, seen=out[: moved[1][0]])
    assert ep.prompt_ids + ep.token_ids == out and ep.images == refs and sum(ep.action_mask) == len(a1) + 2
    with pytest.raises(AgentError, match="row 1: the episode.s images: more image tokens than the 1 images given"):
        episode_of({**result, "images": refs[:1]}, tok, True, "row 1", tiny_vl)
    with pytest.raises(AgentError, match="differs from the prompt vLLM saw"):
        episode_of(result, tok, True, "row 1", tiny_vl, seen=seq[: ranges[1][0]])


def test_a_batchs_image_lists_follow_its_rows_when_cut_and_sorted():
    import torch

    from stages.rl.experience import TrainBatch

    ids = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    z = torch.zeros(3, 3)
    b = TrainBatch(ids, (ids > 0).long(), (ids > 0).long(), z, z, None, None, None, None, 1.0, images=[["a"], ["b", "c"], ["d"]])
    assert b.sorted_by_length().images == [["b", "c"], ["d"], ["a"]] and b.rows(1, 3).images == [["b", "c"], ["d"]]
    assert b.trimmed().images == b.images and b.sorted_by_length().rows(0, 1).input_ids.tolist() == [[1, 1, 1]]


def test_lora_targets_the_language_model_and_the_tower_freezes(tiny_vl):
    import re

    from stages.common.vision import freeze_vision_tower, language_lora_targets, load_policy

    model = load_policy(tiny_vl)
    pattern = re.compile(language_lora_targets(model, ["q_proj", "v_proj"]))
    hit = [n for n, _ in model.named_modules() if pattern.match(n)]
    assert hit and all(n.startswith("model.text_model.") and n.endswith(("q_proj", "v_proj")) for n in hit)
    assert len(hit) == 4  # 2 layers x (q, v); the vision tower's q/v are left alone
    frozen = freeze_vision_tower(model)
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector.")))
    assert frozen == tower > 0
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("model.vision_model."))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.text_model."))
