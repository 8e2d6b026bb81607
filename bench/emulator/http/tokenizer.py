"""A tiny model directory made on the spot, for a stand-in engine (bench/emulator/http/engine.py) and a
gateway in front of it without a download: a byte-level BPE trained on a small corpus of `WORDS`,
with the ChatML chat template. The gateway tests and the gateway benchmarks share it."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# ChatML, as the reference model's template (shared/reference/make_model.py), with the block
# tags on lines of their own so trim_blocks / lstrip_blocks matter.
CHAT_TEMPLATE = """{% for m in messages %}
    {% if m['role'] == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "an",
    "be", "are", "have", "it", "not", "this", "which", "or", "prefill", "decode", "cache", "block", "token",
    "request", "model", "server", "router", "memory", "latency", "transfer", "remote", "local",
]  # fmt: skip


def make_tokenizer(
    directory: Path, *, vocab: int = 1024, bos_post_processor: bool = True, added_tokens: Sequence[str] = ()
) -> Path:
    """A byte-level BPE trained on a small corpus, with the ChatML template, saved as a model
    directory (tokenizer.json + tokenizer_config.json) the way transformers saves one;
    `added_tokens` are appended as plain (not special) added tokens, as Qwen's <think>."""
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 40))) for _ in range(2000)]
    corpus += ["".join(rnd.choice(string.printable[:95]) for _ in range(200)) for _ in range(500)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if bos_post_processor:  # a text prompt with add_special_tokens=True starts with <s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
