"""`python -m bench.speculation_effect`: the H200 example as deployed (EAGLE-3, fp8 KV) against the same
without speculation and with a bf16 KV cache, by the service-time model and the replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.speculation_effect import H200_EXAMPLE, main, modelled, variants
from cluster.topology_file import load_topology, parse_topology


def test_the_variants_differ_only_in_the_kv_dtype_and_the_speculation() -> None:
    topo = load_topology(H200_EXAMPLE)
    bf16, fp8, deployed = variants(topo).values()
    assert deployed == topo.router.service_time  # the example as written
    assert bf16.model.kv_bytes_per_token == 2 * fp8.model.kv_bytes_per_token == 2 * 35136
    assert (bf16.speculation, fp8.speculation) == (None, None) and deployed.speculation is not None
    rows = [modelled(name, s, context=100_000) for name, s in variants(topo).items()]
    # Half the bytes a token: twice the tokens a replica holds, half the transfer's per-token time.
    assert rows[1].kv_capacity_tokens == pytest.approx(2 * rows[0].kv_capacity_tokens)
    assert rows[1].sessions_held > rows[0].sessions_held and rows[1].transfer_32k_s < rows[0].transfer_32k_s
    # Speculation at the example's acceptance: less time per output token, one session or a full batch.
    assert rows[2].tpot_one_s < rows[1].tpot_one_s and rows[2].tpot_full_s < rows[1].tpot_full_s


def test_a_measured_engine_is_refused_it_compares_modelled_hardware() -> None:
    topo = parse_topology(
        "router: {service_time: {measured: {prefill_fixed_s: 0, prefill_token_s: 0, prefill_pair_s: 0,"
        " decode_step_s: 0, decode_seq_s: 0, decode_context_token_s: 0, transfer_fixed_s: 0,"
        " transfer_token_s: 0}}}"
    )
    with pytest.raises(ValueError, match="measured engine"):
        variants(topo)


def test_it_prints_the_models_table_and_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "effect.json"
    assert main(["--no-replay", "--sessions", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp8 KV + speculation (3 drafts)" in text and "sessions" in text
    report = json.loads(out.read_text())
    assert len(report["variants"]) == 3 and report["context_tokens"] > 0
