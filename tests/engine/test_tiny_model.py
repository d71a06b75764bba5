"""The built-in tiny model: deterministic, offline, loadable by transformers, with a working chat template."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoTokenizer

from engine.tiny_model import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    TINY_MODEL_NAME,
    default_max_model_len,
    ensure_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    other = ensure_tiny_model(tmp_path)
    assert other.name == model_dir.name
    files = sorted(p.name for p in model_dir.iterdir())
    assert files == sorted(p.name for p in other.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(files)
    for name in files:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_existing_build_is_reused_and_leaves_no_temp_dirs(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        built = list(pool.map(lambda _: ensure_tiny_model(tmp_path), range(3)))
    assert len(set(built)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]
    assert AutoConfig.from_pretrained(built[0]).vocab_size == 2048


def test_directory_without_matching_spec_is_rebuilt(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model(tmp_path)
    (model_dir / "pdserve_tiny_model.json").write_text('{"spec_hash": "stale"}')
    (model_dir / "model.safetensors").write_bytes(b"garbage")
    assert ensure_tiny_model(tmp_path) == model_dir
    assert load_file(str(model_dir / "model.safetensors"))["lm_head.weight"].shape == (2048, 128)


def test_cache_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    model_dir = ensure_tiny_model()
    assert model_dir.parent == tmp_path
    assert model_dir.name.startswith(TINY_MODEL_NAME + "-")


def test_config_loads_as_llama(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 2, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 64)
    assert config.max_position_embeddings >= default_max_model_len() == 2048
    assert config.tie_word_embeddings is False
    assert str(config.dtype) == "torch.float32"


def test_weights_have_llama_names_shapes_and_scale(model_dir: Path) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (2048, 128)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (128, 128)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert (weights["model.norm.weight"] == 1.0).all()
    assert len(weights) == 2 + 1 + 2 * 9
    assert all(w.dtype.name == "float32" for w in weights.values())
    assert 0.015 < float(weights["model.layers.0.mlp.gate_proj.weight"].std()) < 0.025


def test_tokenizer_round_trips_text_offline(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == 2048
    text = "Hello, world! def f(x):\n    return {'ünïcode': x * 2}  # 日本語 🙂"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Common words from the training corpus are single tokens: the tokenizer really was trained.
    assert len(tokenizer.encode(" the")) == 1
    assert len(ids) < len(text.encode())
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.convert_tokens_to_ids([EOS_TOKEN, IM_START, IM_END]) == [0, 1, 2]


def test_chat_template_renders_tools_calls_and_results(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Berlin?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Berlin"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '{"name": "get_weather", "description": "Current weather in a city"' in text
    assert "<|im_start|>user\nWeather in Berlin?<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"id": "call_1", "name": "get_weather", '
        '"arguments": {"city": "Berlin"}}</tool_call><|im_end|>\n'
    ) in text
    assert (
        '<|im_start|>tool\n<tool_response id="call_1">\n{"temp_c": 21}\n</tool_response><|im_end|>\n' in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    # Special tokens in the rendered text become their single ids.
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4


def test_chat_template_without_tools_or_generation_prompt(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"


def test_generation_config_stops_at_end_of_turn(model_dir: Path) -> None:
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]
