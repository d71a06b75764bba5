"""PromptTokenizer: the token ids the router sends to engines, and proto chat input -> template dicts."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from router.intake.tokenizer import ChatInputError, PromptTokenizer, message_dicts, tool_dicts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def weather_conversation() -> tuple[list[pb.ChatMessage], list[pb.Tool]]:
    messages = [
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments_json='{"city": "Oslo"}')],
        ),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="-3 C, snow"),
    ]
    tools = [
        pb.Tool(
            name="get_weather",
            description="Weather now",
            parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}}',
        )
    ]
    return messages, tools


def test_text_gets_no_special_tokens_and_round_trips(tokenizer: PromptTokenizer) -> None:
    text = "The quick brown fox, in Python: print('hi')"
    ids = tokenizer.encode_text(text)
    # The tiny model's tokenizer adds no BOS/EOS by default.
    assert 0 not in ids and 1 not in ids and 2 not in ids
    assert tokenizer.decode(ids) == text


def test_vocab_and_eos(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.vocab_size == 2048
    assert tokenizer.eos_token_id == 0


def test_decode_drops_special_tokens_unless_asked(tokenizer: PromptTokenizer) -> None:
    ids = [1, *tokenizer.encode_text("user"), 2]
    assert tokenizer.decode(ids) == "user"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


def test_proto_messages_become_template_dicts() -> None:
    messages, tools = weather_conversation()
    assert message_dicts(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "-3 C, snow", "tool_call_id": "c1"},
    ]
    assert tool_dicts(tools) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]


def test_empty_json_means_no_arguments() -> None:
    [tool] = tool_dicts([pb.Tool(name="now")])
    assert tool["function"]["parameters"] == {"type": "object", "properties": {}}
    [message] = message_dicts(
        [pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="a", name="now")])]
    )
    assert message["tool_calls"][0]["function"]["arguments"] == {}


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (
            [
                pb.ChatMessage(role="user", content="x"),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments_json="{oops")]),
            ],
            "messages[1].tool_calls[0].arguments_json",
        ),
        (
            [pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments_json="[1, 2]")])],
            "messages[0].tool_calls[0].arguments_json",
        ),
    ],
)
def test_bad_tool_call_arguments_name_the_field(messages: list[pb.ChatMessage], field: str) -> None:
    with pytest.raises(ChatInputError) as info:
        message_dicts(messages)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([pb.Tool(name="f"), pb.Tool(name="g", parameters_json='"str"')], "tools[1].parameters_json"),
        ([pb.Tool(name="f"), pb.Tool(name="g", parameters_json="{")], "tools[1].parameters_json"),
        ([pb.Tool(description="nameless")], "tools[0].name"),
    ],
)
def test_bad_tools_name_the_field(tools: list[pb.Tool], field: str) -> None:
    with pytest.raises(ChatInputError) as info:
        tool_dicts(tools)
    assert info.value.field == field


def test_chat_is_the_rendered_template_encoded_without_extra_tokens(tokenizer: PromptTokenizer) -> None:
    messages, tools = weather_conversation()
    chat, tool_defs = message_dicts(messages), tool_dicts(tools)
    text = tokenizer.render_chat(chat, tool_defs)
    assert '<tool_call>{"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert '"description": "Weather now"' in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode_chat(chat, tool_defs)
    assert ids[0] == 1  # <|im_start|>: no BOS in front of the template's own tokens
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_without_tools(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}], None)
    assert (
        tokenizer.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_concurrent_calls_match_serial_results(tokenizer: PromptTokenizer) -> None:
    texts = [f"request {i}: " + "agents call tools and read results. " * (i % 7 + 1) for i in range(64)]
    serial = [tokenizer.encode_text(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(tokenizer.encode_text, texts))
        chats = list(pool.map(lambda t: tokenizer.encode_chat([{"role": "user", "content": t}]), texts))
    assert parallel == serial
    assert all(chat[3 : 3 + len(ids)] == ids for chat, ids in zip(chats, serial, strict=True))


def test_a_prompt_being_tokenized_holds_up_no_other(tmp_path: Path) -> None:
    """One copy busy (a long prompt in another thread): a short prompt is encoded at once on another; with
    every copy busy, it waits for the first to come free."""
    tokenizer = PromptTokenizer(ensure_tiny_model(tmp_path), copies=2)
    release = threading.Event()
    held = threading.Event()

    def long_prompt() -> None:
        with tokenizer._instance():
            held.set()
            release.wait(10)

    with ThreadPoolExecutor(max_workers=3) as pool:
        busy = pool.submit(long_prompt)
        assert held.wait(10)
        short = tokenizer.encode_text("a short prompt")  # returns while the long one holds its copy
        held.clear()
        busy_too = pool.submit(long_prompt)
        assert held.wait(10)  # now both copies are held
        waiting = pool.submit(tokenizer.encode_text, "a short prompt")
        with pytest.raises(TimeoutError):
            waiting.result(timeout=0.3)
        release.set()
        assert waiting.result(timeout=10) == short
        busy.result(timeout=10)
        busy_too.result(timeout=10)


def test_model_dir_is_never_fetched_from_the_hub(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        PromptTokenizer(tmp_path / "no-such-model")


def test_template_variables_reach_the_chat_template(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.render_chat(messages)
    no_thinking = tokenizer.render_chat(messages, None, {"enable_thinking": False})
    assert plain.endswith("<|im_start|>assistant\n")
    assert no_thinking == plain + "<think>\n\n</think>\n\n"
    assert tokenizer.render_chat(messages, None, {"enable_thinking": True}) == plain


def test_the_tokenizer_runs_model_code_only_when_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    seen: list[dict[str, object]] = []
    load = transformers.AutoTokenizer.from_pretrained

    def spy(path: str, **kwargs: object) -> object:
        seen.append(kwargs)
        return load(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    PromptTokenizer(ensure_tiny_model())
    PromptTokenizer(ensure_tiny_model(), trust_remote_code=True)
    # Every copy is loaded the same way: the first tokenizer never trusts, the second always does.
    copies = len(seen) // 2
    assert [k["trust_remote_code"] for k in seen] == [False] * copies + [True] * copies
    assert all(k["local_files_only"] is True for k in seen)  # never the hub


# Texts a bound must hold for: words, runs of one byte, multi-byte scripts, the model's special tokens.
BOUND_TEXTS = st.lists(
    st.sampled_from(
        ["a", "b", " ", "\n", "\t", "é", "中", "🙂", "<|im_start|>", "<|im_end|>", "0", ".", "word "]
    ),
    max_size=400,
).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=BOUND_TEXTS)
def test_the_fewest_tokens_bound_never_exceeds_the_real_count(tokenizer: PromptTokenizer, text: str) -> None:
    fewest = tokenizer.fewest_tokens(text)
    assert fewest is not None
    assert fewest <= len(tokenizer.encode_text(text))
    assert fewest <= len(tokenizer.encode_rendered(text))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=BOUND_TEXTS)
def test_the_bound_from_a_texts_utf8_length_never_exceeds_the_real_count(
    tokenizer: PromptTokenizer, text: str
) -> None:
    """What a request's wire bytes give before they are parsed (router/intake/wire_size.py)."""
    size = len(text.encode())
    fewest = tokenizer.fewest_tokens_in_utf8(size, ascii=False)
    assert fewest is not None and fewest <= len(tokenizer.encode_text(text))
    if text.isascii():
        exact = tokenizer.fewest_tokens_in_utf8(size, ascii=True)
        assert exact == tokenizer.fewest_tokens(text) and exact is not None and exact >= fewest


def test_the_bound_of_a_long_repetitive_prompt_is_far_over_a_small_context(
    tokenizer: PromptTokenizer,
) -> None:
    # What lets an over-long prompt be refused before it is tokenized: a 1 MB text is over 2048 tokens.
    fewest = tokenizer.fewest_tokens("word " * 200_000)
    assert fewest is not None and 2048 < fewest <= len(tokenizer.encode_text("word " * 200_000))


def test_a_tokenizer_whose_normalizer_folds_text_gives_no_bound(tmp_path: Path) -> None:
    """NFKC folds three-byte fullwidth letters into one, and lowercasing or whitespace splitting lose input:
    a bound from the input's length could then under-count, so none is given."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], unk_token="[UNK]"))
    backend.normalizer = normalizers.NFKC()
    folded = PreTrainedTokenizerFast(tokenizer_object=backend)
    folded.save_pretrained(tmp_path / "nfkc")
    assert (
        PromptTokenizer(tmp_path / "nfkc").fewest_tokens("\uff41" * 3) is None
    )  # fullwidth a: NFKC folds it to "a"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path / "ws")
    assert PromptTokenizer(tmp_path / "ws").fewest_tokens("a a") is None
