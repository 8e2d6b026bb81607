"""`make up`'s module without vLLM: what it checks before a minute of start-up (MODEL=, the
gateway's port), the router profile it derives for a model, and what it prints once ready. The
whole thing on real vLLM is tests/e2e/test_up.py."""

from __future__ import annotations

import json
import re
import signal
import socket
from pathlib import Path

import pytest
from deploy.local.processes import free_ports
from deploy.profiles.schema import engine_profile_from_dict
from deploy.up import banner, check_model_dir, engine_profile, main, max_model_len, status_command

from kvshuttle.router.cost import profile_from_dict

CONFIG = {
    "model_type": "llama",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def hf_dir(tmp_path: Path, *, skip: str = "") -> Path:
    model = tmp_path / "my-model"
    model.mkdir()
    files = {
        "config.json": json.dumps(CONFIG),
        "tokenizer.json": "{}",
        "model.safetensors": "",
    }
    for name, text in files.items():
        if name != skip:
            (model / name).write_text(text)
    return model


def test_a_hugging_face_directory_is_accepted_and_what_it_lacks_is_named(tmp_path: Path) -> None:
    assert check_model_dir(hf_dir(tmp_path)) == (tmp_path / "my-model").resolve()
    for missing, named in (
        ("config.json", "missing config.json ("),
        ("tokenizer.json", "missing a tokenizer (tokenizer.json or tokenizer.model or vocab.json)"),
        ("model.safetensors", "missing weights (*.safetensors)"),
    ):
        other = tmp_path / missing
        other.mkdir()
        with pytest.raises(ValueError, match=re.escape(named)):
            check_model_dir(hf_dir(other, skip=missing))
    with pytest.raises(ValueError, match="not a directory"):
        check_model_dir(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    broken = hf_dir(tmp_path / "broken")
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json lacks"):
        check_model_dir(broken)


def test_the_profile_and_context_follow_the_model(tmp_path: Path) -> None:
    model = hf_dir(tmp_path)
    profile = engine_profile(model, "my-model", kv_cache_gib=1)
    # float32 as the launcher runs it: 4 layers x 2 KV heads x 64 x (K, V) x 4 bytes.
    assert profile["kv_bytes_per_token"] == 4 * 2 * 64 * 2 * 4
    assert profile["engine"]["kv_capacity_tokens"] == 2**30 // 4096
    parsed = profile_from_dict(profile)  # as the router reads it
    assert (parsed.model, parsed.kv_bytes_per_token) == ("my-model", 4096)
    engine_profile_from_dict(profile)  # and a whole engine profile still
    assert max_model_len(model) == 4096  # the model's positions end before the demo's 8192


def test_a_bad_model_or_a_taken_port_fails_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_ports(1)[0]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert main(["--model", str(tmp_path), "--gateway-port", str(port), "--run-dir", str(tmp_path)]) == 2
    # The caller's signal handlers are its own again (here: pytest's process).
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    assert "missing config.json, a tokenizer" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        argv = ["--model", str(hf_dir(tmp_path)), "--gateway-port", str(port), "--run-dir", str(tmp_path)]
        assert main(argv) == 2
    assert f"127.0.0.1:{port} is taken" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["--tool-call-parser", "nonesuch", "--run-dir", str(tmp_path)])
    assert usage.value.code == 2
    assert "--tool-call-parser 'nonesuch': choose from" in capsys.readouterr().err
    assert not (tmp_path / "vllm").exists()  # nothing started


def test_the_banner_says_where_everything_is(tmp_path: Path) -> None:
    info = {
        "openai_base_url": "http://127.0.0.1:8080/v1",
        "model": "m",
        "model_dir": "/models/m",
        "registry": "127.0.0.1:1234",
        "registry_store": "memory",
        "router": "127.0.0.1:1235",
        "metrics": {"gateway": "127.0.0.1:1236", "router": "127.0.0.1:1237"},
        "admin_token_file": "/run/tokens/admin.token",
        "logs": "/run",
    }
    text = banner(info)
    assert "  OpenAI base URL   http://127.0.0.1:8080/v1" in text
    assert "http://127.0.0.1:1236/metrics   (gateway)" in text
    curl = next(line for line in text.splitlines() if line.strip().startswith("curl "))
    body = json.loads(curl.split(" -d ", 1)[1].strip("'"))
    assert body["conversation_id"] == "my-first-chat" and body["model"] == "m"
    lines = text.splitlines()
    start = lines.index("  from openai import OpenAI")
    snippet = [line.strip() for line in lines[start : start + 5]]
    assert 'extra_body={"conversation_id": "my-first-chat"}' in snippet[3]
    compile("\n".join(snippet), "snippet", "exec")  # five lines of valid Python
    assert status_command(info) in text
    assert status_command(info).split()[:2] == ["kvshuttle", "status"]
