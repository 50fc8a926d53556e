"""Tensor parallelism (torch DTensor) inside pipeline stages: 4 gloo ranks, pp=2 x tp=2, float64,
against the unsplit single-process model; the meter against the simulator per rank; saved
DTensors offloaded by their local shards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from patience import PATIENCE, PATIENCE_S
from test_runtime_support import launch, one_thread  # noqa: E402, F401 - autouse fixture

from pipeoffload.api import build_schedule  # noqa: E402
from pipeoffload.core.actions import Kind  # noqa: E402
from pipeoffload.offload.plan import OffloadPolicy  # noqa: E402
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig  # noqa: E402
from pipeoffload.runtime.meter import ActivationMeter  # noqa: E402
from pipeoffload.runtime.pipeline import Pipeline  # noqa: E402
from pipeoffload.sim.costs import CostModel  # noqa: E402
from pipeoffload.sim.simulator import simulate  # noqa: E402
from pipeoffload.training.model import set_layer_recompute  # noqa: E402
from pipeoffload.training.model_config import model_preset  # noqa: E402
from pipeoffload.training.split import build_full_model, build_stage_modules, lm_loss  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = model_preset("tiny")  # 4 layers, 4 heads, 2 kv heads: splits over tp=2
MICROBATCHES = 4
CASES = (("1f1b", {}, "none"), ("zbv", {}, "none"), ("po-f", {"offload_ratio": 0.25}, "none"),
         ("po-f", {"offload_ratio": 0.25}, "lgd"), ("zbv", {}, "full"),
         ("po-f", {"offload_ratio": 0.25, "policy": OffloadPolicy(fetch_on_use=True)}, "none"))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, MODEL.vocab_size, (8, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _schedule(name: str, options: dict):
    return build_schedule(name, pp=2, microbatches=MICROBATCHES, **options)


def _stages(schedule, stage_ids, recompute: str, mesh=None) -> dict:
    from pipeoffload.training.tensor_parallel import apply_tensor_parallel

    stages = build_stage_modules(MODEL, schedule.num_stages, stage_ids, seed=0,
                                 dtype=torch.float64)
    for module in stages.values():
        if mesh is not None:
            apply_tensor_parallel(module, mesh)
        set_layer_recompute(module, recompute)
    return stages


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = build_full_model(MODEL, seed=0, dtype=torch.float64)
    ids, target = _batch()
    losses = [lm_loss(model(x), t) for x, t in zip(ids.chunk(MICROBATCHES),
                                                   target.chunk(MICROBATCHES))]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tp_cases(rank: int, world: int) -> list[dict]:
    from pipeoffload.parallel.topology import mesh_topology

    topology = mesh_topology(2, 1, 2, torch.device("cpu"), timeout_s=PATIENCE_S)
    ref_loss, ref_grads = _reference()
    ids, target = _batch()
    report = []
    for name, options, recompute in CASES:
        schedule = _schedule(name, options)
        mine = schedule.stages_on_rank(topology.pp_rank)
        stages = _stages(schedule, mine, recompute, topology.tp_mesh)
        meter = ActivationMeter()
        config = RuntimeConfig(p2p_timeout_s=PATIENCE_S,
                               offload=OffloadConfig(min_offload_elements=0))
        pipe = Pipeline(stages, schedule, lm_loss, group=topology.pp_group, config=config,
                        meter=meter)
        loss = pipe.step(ids, target=target)
        worst, sharded = 0.0, 0
        for module in stages.values():
            for pname, p in module.named_parameters():
                grad = p.grad
                if hasattr(grad, "full_tensor"):
                    grad, sharded = grad.full_tensor(), sharded + 1
                expected = ref_grads[pname]
                worst = max(worst, ((grad - expected).norm() / expected.norm()).item())
        report.append({
            "grad_error": worst, "sharded": sharded,
            "loss_error": None if loss is None else abs(loss.item() - ref_loss) / ref_loss,
            "peak": meter.peak_bytes(topology.pp_rank), "sizes": meter.scope_bytes,
            "kept": pipe.offloader.kept_bytes if pipe.offloader else None,
            "host_pool": pipe.offloader.host_pool_bytes if pipe.offloader else 0,
            "unwaited": _unwaited_collectives()})
    return report


def _unwaited_collectives() -> int | None:
    """Collectives started and never waited for (their work and buffers stay registered until
    the process ends); None where torch does not say."""
    registry_size = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    return None if registry_size is None else registry_size()


def _single_process_sizes(name: str, options: dict, recompute: str) -> dict:
    schedule = _schedule(name, options)
    stages = _stages(schedule, range(schedule.num_stages), recompute)
    meter = ActivationMeter()
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
    ids, target = _batch()
    Pipeline(stages, schedule, lm_loss, config=config, meter=meter).step(ids, target=target)
    return meter.scope_bytes


def test_pp2_tp2_equals_the_unsplit_model_and_the_meter_equals_the_simulator(tmp_path) -> None:
    results = launch(_tp_cases, 4, tmp_path, join_timeout_s=PATIENCE_S)
    assert sorted(results) == [0, 1, 2, 3], results
    for outcome in results.values():
        assert "ok" in outcome, outcome.get("trace")
    for index, (name, options, recompute) in enumerate(CASES):
        schedule = _schedule(name, options)
        rows = {rank: results[rank]["ok"][index] for rank in range(4)}
        assert schedule.has_kind(Kind.FETCH) == ("policy" in options)
        for rank, row in rows.items():
            assert row["grad_error"] <= 1e-10, (name, recompute, rank, row["grad_error"])
            assert row["sharded"] > 0  # DTensor parameters really were sharded
            assert row["unwaited"] in (0, None), (name, recompute, rank, row["unwaited"])
            holds_last = schedule.num_stages - 1 in schedule.stages_on_rank(rank // 2)
            assert (row["loss_error"] is not None) == holds_last
            if holds_last:
                assert row["loss_error"] <= 1e-10, (name, recompute, rank)
            if schedule.has_kind(Kind.OFFLOAD):
                assert row["host_pool"] > 0
                assert set(row["kept"]) <= {"parameter"}, row["kept"]  # shards were moved
        # Per stage one size (every microbatch, both tensor-parallel ranks): the simulator's.
        per_stage: dict[int, set[int]] = {}
        for row in rows.values():
            for (stage, _), nbytes in row["sizes"].items():
                per_stage.setdefault(stage, set()).add(nbytes)
        assert all(len(per_stage[s]) == 1 for s in range(schedule.num_stages)), per_stage
        sizes = tuple(per_stage[s].pop() for s in range(schedule.num_stages))
        predicted = simulate(schedule, CostModel(stage_activation_bytes=sizes)).peak_bytes
        for rank, row in rows.items():
            assert row["peak"] == predicted[rank // 2], (name, recompute, rank)
        # Sequence parallelism shards what a layer saves, except the gathered norm outputs
        # (saved whole unless recomputed) and rotary cos / sin; under full recompute a layer
        # keeps only its input shard: exactly 1/tp (docs/training.md).
        whole = _single_process_sizes(name, options, recompute)
        single = {stage: nbytes for (stage, _), nbytes in whole.items()}
        assert all(sizes[stage] < nbytes for stage, nbytes in single.items()), name
        if recompute == "full":
            middle = range(1, schedule.num_stages - 1)
            assert all(2 * sizes[stage] == single[stage] for stage in middle), sizes


def _cli(argv: list[str], cwd) -> tuple[int, str, str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pipeoffload.cli", "train", *argv],
                          cwd=cwd, capture_output=True, text=True, timeout=PATIENCE_S)
    return done.returncode, done.stdout, done.stderr


def test_tp_bf16_checkpoint_resumes_bitwise_and_refuses_another_tp(tmp_path) -> None:
    import argparse
    import json

    from pipeoffload.cli.train import add_train_parser, config_from_args
    from pipeoffload.parallel.checkpoint import CheckpointError
    from pipeoffload.training.run_checks import check_run

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog="pipeoffload")
        add_train_parser(parser.add_subparsers(dest="command", required=True))
        return parser.parse_args(["train", *argv])

    common = ["--model", "tiny", "--pp", "1", "--tp", "2", "--schedule", "1f1b", "--steps", "3",
              "--batch-size", "4", "--dtype", "bf16", "--no-png", "--json", "--p2p-timeout",
              PATIENCE, "--checkpoint-dir", "ck"]
    code, out, err = _cli([*common, "--checkpoint-every", "2"], tmp_path)
    assert code == 0, err
    straight = json.loads(out.splitlines()[-1])
    assert (straight["tp"], straight["dtype"]) == (2, "bf16")
    assert sorted(p.name for p in (tmp_path / "ck" / "step_00000002").iterdir()) == [
        "config.toml", "manifest.json", "rank_00000.pt", "rank_00001.pt", "stage_000_tp0.pt",
        "stage_000_tp1.pt"]
    manifest = json.loads((tmp_path / "ck" / "step_00000002" / "manifest.json").read_text())
    assert (manifest["info"]["tp"], manifest["info"]["dtype"]) == (2, "bf16")
    code, out, err = _cli([*common, "--resume", "ck/step_00000002"], tmp_path)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["losses"] == straight["losses"][2:]  # bitwise
    config, _ = config_from_args(parse([*common, "--tp", "1", "--resume",
                                        str(tmp_path / "ck" / "step_00000002")]))
    with pytest.raises(CheckpointError, match="tp: checkpoint 2, now 1.*not resharded"):
        check_run(config, processes=1)
