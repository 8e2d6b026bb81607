"""Build a random-weight Llama (fp32) plus a locally trained byte-level BPE tokenizer. No model hub.

    .venv-vllm/bin/python deploy/vllm/make_model.py OUT --size tiny|small

Runs with the vLLM venv's python (needs torch, transformers, tokenizers). Deterministic: seeded
corpus, single-threaded tokenizer training, seeded weights, so two runs write identical files. A
no-op when OUT already holds a complete model of the same size and recipe version (see
`deploy/local/models.py`, which also holds the shapes). The stamp file is written last, after an
atomic rename of the whole directory, so a killed run never looks complete.

`initializer_range` is 0.1: at the usual 0.02 the random model's greedy output collapses to one
repeated token, which would hide wrong KV (every answer looks alike).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import string
import sys
import tempfile
from pathlib import Path
from typing import Any

# Single-threaded BPE training: its merge order must not depend on thread scheduling.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO_ROOT = Path(__file__).resolve().parents[2]
# Run as a script, sys.path[0] is deploy/vllm: replace it by the repo root so `deploy.local`
# imports and nothing in this folder shadows a top-level module.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO_ROOT)
elif str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from deploy.local.models import (  # noqa: E402
    RECIPE_VERSION,
    SIZES,
    STAMP_FILE,
    ModelSize,
    is_built,
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
BOS_ID, EOS_ID, PAD_ID = 1, 2, 5

# Hermes-style (the shape Qwen2.5 and Hermes 2 Pro use, written for these models): ChatML turns;
# `tools`, when given, are listed one JSON object per line inside <tools></tools> in the first
# system turn, with the <tool_call> instruction; an assistant turn's tool calls follow its
# content as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> blocks; consecutive
# `tool` results become one user turn of <tool_response> blocks. Content is always a string here:
# the template never loops over m['content'], so vLLM detects the "string" content format.
CHAT_TEMPLATE = "".join(
    [
        "{%- set ns = namespace(system_done=false) %}",
        "{%- if tools %}{{- '<|im_start|>system\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}",
        "{%- set ns.system_done = true %}{%- endif %}",
        "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}",
        "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}",
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}",
        "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}",
        "{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}",
        '{{- \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}',
        "{%- endif %}",
        "{%- for m in messages %}",
        "{%- if m['role'] == 'system' and loop.first and ns.system_done %}",
        "{%- elif m['role'] == 'tool' %}",
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}",
        "{{- '<|im_start|>user' }}{%- endif %}",
        "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}",
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}",
        "{{- '<|im_end|>\\n' }}{%- endif %}",
        "{%- elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}",
        "{{- '<|im_start|>assistant' }}",
        "{%- if m['content'] %}{{- '\\n' + m['content'] }}{%- endif %}",
        "{%- for tc in m['tool_calls'] %}",
        "{%- set f = tc['function'] if tc['function'] is defined else tc %}",
        "{{- '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}",
        "{%- if f['arguments'] is string %}{{- f['arguments'] }}",
        "{%- else %}{{- f['arguments'] | tojson }}{%- endif %}",
        "{{- '}\\n</tool_call>' }}",
        "{%- endfor %}",
        "{{- '<|im_end|>\\n' }}",
        "{%- else %}",
        "{{- '<|im_start|>' + m['role'] + '\\n' }}",
        "{%- if m['content'] is not none %}{{- m['content'] }}{%- endif %}",
        "{{- '<|im_end|>\\n' }}",
        "{%- endif %}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    ]
)
# Added after training, not special (as in Qwen's tokenizers): the hermes tool parser and the
# deepseek_r1/qwen3 reasoning parsers look these up in the vocabulary. Appended, so the BPE ids
# before them do not move.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

_WORDS = (  # noqa: SIM905 - a word list is easier to read as one string
    "the of and to in is was for on that with as by at from an be are have it not this which or "
    "prefill decode cache block token request model server router memory latency transfer remote "
    "local system user assistant tool call result function arguments name value error true false "
    "null conversation turn reuse retention lease expiry engine agent gateway registry"
).split()


def _corpus(seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    out = [" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(5, 40))) for _ in range(5000)]
    out += ["".join(rnd.choice(string.printable[:95]) for _ in range(200)) for _ in range(2000)]
    out += [
        json.dumps({rnd.choice(_WORDS): rnd.choice([rnd.randint(0, 999), rnd.choice(_WORDS), None])})
        for _ in range(1000)
    ]
    return out


# torch, tokenizers and transformers are imported where used: a no-op run (the model is already
# built) must not pay seconds for them. The vLLM venv has them; the main venv, where mypy runs, not.


def _build_tokenizer(size: ModelSize, out: Path) -> int:
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = size.max_position_embeddings
    hf_tok.save_pretrained(str(out))
    vocab: int = tok.get_vocab_size()
    return vocab


def _build_model(size: ModelSize, vocab: int, out: Path) -> int:
    import torch  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
    from transformers import (  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
    )

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
        torch_dtype="float32",
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out))
    params: int = sum(p.numel() for p in model.parameters())
    return params


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != STAMP_FILE):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def make_model(out: Path, size_name: str) -> dict[str, Any]:
    """Build the model into `out` (replacing what is there) unless it is already built."""
    if is_built(out, size_name):
        stamp: dict[str, Any] = json.loads((out / STAMP_FILE).read_text())
        print(f"{size_name}: already built in {out} ({stamp['params']:,} params)")
        return stamp
    size = SIZES[size_name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        vocab = _build_tokenizer(size, tmp)
        params = _build_model(size, vocab, tmp)
        stamp = {
            "size": size_name,
            "recipe_version": RECIPE_VERSION,
            "shape": size.__dict__,
            "params": params,
            "vocab": vocab,
            "sha256": _digest(tmp),
        }
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    print(f"{size_name}: {params:,} params, vocab {vocab} -> {out}")
    return stamp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args(argv)
    make_model(args.out, args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
