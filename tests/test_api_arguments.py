"""The Python API refuses wrong arguments with a ValueError or TypeError naming the argument,
before anything is changed, written or joined (issue 40, items 18 and 21)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pipeoffload as po  # noqa: E402
from pipeoffload.hf import export_pretrained  # noqa: E402
from pipeoffload.parallel import export as export_module  # noqa: E402


def stages_with_grads() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    stages = {0: nn.Linear(3, 3), 1: nn.Linear(3, 2)}
    stages[1](stages[0](torch.ones(2, 3))).sum().backward()
    return stages


def grads(stages: dict[int, nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for m in stages.values() for p in m.parameters()]


@pytest.mark.parametrize("max_norm, error, words", [
    (-1.0, ValueError, "max_norm must be a number > 0"),
    (0.0, ValueError, "max_norm must be a number > 0"),
    (float("nan"), ValueError, "got nan"),
    ("1", TypeError, "max_norm must be a number, got str"),
    (True, TypeError, "max_norm must be a number, got bool"),
])
def test_clip_grad_norm_refuses_a_norm_that_would_flip_or_ignore_gradients(
        max_norm, error, words) -> None:
    stages = stages_with_grads()
    before = grads(stages)
    with pytest.raises(error, match=words):
        po.clip_grad_norm_(stages, max_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, grads(stages)))  # untouched


def test_clip_grad_norm_with_inf_measures_only_as_torch_does() -> None:
    stages = stages_with_grads()
    before = grads(stages)
    norm = po.clip_grad_norm_(stages, float("inf"))
    assert norm == pytest.approx(torch.linalg.vector_norm(
        torch.cat([g.double().flatten() for g in before])).item(), rel=1e-12)  # float64 sums
    assert all(torch.equal(a, b) for a, b in zip(before, grads(stages)))
    with pytest.raises(TypeError, match=r"stages must be a dict \{stage index: nn.Module\}"):
        po.clip_grad_norm_([nn.Linear(2, 2)], 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("step, optimizers, error, words", [
    (-1, "ok", ValueError, "step must be >= 0, got -1"),
    (1.5, "ok", TypeError, "step must be a whole number, got float"),
    (1, None, TypeError, "optimizers must be a dict"),
    (1, {}, ValueError, r"optimizers has no optimizer for stage\(s\) \[0, 1\]"),
    (1, {0: "adam", 1: "adam"}, TypeError, r"optimizers\[0\] must be a torch.optim.Optimizer"),
])
def test_save_checkpoint_refuses_a_bad_step_or_missing_foreign_optimizers(
        step, optimizers, error, words, tmp_path: Path) -> None:
    stages = stages_with_grads()
    if optimizers == "ok":
        optimizers = {s: torch.optim.SGD(m.parameters(), lr=0.1) for s, m in stages.items()}
    with pytest.raises(error, match=words):
        po.save_checkpoint(tmp_path / "ck", step, stages, optimizers)
    assert not (tmp_path / "ck").exists()  # nothing written, no step_-0000001
    with pytest.raises((TypeError, ValueError), match="optimizers"):
        po.load_checkpoint(tmp_path / "ck", stages, {})


@pytest.mark.parametrize("dtype, error, words", [
    (torch.int8, ValueError, "dtype must be a floating-point dtype"),
    ("bf16", TypeError, "dtype must be a torch.dtype, got str"),
])
def test_export_pretrained_refuses_a_dtype_that_is_not_a_float(dtype, error, words,
                                                                tmp_path: Path) -> None:
    stages = stages_with_grads()
    with pytest.raises(error, match=words):
        export_pretrained(tmp_path / "out", stages[0], stages, dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_init_distributed_refuses_a_nan_timeout_before_joining() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0, got nan"):
        po.init_distributed(1, timeout_s=float("nan"))
    with pytest.raises(ValueError, match="pp must be >= 1, got 0"):
        po.init_distributed(0)


def test_pipeoffload_schedule_refuses_what_is_not_a_stage_or_a_schedule() -> None:
    from pipeoffload.torch import PipeOffloadSchedule

    schedule = po.build_schedule("1f1b", pp=1, microbatches=2)
    with pytest.raises(TypeError, match=r"stages\[0\] is <class 'torch.nn.modules.linear."
                       r"Linear'>, not a torch PipelineStage"):
        PipeOffloadSchedule([nn.Linear], schedule)
    with pytest.raises(TypeError, match="schedule must be a pipeoffload Schedule .* NoneType"):
        PipeOffloadSchedule([], None)  # type: ignore[arg-type]


class _Tiny(nn.Module):
    """A stand-in for a ``*ForCausalLM``: named parameters and a config."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)

        class Config:
            def to_json_string(self) -> str:
                return '{"model_type": "llama"}'

        self.config = Config()


def test_an_export_refuses_a_full_folder_and_files_that_appear_while_it_writes(
        tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("safetensors")
    model = _Tiny()
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.safetensors").write_bytes(b"stale")
    with pytest.raises(ValueError, match="folder .*full: the folder exists and is not empty"):
        export_pretrained(full, model, {0: model})
    assert sorted(p.name for p in full.iterdir()) == ["old.safetensors"]
    out = tmp_path / "out"
    real = export_module._safetensors_bytes

    def copied_in_meanwhile(tensors):
        (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "gone"}}')
        return real(tensors)

    monkeypatch.setattr(export_module, "_safetensors_bytes", copied_in_meanwhile)
    with pytest.raises(ValueError, match="'model.safetensors.index.json' appeared there while "
                       "the export was written"):
        export_pretrained(out, model, {0: model})
    assert not (out / "config.json").exists()  # never a complete-looking export
    monkeypatch.setattr(export_module, "_safetensors_bytes", real)
    done = export_pretrained(tmp_path / "fine", model, {0: model})
    assert sorted(p.name for p in done.iterdir()) == ["config.json", "model.safetensors"]


def test_an_empty_batch_is_refused_instead_of_a_nan_loss() -> None:
    schedule = po.build_schedule("1f1b", pp=2, microbatches=2)
    pipe = po.Pipeline({0: nn.Linear(4, 4), 1: nn.Linear(4, 4)}, schedule,
                       loss_fn=lambda y, t: ((y - t) ** 2).mean())
    with pytest.raises(ValueError, match=r"inputs\[0\] is an empty batch \(dim 0 has size 0\), "
                       "whose loss would be nan; pass at least 2 rows"):
        pipe.step(torch.ones(0, 4), target=torch.ones(0, 4))
    assert torch.isfinite(pipe.step(torch.ones(2, 4), target=torch.ones(2, 4)))


def _schedule() -> po.Schedule:
    return po.build_schedule("1f1b", pp=2, microbatches=2)


def _pipeline(**changes: object) -> po.Pipeline:
    arguments: dict = dict(stages={0: nn.Linear(4, 4), 1: nn.Linear(4, 4)},
                           schedule=_schedule(), loss_fn=nn.MSELoss())
    return po.Pipeline(**{**arguments, **changes})


def _distributed(name: str):
    import pipeoffload.distributed as distributed
    return getattr(distributed, name)


def _hf(name: str):
    import pipeoffload.hf as hf
    return getattr(hf, name)


def _torch_api(name: str):
    import pipeoffload.torch as pt
    return getattr(pt, name)


# (call, error, words of its message): each raised an AttributeError (or nothing) from deep
# inside before (issue 40 item 22, "3 of 7 raw exceptions in the API cases" and the rest of a
# sweep of pipeoffload.__all__, .distributed, .hf and .torch with None, numbers, strings).
WRONG_ARGUMENTS = [
    (lambda: po.build_schedule(None, pp=2, microbatches=2), TypeError,
     "schedule name must be a str"),
    (lambda: po.simulate(None), TypeError, "simulate: schedule must be a Schedule, got NoneType"),
    (lambda: po.simulate(_schedule(), "fast"), TypeError,
     "simulate: costs must be a CostModel or None, got str"),
    (lambda: po.simulate(_schedule(), 0), TypeError, "simulate: costs must be a CostModel"),
    (lambda: po.validate("1f1b"), TypeError, "validate: schedule must be a Schedule, got str"),
    (lambda: po.add_offload(-1), TypeError, "add_offload: schedule must be a Schedule, got int"),
    (lambda: po.add_offload(_schedule(), float("nan")), TypeError,
     "add_offload: costs must be a CostModel"),
    (lambda: po.write_csv([], "x.csv"), TypeError, "write_csv: schedule must be a Schedule"),
    (lambda: _pipeline(schedule="1f1b"), TypeError, "Pipeline: schedule must be a Schedule"),
    (lambda: _pipeline(loss_fn="mse"), TypeError, "Pipeline: loss_fn must be callable"),
    (lambda: _pipeline(config=300.0), TypeError,
     "Pipeline: config must be a RuntimeConfig or None"),
    (lambda: po.split_blocks([nn.Linear(2, 2)] * 4, None), TypeError,
     "split_blocks: schedule must be a Schedule"),
    (lambda: po.OffloadConfig(min_offload_elements=float("nan")), ValueError,
     "OffloadConfig.min_offload_elements must be a whole number"),
    (lambda: po.OffloadConfig(pin_memory="yes"), TypeError,
     "OffloadConfig.pin_memory must be True or False"),
    (lambda: po.RuntimeConfig(p2p_timeout_s=float("nan")), ValueError,
     "RuntimeConfig.p2p_timeout_s must be a finite number"),
    (lambda: po.RuntimeConfig(p2p_timeout_s=True), ValueError,
     "RuntimeConfig.p2p_timeout_s must be a finite number"),
    (lambda: po.RuntimeConfig(offload=None), TypeError,
     "RuntimeConfig.offload must be an OffloadConfig"),
    (lambda: _distributed("tie_copies")(None), TypeError,
     "tie_copies: stages must be a dict {stage index: nn.Module}"),
    (lambda: _hf("balanced_layers")(8, True), ValueError, "num_stages must be a whole number"),
    (lambda: _hf("causal_lm_loss")(None, None), TypeError,
     "causal_lm_loss: logits must be a torch.Tensor, got NoneType"),
    (lambda: _hf("check_causal_lm")(3), TypeError,
     "expected a transformers model or its config, got int"),
    (lambda: _hf("split_causal_lm")(None, 2), TypeError,
     "expected a transformers model or its config, got NoneType"),
    (lambda: _torch_api("get_schedule_class")(None), TypeError, "schedule name must be a str"),
    (lambda: _torch_api("check_torch_version")(2.4), TypeError, "version must be a str"),
]


@pytest.mark.parametrize("call, error, words", WRONG_ARGUMENTS,
                         ids=[w for _, _, w in WRONG_ARGUMENTS])
def test_a_wrong_argument_is_a_value_or_type_error_naming_it(call, error, words, tmp_path,
                                                               monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        call()
    assert words in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # write_csv wrote nothing
