"""The tiny-model factory: a locally trained tokenizer and a random-weight Llama, as a checkpoint.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with ``tokenizers`` on the embedded
task's text (digits split one per token), with special tokens and a chat template::

    <|bos|><|user|>12+30<|end|><|assistant|>42<|end|>

``<|end|>`` closes every turn and is the EOS token, so generation stops after the answer. The model
is a ``LlamaForCausalLM`` built from a named size preset; head size 64 keeps it loadable by vLLM's
CPU and GPU attention kernels. The output folder loads with ``AutoTokenizer``,
``AutoModelForCausalLM`` and ``vllm.LLM``.

Here, below the stages, so that ``stages.common.models`` can build one for a ``tiny:<preset>`` model spec
without running a stage; ``stages.tiny_model`` declares it as the pipeline's ``tiny_model`` stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from checkpoints import CheckpointRef, commit, staging
from stages.common.config import StageConfig
from stages.common.identity import StageRun, canonical_config, code_version, committed_checkpoint, make_run

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # tools (apply_chat_template(..., tools=schemas)): a system turn naming each with its arguments
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | join(', ') }}){% if not loop.last %}; {% endif %}{% endfor %}"
    "<|end|>{% endif %}"
    # an assistant turn's tool_calls (TRL's and OpenAI's message form) in the Hermes format the tool task uses
    "{% for m in messages %}<|{{ m['role'] }}|>"
    # content: text, or parts (a vision-language model's): {"type": "image"} as the processor's image token
    "{% if m['content'] is string or m['content'] is none %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# name -> (hidden, layers, heads, intermediate); head size is hidden // heads = 64 throughout.
PRESETS = {
    "micro": (128, 2, 2, 256),  # ~0.46M parameters: unit tests
    "tiny": (256, 4, 4, 688),  # ~3.4M parameters: the default run
    "small": (512, 8, 8, 1376),  # ~25M parameters: GPU smoke runs
    "tiny-vl": (128, 2, 2, 256),  # ~0.53M parameters, a vision-language model (build_vision_model)
}
# tiny-vl's vision tower: (width, layers, heads, intermediate, image size, patch); 56x56 images, 16 patches of 14,
# merged 2x2 by the connector into 4 image tokens (one per 28x28 quadrant)
VISION = (64, 1, 1, 128, 56, 14)
VISION_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]  # what Idefics3's processor looks up


STAGE = "tiny_model"


class TinyModelConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")

    preset: Literal["micro", "tiny", "small", "tiny-vl"] = Field("tiny", description="the model's size: micro (0.46M parameters), tiny (3.4M), small (25M), a Llama built here with a locally trained tokenizer; tiny-vl (0.53M): a vision-language model (Idefics3, SmolVLM's architecture) with its processor, for the visual task (datasets_prep.visual_task)")
    vocab_size: int = Field(512, description="the tokenizer's vocabulary (trained on the embedded task's text)")
    max_position_embeddings: int = Field(512, description="the longest sequence the model takes")
    seed: int = Field(0, description="initial weights and tokenizer training")
    tools: bool = Field(False, description="a tokenizer for the built-in tool task too (datasets_prep.tool_task): trained on its calls as well, with <tool_call>, </tool_call> and <|tool|> as tokens of their own")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")


def identify(config: TinyModelConfig, given: StageRun | None = None) -> StageRun:
    """The run identity, as ``StageSpec.identify`` computes it for the ``tiny_model`` stage (whose config and
    function live here): no inputs, no files, this module's import closure as the code version."""
    parts = {"config": canonical_config(config), "inputs": {}}
    if given is not None:
        if given.stage != STAGE or any(given.parts[k] != v for k, v in parts.items()):
            raise ValueError(f"{STAGE}: the run identity {given.key} was computed for another config")
        return given
    return make_run(STAGE, {**parts, "files": {}, "code": code_version((__name__,))}, config.output_root)


def run_tiny_model(config: TinyModelConfig, *, run: StageRun | None = None) -> CheckpointRef:
    """Build tokenizer + model and commit them as a ``full`` checkpoint (idempotent per identity: the
    tokenizer is trained on the task's text, whose generator is in the stage's code version)."""
    run = identify(config, run)
    done = committed_checkpoint(run)
    if done is not None:
        return done
    vision = config.preset.endswith("-vl")
    tokenizer = build_tokenizer(config.vocab_size, config.seed, config.tools, vision)
    if vision:
        model, tokenizer = build_vision_model(config, tokenizer)  # tokenizer: the processor (it saves its tokenizer)
    else:
        model = build_model(config, tokenizer)
    with run.claimed() as folder, staging(folder / "checkpoint") as tmp:
        dest = folder / "checkpoint"
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        return commit(
            tmp,
            dest,
            stage=STAGE,
            kind="full",
            config_hash=run.key,
            extra={"preset": config.preset, "parameters": sum(p.numel() for p in model.parameters())},
        )


def build_tokenizer(vocab_size: int = 512, seed: int = 0, tools: bool = False, vision: bool = False):
    """``tools``: trained on the tool task's text too, its call markers added as (non-special) tokens, so the
    calls stay in decoded text and take a few tokens each; ``vision``: on the visual task's text too."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from datasets_prep.synthetic import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    english = [
        "The answer is", "Compute the sum of the two numbers.", "You are a helpful assistant.",
        "Question: what is the result? Answer:", "Let me think step by step.",
    ]  # a little prose so user data in words does not fall back to single bytes everywhere
    texts = corpus(seed) + english * 50
    if tools:
        from datasets_prep.tool_task import TOOL_TOKENS
        from datasets_prep.tool_task import corpus as tool_corpus

        texts += tool_corpus(seed)
    if vision:
        from datasets_prep.visual_task import corpus as visual_corpus

        texts += visual_corpus(seed)
    tok.train_from_iterator(texts, trainer=trainer)
    if tools:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        padding_side="right",
    )


def build_model(config: TinyModelConfig, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter = PRESETS[config.preset]
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build_vision_model(config: TinyModelConfig, tokenizer):
    """An Idefics3 vision-language model (a SigLIP tower, a pixel-shuffle connector, a Llama language model of the
    preset's size) and its processor: the tokenizer with the vision tokens, Idefics3's PIL image processor (no
    torchvision) at one 56x56 tile per image, the chat template. Returns (model, processor)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    width, depth, vheads, vinter, size, patch = VISION
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size},
                                       max_image_size={"longest_edge": size})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=(size // patch) ** 2 // 4,
                                  chat_template=CHAT_TEMPLATE)
    hidden, layers, heads, inter = PRESETS[config.preset]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=inter, max_position_embeddings=config.max_position_embeddings,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, **ids)
    cfg = Idefics3Config(text_config=text.to_dict(), scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_config=dict(hidden_size=width, intermediate_size=vinter, num_hidden_layers=depth,
                                            num_attention_heads=vheads, image_size=size, patch_size=patch),
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(config.seed)
    model = Idefics3ForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(**ids)
    return model, processor
