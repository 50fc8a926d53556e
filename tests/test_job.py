"""Bad torchrun environments end in one line naming the problem (parallel/job.py): variables
that are not numbers or out of range, a port in use, ranks that disagree on WORLD_SIZE or on
their options, ranks that never come. The rendezvous runs in threads of this process (the
TCP store serves several clients in one process), so no test starts a process."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeoffload.cli.launch import free_port
from pipeoffload.cli.main import main
from pipeoffload.errors import ConfigError, PipelineRuntimeError
from pipeoffload.parallel.job import JobEnv, read_job_env

GOOD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("change, message", [
    ({"RANK": "abc"}, r"RANK is 'abc', not a whole number"),
    ({"RANK": "-1"}, r"RANK is '-1', not a whole number"),
    ({"RANK": "²"}, r"RANK is '²', not a whole number"),
    ({"WORLD_SIZE": ""}, r"WORLD_SIZE is empty"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE is 0"),
    ({"RANK": "2"}, r"RANK=2 is not below WORLD_SIZE=2: ranks are 0..1"),
    ({"MASTER_PORT": "99999"}, r"MASTER_PORT=99999 is not a TCP port \(1..65535\)"),
    ({"MASTER_PORT": "0"}, r"MASTER_PORT=0 is not a TCP port"),
    ({"MASTER_PORT": "http"}, r"MASTER_PORT is 'http', not a whole number"),
    ({"MASTER_ADDR": " "}, r"MASTER_ADDR is empty"),
    ({"LOCAL_RANK": "x"}, r"LOCAL_RANK is 'x', not a whole number"),
])
def test_a_bad_variable_is_named(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_job_env({**GOOD, **change})


def test_the_environment_is_read() -> None:
    job = read_job_env({**GOOD, "LOCAL_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_RESTART_COUNT": "2"})
    assert job == JobEnv(1, 2, "127.0.0.1", 29500, 1, agent_store=True, restart=2)
    with pytest.raises(ConfigError, match="RANK is not set"):
        read_job_env({k: v for k, v in GOOD.items() if k != "RANK"})


def test_the_command_refuses_a_bad_environment_before_starting(monkeypatch, capsys) -> None:
    for key, value in {**GOOD, "RANK": "abc"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--model", "tiny", "--pp", "2", "--no-png"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("pipeoffload train: error: environment variable RANK is 'abc', not a "
                           "whole number; it is set by torchrun (or by hand for each process: "
                           "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")


torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from pipeoffload.parallel.job import join_store  # noqa: E402


def meet(jobs: list[JobEnv], timeout_s: float = 60.0, agree: list | None = None) -> list:
    """join_store for every job at once, in threads; each result is the store or the error."""
    agree = agree or [{}] * len(jobs)

    def one(i: int):
        try:
            return join_store(jobs[i], timeout_s, agree[i])
        except Exception as error:  # noqa: BLE001 - the test looks at it
            return error

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, range(len(jobs))))


def job(rank: int, world: int, port: int) -> JobEnv:
    return JobEnv(rank, world, "127.0.0.1", port)


def test_ranks_that_agree_meet() -> None:
    port = free_port()
    stores = meet([job(r, 3, port) for r in range(3)], agree=[{"steps": 5}] * 3)
    assert all(isinstance(s, dist.Store) for s in stores), stores


def test_ranks_that_disagree_on_world_size_are_told_at_once() -> None:
    port = free_port()
    zero, one = meet([job(0, 2, port), job(1, 3, port)])
    assert isinstance(zero, ConfigError) and isinstance(one, ConfigError), (zero, one)
    assert "rank 1 has WORLD_SIZE=3, this rank (0) has 2" in str(zero)
    assert "rank 0 has WORLD_SIZE=2, this rank (1) has 3" in str(one)


def test_ranks_started_with_other_options_are_told_which() -> None:
    port = free_port()
    zero, one = meet([job(0, 2, port), job(1, 2, port)],
                     agree=[{"options": {"seed": 0, "lr": 1.0}}, {"options": {"seed": 3,
                                                                              "lr": 1.0}}])
    assert isinstance(zero, ConfigError), zero
    assert "rank 1 was started with other options than this rank (0): options.seed: 3 there, " \
           "0 here" in str(zero)
    assert isinstance(one, ConfigError), one


def test_two_processes_with_one_rank_are_told() -> None:
    port = free_port()
    results = meet([job(0, 2, port), job(1, 2, port), job(1, 2, port)])
    assert any("two processes of the job have RANK=1" in str(r) for r in results), results


def test_a_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"MASTER_PORT={port} is in use on this host"):
            join_store(job(0, 2, port), 30)


def test_ranks_that_never_come_are_listed_after_the_timeout() -> None:
    port = free_port()
    (zero,) = meet([job(0, 3, port)], timeout_s=1.0)  # waits 1 s for ranks that never start
    assert isinstance(zero, PipelineRuntimeError), zero
    assert f"only 1 of WORLD_SIZE=3 ranks joined the job at 127.0.0.1:{port} within 1 s " \
           "(missing rank(s) 1, 2)" in str(zero)


def test_a_store_nobody_hosts_is_named() -> None:
    port = free_port()  # free: nobody listens there
    with pytest.raises(PipelineRuntimeError, match=f"cannot reach the job's store at "
                       f"127.0.0.1:{port} within 1 s .*is rank 0 running there"):
        join_store(job(1, 2, port), 1.0)
