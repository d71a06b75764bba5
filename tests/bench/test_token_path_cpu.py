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


def test_processes_belong_to_the_system_that_started_them_and_to_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import sys
    import time
    from collections.abc import Iterator
    from contextlib import contextmanager

    import psutil

    from bench import token_path_cpu
    from bench.token_path_cpu import Owners

    sleeper = "import time; time.sleep(60)"
    # A system's process that starts another one a little later, as a raylet starts workers.
    parent = "import subprocess, sys, time; time.sleep(0.5); "
    parent += f"subprocess.Popen([sys.executable, '-c', {sleeper!r}]); {sleeper}"
    procs: dict[str, psutil.Process] = {}

    @contextmanager
    def started(system: str, base: object) -> Iterator[str]:  # stands in for bench/live/systems.py's
        procs[system] = psutil.Process(subprocess.Popen([sys.executable, "-c", parent]).pid)
        yield f"address-of-{system}"  # left running after, to see it forgotten

    monkeypatch.setattr(token_path_cpu, "started", started)
    owners = Owners()
    bystander = psutil.Process(subprocess.Popen([sys.executable, "-c", sleeper]).pid)  # the bench's own
    try:
        with owners.started("vllm") as address:
            assert address == "address-of-vllm"
            with owners.started("pd"):
                assert owners.of(procs["vllm"]) == "vllm" and owners.of(procs["pd"]) == "pd"
                deadline = time.monotonic() + 10
                while not procs["vllm"].children() and time.monotonic() < deadline:
                    time.sleep(0.05)
                (later,) = procs["vllm"].children()
                assert owners.of(later) == "vllm"  # it appeared after its system had started
                assert owners.of(bystander) is None and owners.of(psutil.Process()) is None
            assert owners.of(procs["pd"]) is None  # forgotten once its system stopped
            assert owners.of(procs["vllm"]) == "vllm"
    finally:
        for proc in [bystander, *procs.values()]:
            for p in [*proc.children(), proc]:
                p.kill()


def test_warm_rounds_need_a_vllm_base_that_stays_up(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.token_path_cpu import main

    with pytest.raises(SystemExit) as exc:
        main(["--warm", "--systems", "aggregated,pd"])
    assert exc.value.code == 2
    assert "--warm keeps the base (the last system) up throughout" in capsys.readouterr().err
