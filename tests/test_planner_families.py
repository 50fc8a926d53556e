"""The planner reads what it knows of a schedule family from the family's declaration: a family
registered only in a registry a test builds (a copy of a library family under a new name) is
priced and searched exactly as the original, with nothing in the planner naming it."""

from __future__ import annotations

import dataclasses

import pytest

from pipeoffload.core.registry import FAMILIES, REGISTRY, Registry
from pipeoffload.errors import ConfigError
from pipeoffload.planner.candidate import Candidate
from pipeoffload.planner.costing import GIB, MemoryConfig
from pipeoffload.planner.evaluate import Evaluator, Extrapolation
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.search import SearchConfig, SearchSpace, search
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import MlpKind, TransformerSpec

A100 = hardware_preset("a100-80gb")
SMALL = TransformerSpec(num_layers=16, hidden=1024, heads=16, kv_heads=16, ffn_hidden=4096,
                        vocab=32000, seq_len=2048, mlp=MlpKind.GELU, name="small")
NEW = "throwaway"


def _with_copy_of(original: str, **change: object) -> Registry:
    copy = dataclasses.replace(FAMILIES[original], name=NEW, aliases=(), **change)
    return Registry((*REGISTRY.families.values(), copy))


def _candidate(original: str, offload: str) -> Candidate:
    family = FAMILIES[original]
    group = 2 if "group_size" in family.options else None
    return Candidate(original, dp=1, tp=1, pp=4, chunks=family.fixed_chunks or 2,
                     micro_batch=1, microbatches=16, offload=offload, group_size=group)


@pytest.mark.parametrize("original", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv",
                                      "grouped-interleaved", "dualpipev"])
def test_a_family_of_a_test_registry_is_priced_as_its_original(original: str) -> None:
    registry = _with_copy_of(original)
    assert NEW not in FAMILIES  # the library's registry is untouched
    evaluator = Evaluator(SMALL, A100, MemoryConfig(), 80 * GIB,
                          Extrapolation(enabled=False), registry=registry)
    for offload in ("none", "all"):
        theirs = _candidate(original, offload)
        ours = dataclasses.replace(theirs, schedule=NEW)
        assert evaluator.stage_to_rank(ours) == evaluator.stage_to_rank(theirs) \
            == evaluator.schedule(theirs, 16).stage_to_rank
        assert evaluator.layout(ours) == evaluator.layout(theirs)
        assert evaluator.time_bound(ours) == evaluator.time_bound(theirs)
        assert evaluator.state_and_floor(ours) == evaluator.state_and_floor(theirs)
        assert evaluator.memory_bound(ours) == evaluator.memory_bound(theirs)
        plan, reference = evaluator.evaluate(ours), evaluator.evaluate(theirs)
        assert dataclasses.replace(plan, candidate=theirs) == reference


def test_a_search_over_a_test_registry_finds_the_originals_plan() -> None:
    registry = _with_copy_of("zbv")
    config = SearchConfig(gpus=8, global_batch=32, budget_bytes=20 * GIB)
    ours = search(SMALL, A100, config, SearchSpace(schedules=(NEW,), registry=registry))
    theirs = search(SMALL, A100, config, SearchSpace(schedules=("zbv",)))
    assert ours.best is not None and theirs.best is not None
    assert ours.best.candidate == dataclasses.replace(theirs.best.candidate, schedule=NEW)
    assert ours.best.step_time == theirs.best.step_time
    assert ours.best.memory == theirs.best.memory
    assert "train has no schedule 'throwaway'" in str(train_command(ours.best.candidate))


def test_the_library_registry_does_not_know_a_test_registrys_family() -> None:
    evaluator = Evaluator(SMALL, A100, MemoryConfig(), 80 * GIB)
    with pytest.raises(ConfigError, match="unknown schedule 'throwaway'"):
        evaluator.evaluate(dataclasses.replace(_candidate("zbv", "none"), schedule=NEW))
    with pytest.raises(ConfigError, match="unknown schedule 'throwaway'"):
        SearchSpace(schedules=(NEW,))


def test_a_search_refuses_a_family_with_two_weight_copies_by_its_declaration() -> None:
    registry = _with_copy_of("1f1b", weight_copies=2, one_copy_variant="1f1b")
    with pytest.raises(ConfigError, match="throwaway keeps 2.*search 1f1b"):
        SearchSpace(schedules=("zbv", NEW), registry=registry)


def test_an_evaluator_of_another_registry_is_not_reused() -> None:
    registry = _with_copy_of("zbv")
    config = SearchConfig(gpus=8, global_batch=32, budget_bytes=20 * GIB)
    first = search(SMALL, A100, config, SearchSpace(schedules=("zbv",)))
    with pytest.raises(ValueError, match="registry"):
        search(SMALL, A100, config, SearchSpace(schedules=(NEW,), registry=registry),
               evaluator=first.evaluator)
