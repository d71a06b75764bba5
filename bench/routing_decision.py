"""Latency of one routing decision: hash the prompt's blocks, look up every replica's cached prefix, choose P
and D. A prompt the router's intake encoded in full (a first turn, a text prompt re-tokenized) comes hashed
from the thread that tokenized it (router/intake/prompt.py): its hashing is timed apart ("intake hash") and
is not the decision's; a session's next turn built on the previous one hashes its new blocks in the
decision.

Setup: a KvIndex holding `--indexed-blocks` blocks (default 1M) spread over the replicas, built from
BlockStored-style calls (so the index is hashed exactly as in production); half the replicas are prefill, half
decode. Cases: a session's first turn (a new prompt sharing half of an indexed prompt: full hash of the
prompt) and its next turn (the previous prompt plus `--turn-tokens` new tokens: only the new blocks are
hashed). As in a live agent loop, the next turn's token ids come as the router's incremental chat encoder
gives them, or router/intake/token_sessions.py for a client sending ids (`--next-turn-ids`: both copy the
previous turn's ids and say so, `PromptReuse`), and the index has learned where the first turn's blocks were
stored (the engines' KV events) before it arrives (`--static-index` turns that off). Prints p50/p99 in
microseconds per case, wall clock and this thread's CPU time (on a shared machine the wall-clock tail is
dominated by the OS preempting the process; CPU time is the decision's own cost), the index's memory per
block, and the CPU of `SessionHasher.seal`, which the live router runs when a turn finishes (off the
decision's path) so that the next turn's prefix check is one tuple hash. `--readback`: KV readback on
(`pools.kv_readback_ttl_s`): the first turn's decode replica pins its KV, and the next turn's decision
includes finding what of its prompt the pin holds (`ReadbackTable.offer`), and with exports (on with readback)
every decode replica's cached prefix is a source a prefill replica could pull.

    .venv/bin/python -m bench.routing_decision [--replicas 8 32 128] [--prompt-tokens 8192 131072]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import numpy as np

from router.block_hash import SessionHasher, hash_blocks
from router.config import RouterConfig
from router.decision.readback import ReadbackTable
from router.messages import PromptReuse, RouteRequest
from router.policy.selector import PdservePolicy
from router.sessions import Sessions
from router.view.kv_index import KvIndex
from router.view.load import LoadTracker


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def build_index(
    n_replicas: int, indexed_blocks: int, block_size: int, prompt_tokens: int, rng: np.random.Generator
) -> tuple[KvIndex, list[list[int]], float]:
    """An index with `indexed_blocks` (replica, block) entries: whole prompts stored on one replica each."""
    index = KvIndex(block_size)
    docs: list[list[int]] = []
    blocks_per_doc = prompt_tokens // block_size
    gc.collect()
    before = _rss_bytes()
    stored = 0
    engine_hash = 1
    i = 0
    while stored < indexed_blocks:
        n = min(blocks_per_doc, indexed_blocks - stored)
        toks = rng.integers(0, 150_000, n * block_size).tolist()
        if len(docs) < 64:
            docs.append(toks)
        index.apply_stored(f"r{i % n_replicas}", list(range(engine_hash, engine_hash + n)), None, toks)
        engine_hash += n
        stored += n
        i += 1
        del toks
    gc.collect()
    return index, docs, (_rss_bytes() - before) / stored


def run_case(
    n_replicas: int,
    prompt_tokens: int,
    index: KvIndex,
    docs: list[list[int]],
    block_size: int,
    iters: int,
    turn_tokens: int,
    rng: np.random.Generator,
    next_turn_ids: str = "incremental",
    static_index: bool = False,
    readback: bool = False,
) -> dict[str, list[float]]:
    tracker = LoadTracker()
    n_pre = n_replicas // 2
    for r in range(n_replicas):
        tracker.add_replica(f"r{r}", "prefill" if r < n_pre else "decode", node_id=f"n{r // 8}")
    sessions = Sessions.of(RouterConfig())  # one session state for every part, as in the router
    policy = PdservePolicy(sessions=sessions)
    hasher = SessionHasher(block_size, sessions)
    pins = ReadbackTable(block_size=block_size, ttl_s=480, sessions=sessions) if readback else None
    next_engine_hash = 1 << 40  # above build_index's engine hashes
    out: dict[str, list[float]] = {
        "first": [],
        "next": [],
        "first_cpu": [],
        "next_cpu": [],
        "seal_cpu": [],
        "intake_hash_cpu": [],
    }
    for it in range(iters):
        doc = docs[it % len(docs)]
        shared = doc[: min(len(doc), prompt_tokens) // 2]
        prompt = shared + rng.integers(0, 150_000, prompt_tokens - len(shared)).tolist()
        turn2 = prompt + rng.integers(0, 150_000, turn_tokens).tolist()
        reuse = None
        if next_turn_ids == "incremental":
            # The live router's chat encoder reuses the previous turn's ids up to its generation prompt
            # (the last few ids, re-encoded) and encodes what follows: new int objects from there on. It
            # says so (PromptReuse), and the hasher takes its word instead of comparing.
            turn2 = prompt[:-3] + np.array(turn2[len(prompt) - 3 :]).tolist()
            reuse = PromptReuse(prompt, len(prompt) - 3)
        elif next_turn_ids == "retokenized":
            # Every id a new int object and no word on reuse: a text-prompt session tokenized in full, or ids
            # whose wire form does not extend the previous turn's. The hasher checks the prefix itself.
            turn2 = np.array(turn2).tolist()
        sid = f"s{it}"
        for toks, case in ((prompt, "first"), (turn2, "next")):
            hint = reuse if case == "next" else None
            hashed = None
            if hint is None and (case == "first" or next_turn_ids == "retokenized"):
                # Encoded in full: intake hashes it in its tokenizing thread (not the decision's time).
                c0 = time.thread_time()
                hashed = hash_blocks(toks, block_size)
                out["intake_hash_cpu"].append(time.thread_time() - c0)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            hashes = hasher.hash(sid, toks, hint, hashed)
            offer = None if pins is None else pins.offer(sid, toks, hint)
            req = RouteRequest(
                request_id=f"{sid}-{case}",
                session_id=sid,
                num_prompt_tokens=len(toks),
                block_hashes=hashes,
                block_size=block_size,
                max_tokens=256,
                readback=None if offer is None else offer.readback,
                export_ttl_s=None if pins is None else pins.ttl_s - pins.expiry_margin_s,
            )
            d = policy.choose(req, tracker.views("prefill"), tracker.views("decode"), index)
            out[case].append(time.perf_counter() - t0)
            out[case + "_cpu"].append(time.thread_time() - c0)
            tracker.on_dispatch(req, d)
            tracker.on_finish(req.request_id)
            if not static_index:
                # The engines' BlockStored events for this turn reach the index before the agent's next
                # turn (which waits for this reply): the prompt's blocks on the replica that computed it
                # and, after the KV transfer, on the decode replica.
                full = len(toks) // block_size
                for replica in {d.decode, d.prefill or d.decode}:
                    index.apply_stored(replica, range(next_engine_hash, next_engine_hash + full), None, toks)
                    next_engine_hash += full
            # What the live router does when the turn finishes (Decider.finish): not the decision's
            # cost, but CPU the router spends per turn, so it is reported beside it.
            c0 = time.thread_time()
            hasher.seal(sid)
            out["seal_cpu"].append(time.thread_time() - c0)
            if pins is not None and case == "first":
                # The decode engine pinned the turn: its prompt and 16 generated ids.
                output = rng.integers(0, 150_000, 16).tolist()
                held = len(toks) + len(output) - 1
                blocks = list(range(-(-held // block_size)))
                params = {"remote_block_ids": [blocks], "remote_num_tokens": held}
                pins.record(sid, d.decode, params, toks, output)
    return out


def _p50_p99(seconds: list[float]) -> str:
    p50, p99 = np.percentile(np.array(seconds) * 1e6, [50, 99])
    return f"{p50:>10.0f} {p99:>10.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 131072])
    ap.add_argument("--indexed-blocks", type=int, default=1_000_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument(
        "--next-turn-ids",
        choices=["incremental", "retokenized", "same"],
        default="incremental",
        help="the next turn's token ids: the previous turn's objects with a reuse hint, as the incremental "
        "chat encoder and token-id sessions give them (default); all new int objects with no hint (a text "
        "prompt tokenized in full); or the previous turn's list extended",
    )
    ap.add_argument(
        "--static-index",
        action="store_true",
        help="do not index what each turn stored (default: the index learns it, as from the engines' KV "
        "events, before the next turn)",
    )
    ap.add_argument(
        "--readback", action="store_true", help="KV readback on: the next turn also looks up its pinned KV"
    )
    ap.add_argument(
        "--iters", type=int, default=300, help="per case for 8k prompts (scaled down for longer ones)"
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"block_size={args.block_size} indexed_blocks={args.indexed_blocks:,}; replicas split half prefill, "
        "half decode; microseconds per decision (hash + lookup + views + choose; a prompt encoded in full "
        "comes hashed by intake, timed apart)"
    )
    cols = ["first p50", "first p99", "next p50", "next p99"]
    print(
        f"{'replicas':>8} {'prompt':>7} {'idx B/blk':>9} "
        + " ".join(f"{c:>10}" for c in cols)
        + " | CPU "
        + " ".join(f"{c:>10}" for c in cols)
        + " | seal p50 | intake hash p50"
    )
    for n in args.replicas:
        for pt in args.prompt_tokens:
            index, docs, per_block = build_index(n, args.indexed_blocks, args.block_size, pt, rng)
            iters = max(20, args.iters * 8192 // pt)
            gc.collect()
            gc.disable()  # a GC pause triggered by the benchmark's own garbage is not the router's cost
            try:
                res = run_case(
                    n,
                    pt,
                    index,
                    docs,
                    args.block_size,
                    iters,
                    args.turn_tokens,
                    rng,
                    args.next_turn_ids,
                    args.static_index,
                    args.readback,
                )
            finally:
                gc.enable()

            cells = " ".join(_p50_p99(res[k]) for k in ("first", "next"))
            cpu = " ".join(_p50_p99(res[k]) for k in ("first_cpu", "next_cpu"))
            seal, intake = (
                np.percentile(np.array(res[k]) * 1e6, 50) for k in ("seal_cpu", "intake_hash_cpu")
            )
            print(
                f"{n:>8} {pt:>7} {per_block:>9.0f} {cells} | CPU {cpu} | {seal:>8.0f} | {intake:>15.0f}",
                flush=True,
            )
            del index, docs
            gc.collect()


if __name__ == "__main__":
    main()
