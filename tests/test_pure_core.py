"""Layers 1-4 import and work without torch (design.md): checked in a child process where
importing torch fails."""

import subprocess
import sys
import textwrap

from patience import PATIENCE_S

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_core_layers_import_and_run_without_torch():
    code = BLOCK_TORCH + textwrap.dedent("""
        import importlib, pkgutil
        import pipeoffload
        for layer in ("core", "sim", "offload", "planner"):
            package = importlib.import_module(f"pipeoffload.{layer}")
            for info in pkgutil.walk_packages(package.__path__, f"pipeoffload.{layer}."):
                importlib.import_module(info.name)
        plan = pipeoffload.plan_schedule("po-f", 4, 16, offload_ratio=0.25)
        assert plan.report.offloaded
        from pipeoffload.cli.main import main
        assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--json"]) == 0
        assert "torch" not in sys.modules
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=PATIENCE_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")
