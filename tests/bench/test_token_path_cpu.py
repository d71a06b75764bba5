"""bench.token_path_cpu: which processes count as the token path, and the CPU they spent between readings."""

from __future__ import annotations

import pytest

from bench.token_path_cpu import kind, spent


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ("ray::ServeReplica:pdserve:router", "token"),
        ("/venv/bin/python /venv/bin/pdserve up -f /tmp/t.yaml", "token"),  # the router of an older REV
        ("ray::ServeReplica:pdserve:decode", "token"),
        ("ray::ServeReplica:pdserve:prefill", "token"),
        ("/venv/bin/python -m vllm.entrypoints.openai.api_server --config v.yaml", "token"),
        ("VLLM::EngineCore", "engine"),
        ("ray::ServeReplica:pdserve:registry", "daemon"),
        ("ray::ServeController", "daemon"),
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --port=1", "daemon"),
        ("/usr/bin/bash", None),
    ],
)
def test_processes_are_told_apart_by_their_command_line(cmdline: str, expected: str | None) -> None:
    assert kind(cmdline) == expected


def test_cpu_spent_is_the_difference_per_kind_and_a_new_process_counts_from_zero() -> None:
    before = {("token", 1): 2.0, ("engine", 2): 10.0}
    after = {("token", 1): 5.0, ("engine", 2): 12.5, ("token", 3): 0.25, ("daemon", 4): 1.0}
    assert spent(before, after) == {"token": 3.25, "engine": 2.5, "daemon": 1.0}


def test_the_workload_is_pdserve_benchs_own_arguments_completed_as_its_main_does() -> None:
    from bench.token_path_cpu import _bench_args

    args = _bench_args(["--mode", "concurrency", "--concurrency", "4", "--num-requests", "8"])
    assert args.token is None and args.concurrency == 4 and args.num_requests == 8
    assert args.slo.ttft_s > 0  # the default SLO, as a struct (pdserve bench's main turns it into one too)


def test_ratios_compare_each_system_with_the_base_in_the_same_round() -> None:
    from bench.token_path_cpu import Ratio, by_system, median_ratio, ratios

    # (round, system, clients, tokens streamed, tokens/s, token-path CPU s); round 1 runs in reverse order.
    rows = [
        (0, "pd", 16, 1000.0, 200.0, 2.0),
        (0, "vllm", 16, 1000.0, 100.0, 1.0),
        (1, "vllm", 16, 1000.0, 50.0, 2.0),
        (1, "pd", 16, 2000.0, 100.0, 2.0),
        (2, "pd", 16, 1000.0, 300.0, 9.0),
        (2, "vllm", 16, 1000.0, 100.0, 1.0),
    ]
    per_round = ratios(rows, "vllm")
    assert per_round == [
        Ratio("pd", 16, 2.0, 2.0),
        Ratio("pd", 16, 0.5, 2.0),  # against round 1's vllm, not round 0's
        Ratio("pd", 16, 9.0, 3.0),
    ]
    (group,) = by_system(per_round).values()
    assert median_ratio(group) == Ratio("pd", 16, 2.0, 2.0)
