"""Write cluster/vllm_engine_args.txt: the installed vLLM's engine argument names (AsyncEngineArgs fields).

The topology checks `engine.extra` keys against this list without importing vLLM (seconds). Run after changing
the vLLM pin: `.venv/bin/python scripts/gen_vllm_engine_args.py` (`--check`: exit 1 if the file is stale).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "cluster" / "vllm_engine_args.txt"
HEADER = (
    "# vLLM's engine argument names (AsyncEngineArgs fields): topology engine.extra keys are checked\n"
    "# against them without importing vLLM. Made by scripts/gen_vllm_engine_args.py; do not edit.\n"
)


def render() -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs

    names = sorted(f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_"))
    return HEADER + "".join(f"{name}\n" for name in names)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(
                f"{OUT.name} is stale: run .venv/bin/python scripts/gen_vllm_engine_args.py", file=sys.stderr
            )
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
