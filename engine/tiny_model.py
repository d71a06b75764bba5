"""pdserve's built-in model: a tiny random-weight Llama, built offline and deterministically.

Tests and local topologies need a real model that vLLM (CPU) and transformers load, without any hub
access. This module writes one from scratch: a Llama-architecture config, float32 weights drawn from a
seeded numpy Generator (saved with `safetensors.numpy`, so building needs no torch), and a real Hugging
Face fast tokenizer (byte-level BPE trained on a corpus embedded below) with a ChatML chat template that
renders tools, tool calls and tool results.

The same spec always gives byte-identical files. The model directory is named after a hash of its spec
and built once per cache directory: in a temporary directory first, then renamed into place, so a reader
never sees a half-written model and concurrent builders agree on the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

TINY_MODEL_NAME = "tiny-llama"
"""The served model name of the built-in model."""

_MAX_MODEL_LEN = 2048
# Bump when the build's output changes in a way the spec below does not capture.
_BUILD_FORMAT = 1
_SPEC_FILE = "pdserve_tiny_model.json"
_SEED = 20240607
_WEIGHT_STD = 0.02

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trained first, so they get ids 0, 1, 2 in this order.
_SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

_ARCH: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# ChatML, with tools in the system block and tool calls as JSON inside <tool_call> tags (Qwen/Hermes style);
# as Qwen3's, `enable_thinking=False` (a chat_template_kwargs variable) closes an empty think block.
# Tool-call arguments may be a dict (rendered as JSON) or already-encoded JSON text.
CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools %}
{%- if system_message %}{{- '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are inside <tools></tools>:' }}
{{- '\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool.function if tool.function is defined else tool) | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, answer with ' }}
{{- '<tool_call>{"name": <name>, "arguments": <args>}</tool_call>.' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>tool\\n<tool_response id="' + message.tool_call_id + '">\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>{"id": ' + (tool_call.id or '') | tojson }}
{{- ', "name": ' + call.name | tojson + ', "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# The tokenizer's training text: varied English prose, code, JSON, shell and chat-like turns, so that
# common words, identifiers and punctuation get their own tokens and prompts tokenize compactly.
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village between the mountains and the sea, there lived a baker who rose
every morning before the sun. She baked bread for the fishermen, cakes for the children, and pies for
the travellers who passed through on their way to the city. People said her kitchen smelled of cinnamon,
butter and warm apples, and that nobody ever left her shop hungry or unhappy.

Science is a way of thinking much more than it is a body of knowledge. We observe the world, form a
hypothesis, design an experiment, collect data and then ask whether the evidence supports the idea.
Good experiments control for confounding variables; good scientists report their uncertainty honestly.
Water boils at 100 degrees Celsius at sea level, but at a lower temperature on a high mountain, because
the air pressure is lower. Light travels at about 299,792 kilometres per second. The Earth orbits the
Sun once every 365.25 days, and the Moon orbits the Earth roughly every 27 days.

History teaches us that cities grow near rivers, that trade connects distant people, and that new tools
change how we work. The printing press spread books across Europe; the steam engine powered factories;
the telephone, the radio and the internet made it possible to talk to anyone, anywhere, at any time.

Weather report: cloudy in the morning with a chance of light rain in the afternoon. Temperatures between
12 and 18 degrees. Wind from the north-west at 20 km/h. Tomorrow will be sunny and warmer, with highs
near 24 degrees. Remember to bring an umbrella if you are going out this evening.

Dear team, thank you for your hard work this quarter. We shipped the new release on time, fixed more
than two hundred bugs, and reduced the average response time of our service by forty percent. Please
review the attached report before Friday's meeting, and send me any questions or comments you have.
Best regards, Maria.

Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
Q: Who wrote "Pride and Prejudice"? A: Jane Austen. Q: What is the largest planet in our solar system?
A: Jupiter. Q: What is the square root of 144? A: 12. Q: Which ocean is the deepest? A: The Pacific.

The user asked the assistant to search the web, read a file, and summarize the results. The assistant
called the search tool with a query, waited for the tool result, then answered with a short summary.
When a tool call fails, the assistant should explain the error and try a different approach. Agents
plan a task, call tools, observe the results, and repeat until the goal is reached or they give up.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, item: int) -> None:
        self.items.append(item)

    def pop(self) -> int:
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def __len__(self) -> int:
        return len(self.items)


async def fetch_all(urls: list[str], timeout: float = 10.0) -> dict[str, str]:
    results = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for url in urls:
            response = await client.get(url)
            response.raise_for_status()
            results[url] = response.text
    return results


import json
import os
from pathlib import Path

config_path = Path(os.environ.get("CONFIG", "config.json"))
with open(config_path, encoding="utf-8") as f:
    config = json.load(f)
print(f"loaded {len(config)} keys from {config_path}")
if config.get("debug", False):
    print("debug mode is on")

function add(a, b) {
  return a + b;
}

const users = [{ id: 1, name: "Alice" }, { id: 2, name: "Bob" }];
for (const user of users) {
  console.log(`Hello, ${user.name}!`);
}

fn main() {
    let numbers = vec![1, 2, 3, 4, 5];
    let total: i32 = numbers.iter().sum();
    println!("The total is {}", total);
}

SELECT id, name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;
INSERT INTO orders (user_id, product_id, quantity) VALUES (42, 7, 3);

$ git status
$ git commit -m "Fix the bug in the parser"
$ ls -la /home/user/projects
$ pip install -e .
$ python -m pytest tests/ -x -q
$ curl -s http://localhost:8080/health | jq .
$ docker run --rm -it -p 8000:8000 server:latest

{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
{"name": "search_web", "arguments": {"query": "latest news about renewable energy", "max_results": 5}}
{"name": "read_file", "arguments": {"path": "/tmp/data.csv"}}
{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",
 "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
 "required": ["expression"]}}}
{"id": "call_0", "status": "ok", "result": {"temperature": 21.5, "humidity": 0.64, "conditions": "sunny"}}
{"error": {"code": 404, "message": "file not found"}}

# Installation

1. Clone the repository.
2. Create a virtual environment: `python -m venv .venv`.
3. Install the dependencies with `pip install -r requirements.txt`.
4. Run the tests to check that everything works.

## Usage

Start the server with `serve --port 8000` and send a request. The response contains the generated text,
the number of tokens used, and the time it took. See the documentation for all options.

| name  | type   | default | description                  |
|-------|--------|---------|------------------------------|
| port  | int    | 8000    | the port to listen on        |
| host  | string | 0.0.0.0 | the address to bind          |
| debug | bool   | false   | print verbose log messages   |

Error: connection refused. Retrying in 5 seconds... Warning: the cache is almost full (93% used).
INFO 2024-05-17 10:32:01 server started on port 8000
ERROR 2024-05-17 10:32:07 request 7f3a failed: timeout after 30.0s

A recipe for tomato soup: chop two onions and three cloves of garlic, fry them gently in olive oil,
add one kilogram of ripe tomatoes, a litre of vegetable stock, salt and pepper, and simmer for thirty
minutes. Blend until smooth, stir in a little cream, and serve with fresh basil and crusty bread.

Mathematics: if x + 3 = 7 then x = 4. The area of a circle is pi times the radius squared. The sum of
the angles in a triangle is 180 degrees. A prime number has exactly two divisors: 1 and itself. The
first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31 and 37. One plus one equals two; ten times ten
equals one hundred; half of fifty is twenty-five.

Sports news: the home team won the final three to one after a dramatic second half. Their captain
scored twice and was named player of the match. Fans celebrated in the streets until late at night.
In tennis, the champion defended her title in straight sets; in cycling, the race was decided in the
mountains on the last stage.

The meeting is scheduled for Monday at 9:30 in room 204. Agenda: budget review, hiring plan, product
roadmap, and any other business. Please confirm your attendance by replying to this email. If you
cannot attend, let me know who will represent your group.

Travel tips: book your train tickets early, carry a copy of your passport, learn a few words of the
local language, and always try the street food. Museums are often free on the first Sunday of the
month. Keep some cash for small shops and markets, and drink plenty of water on hot days.

Why is the sky blue? Sunlight contains all the colours of the rainbow. When it passes through the
atmosphere, the short blue wavelengths scatter much more than the long red ones, so blue light reaches
our eyes from every direction of the sky. At sunset the light travels through more air, the blue is
scattered away, and the sky turns orange and red.

Machine learning models learn patterns from examples. A language model predicts the next token given
the previous tokens; a tokenizer splits text into those tokens. Training minimizes a loss function by
gradient descent; inference runs the trained model on new inputs. Large models need many GPUs, fast
memory and careful batching to serve many users with low latency and high throughput.

Philosophy asks questions that may have no final answers: what can we know, how should we live, what
makes an action right or wrong? Socrates said that the unexamined life is not worth living. Many people
find meaning in friendship, in work that matters to others, and in learning something new every day.
"""


def default_max_model_len() -> int:
    """The context length pdserve serves the tiny model with (the config allows more)."""
    return _MAX_MODEL_LEN


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$PDSERVE_CACHE_DIR, else ~/.cache/pdserve: of this process's environment, or of `env`."""
    env = os.environ if env is None else env
    if configured := env.get("PDSERVE_CACHE_DIR"):
        return Path(configured)
    return (Path(env["HOME"]) if env.get("HOME") else Path.home()) / ".cache" / "pdserve"


def spec_hash() -> str:
    """Hash of everything that determines the model's files; it names the model directory."""
    spec = {
        "format": _BUILD_FORMAT,
        "seed": _SEED,
        "weight_std": _WEIGHT_STD,
        "arch": _ARCH,
        "special_tokens": _SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "corpus": _CORPUS,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the tiny model's directory under `cache_dir`, building it first if it is not there yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = spec_hash()
    model_dir = root / f"{TINY_MODEL_NAME}-{digest[:12]}"
    if _is_complete(model_dir, digest):
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=root))
    try:
        _build(staging, digest)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is for every process of this user.
        try:
            staging.rename(model_dir)
        except OSError:
            # The name is taken. By another process's identical build: use it. Otherwise by a directory
            # without the matching spec file (an interrupted copy, a hand edit): replace it.
            if not _is_complete(model_dir, digest):
                shutil.rmtree(model_dir)
                staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def _is_complete(model_dir: Path, digest: str) -> bool:
    spec_file = model_dir / _SPEC_FILE
    if not spec_file.is_file():
        return False
    return bool(json.loads(spec_file.read_text()).get("spec_hash") == digest)


def _build(out: Path, digest: str) -> None:
    tokenizer_ids = _save_tokenizer(out)
    _write_json(out / "config.json", _config(tokenizer_ids))
    _write_json(out / "generation_config.json", _generation_config(tokenizer_ids))
    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    # Written last: its presence marks a complete build.
    _write_json(out / _SPEC_FILE, {"name": TINY_MODEL_NAME, "spec_hash": digest})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(out: Path) -> dict[str, int]:
    """Train the byte-level BPE tokenizer, save it as a transformers fast tokenizer; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_ARCH["vocab_size"],
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=_MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    ids = {token: backend.token_to_id(token) for token in _SPECIAL_TOKENS}
    if list(ids.values()) != list(range(len(_SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got unexpected ids: {ids}")
    return {token: i for i, token in enumerate(_SPECIAL_TOKENS)}


def _config(special_ids: dict[str, int]) -> dict[str, Any]:
    eos = special_ids[EOS_TOKEN]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": _ARCH["vocab_size"],
        "hidden_size": _ARCH["hidden_size"],
        "intermediate_size": _ARCH["intermediate_size"],
        "num_hidden_layers": _ARCH["num_hidden_layers"],
        "num_attention_heads": _ARCH["num_attention_heads"],
        "num_key_value_heads": _ARCH["num_key_value_heads"],
        "head_dim": _ARCH["head_dim"],
        "max_position_embeddings": _ARCH["max_position_embeddings"],
        "rms_norm_eps": _ARCH["rms_norm_eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": _ARCH["rope_theta"]},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "initializer_range": _WEIGHT_STD,
        "use_cache": True,
    }


def _generation_config(special_ids: dict[str, int]) -> dict[str, Any]:
    # Chat turns end with <|im_end|>: list it as an EOS so generation stops at the end of a turn.
    return {
        "bos_token_id": special_ids[EOS_TOKEN],
        "eos_token_id": [special_ids[EOS_TOKEN], special_ids[IM_END]],
        "pad_token_id": special_ids[EOS_TOKEN],
        "do_sample": False,
    }


def _weights() -> dict[str, np.ndarray]:
    """HF Llama parameter names and shapes; Gaussian weights, RMSNorm scales of one."""
    hidden = _ARCH["hidden_size"]
    inter = _ARCH["intermediate_size"]
    q_dim = _ARCH["num_attention_heads"] * _ARCH["head_dim"]
    kv_dim = _ARCH["num_key_value_heads"] * _ARCH["head_dim"]
    shapes: dict[str, tuple[int, int]] = {"model.embed_tokens.weight": (_ARCH["vocab_size"], hidden)}
    norms = ["model.norm.weight"]
    for layer in range(_ARCH["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        }
        norms += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
    shapes["lm_head.weight"] = (_ARCH["vocab_size"], hidden)

    rng = np.random.default_rng(_SEED)
    # Drawn in a fixed (insertion) order, so every build draws the same numbers for the same name.
    weights = {
        name: (rng.standard_normal(shape, dtype=np.float32) * np.float32(_WEIGHT_STD))
        for name, shape in shapes.items()
    }
    weights |= {name: np.ones(hidden, dtype=np.float32) for name in norms}
    return weights
