"""torchtitan's trainer with a pipeoffload schedule, on CPU (gloo): the recipe of
docs/torchtitan.md plus the shims torchtitan 0.2.2 needs to run without an accelerator.

    PO_SCHEDULE=po-f torchrun --nproc_per_node 2 docs/torchtitan_cpu.py <torchtitan options>

Without PO_SCHEDULE it runs torchtitan's own schedule, for comparison. Not run by the tests
(torchtitan is not a dependency of pipeoffload).
"""

import dataclasses
import os

import torch
import torch._utils

# --- CPU shims (only for a machine without an accelerator) --------------------------------
# torchtitan 0.2.2 picks "cuda" when no accelerator is found: make it find the CPU, and give
# torch.cpu the memory-monitor calls its metrics make (reporting zeros).
torch._utils._get_available_device_type = lambda: "cpu"
_STATS = ("active_bytes.all.peak", "active_bytes.all.current", "reserved_bytes.all.peak",
          "num_alloc_retries", "num_ooms", "allocated_bytes.all.current")
for _name, _fn in {
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": lambda device=None: type("P", (), {"total_memory": 1 << 34})(),
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
    "memory_stats": lambda device=None: dict.fromkeys(_STATS, 0),
}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)

import torchtitan.distributed.utils as dist_utils  # noqa: E402

# its barrier passes a device index, which gloo's CPU barrier rejects; timeouts stay as set.
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

# --- the recipe ---------------------------------------------------------------------------
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402

from pipeoffload import build_schedule  # noqa: E402
from pipeoffload.torch import PipeOffloadSchedule  # noqa: E402


def pipeline_po(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
    """torchtitan's own pipelining, then its schedule swapped for a pipeoffload one over the
    same stages, loss and microbatches."""
    torch_schedule, parts, has_first, has_last = pipeline_llm(
        model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn)
    name = os.environ.get("PO_SCHEDULE")
    if name:
        schedule = build_schedule(name, pp=parallel_dims.pp,
                                  microbatches=torch_schedule._n_microbatches, offload_ratio=0.5)
        torch_schedule = PipeOffloadSchedule.from_torch(torch_schedule, schedule)
        _report(torch_schedule)
    return torch_schedule, parts, has_first, has_last


def _report(pipe: PipeOffloadSchedule) -> None:
    """Print after each step how much the offloader moved (evidence that it ran)."""
    step = pipe.step
    offloads = sum(a.kind.value == "OFFLOAD" for a in pipe.schedule.ranks[pipe.rank])

    def reporting_step(*args, **kwargs):
        out = step(*args, **kwargs)
        print(f"rank {pipe.rank}: {pipe.schedule.name}, {offloads} OFFLOAD actions per step, "
              f"host pool {pipe.offloader.host_pool_bytes} B", flush=True)
        return out

    pipe.step = reporting_step


register_train_spec("llama3_po", dataclasses.replace(get_train_spec("llama3"),
                                                     pipelining_fn=pipeline_po))

if __name__ == "__main__":
    main(Trainer)
