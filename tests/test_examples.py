"""The scripts in examples/ run as their docstrings say (torchrun's environment, here from
cli/launch.py: 2 gloo processes) and check what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str, cwd: Path) -> str:
    """``script`` on 2 local processes with torchrun's variables; its whole output."""
    launcher = ("import sys; from pipeoffload.cli.launch import LaunchConfig, launch; "
                "sys.exit(launch(sys.argv[1:], LaunchConfig(nprocs=2, reporting_rank=None)))")
    proc = subprocess.run([sys.executable, "-c", launcher, sys.executable,
                           str(EXAMPLES / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout,stages", [([], ("[0, 2]", "[1, 3]")),
                                           (["--dp", "2"], ("[0, 1]", "[0, 1]"))],
                         ids=["pp2", "dp2"])
def test_custom_module_example_matches_one_process_and_resumes(tmp_path, layout, stages):
    out = run("custom_module.py", "--out", str(tmp_path / "ckpt"), *layout, cwd=tmp_path)
    for rank, held in enumerate(stages):
        assert f"rank {rank}: stages {held} equal the one-process run" in out
    assert out.count("resume bitwise from step 3") == 2


@pytest.mark.slow
def test_hf_llama_example_trains_checkpoints_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = run("hf_llama.py", "--steps", "12", "--out", str(tmp_path / "run"), cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_00000010", "step_00000012"]
    final = float(re.search(r"final: loss ([\d.]+)", out).group(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_llama
    finally:
        sys.path.remove(str(EXAMPLES))
    from pipeoffload.hf import causal_lm_loss

    stdlib = Path(hf_llama.sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
    ids = hf_llama.batch(torch.tensor(list(stdlib.read_bytes())), 10**6)
    with torch.no_grad():
        loss = torch.stack([causal_lm_loss(model(input_ids=x).logits, x)
                            for x in ids.chunk(4)]).mean().item()
    assert abs(loss - final) < 1e-5
