"""torchtitan's trainer with a pipeoffload schedule, on CPU (gloo): the recipe of
docs/torchtitan.md plus what torchtitan 0.3.0 needs to run without an accelerator.

    python docs/torchtitan_cpu.py --make-assets RUN_DIR      a tokenizer and a c4_test dataset
    python docs/torchtitan_cpu.py --compare FILE_A FILE_B    gradients saved with PO_GRADS
    cd RUN_DIR && PO_SCHEDULE=po-f torchrun --nproc_per_node 2 .../docs/torchtitan_cpu.py \\
        --module __main__ --config llama3_po <torchtitan options>

Without PO_SCHEDULE it runs torchtitan's own schedule, for comparison. PO_LOSS=cross_entropy
swaps torchtitan's default chunked loss for plain cross-entropy, and PO_GRADS=FILE saves each
rank's gradients after the first step (docs/torchtitan.md, "The final norm's gradient"). Not run
by the tests (torchtitan is not a dependency of pipeoffload).
"""

import dataclasses
import os
import sys

import torch
import torch._utils


def make_assets(run_dir: str) -> None:
    """A 200-token BPE tokenizer (./tok) and 400 lines of seeded pseudo-text as torchtitan's
    c4_test dataset (./tests/assets/c4_test): the same files on every machine."""
    import json
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(42)
    words = ("pipeline stage schedule forward backward offload reload host device memory "
             "activation gradient weight rank microbatch chunk bubble copy stream tensor "
             "the a of to and in is it that with for on as by").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
             for _ in range(400)]
    data = os.path.join(run_dir, "tests", "assets", "c4_test")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "data.json"), "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]))
    tok = os.path.join(run_dir, "tok")
    os.makedirs(tok, exist_ok=True)
    tokenizer.save(os.path.join(tok, "tokenizer.json"))
    with open(os.path.join(tok, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    print(f"wrote {tok} and {data}")


def compare(path_a: str, path_b: str) -> None:
    """Per rank: how many of the gradients PO_GRADS saved are bitwise equal, and which are
    missing (None) on either side."""
    rank = 0
    while os.path.exists(f"{path_a}.rank{rank}"):
        a, b = (torch.load(f"{p}.rank{rank}", weights_only=True) for p in (path_a, path_b))
        missing = sorted(n for n in a if (a[n] is None) != (b[n] is None))
        equal = sum(a[n] is not None and b[n] is not None and torch.equal(a[n], b[n]) for n in a)
        print(f"rank {rank}: {equal} of {len(a)} gradients bitwise equal; "
              f"missing on one side: {missing or 'none'}")
        rank += 1


if __name__ == "__main__" and sys.argv[1:2] == ["--make-assets"]:
    make_assets(sys.argv[2])
    sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["--compare"]:
    compare(*sys.argv[2:4])
    sys.exit(0)

# --- CPU shims (only for a machine without an accelerator) --------------------------------
# torchtitan picks "cuda" when no accelerator is found: make it find the CPU, and give
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

import torch.nn.attention.flex_attention as flex  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402

# its barrier passes a device index, which gloo's CPU barrier rejects; timeouts stay as set.
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
# llama3 attends only through torch.compile'd flex attention, which needs a GPU here, and flex
# attention refuses a backward on CPU although its eager (reference) path computes one: run it
# eagerly without that check (set_determinism compiles it again, so after it too).
_validate_device = flex._validate_device
flex._validate_device = lambda q, k, v: None if q.device.type == "cpu" else \
    _validate_device(q, k, v)
flex_attention = flex.flex_attention
FlexAttention._compiled_flex_attn = flex_attention
_set_determinism = dist_utils.set_determinism


def _set_determinism_eager_flex(*args, **kwargs):
    _set_determinism(*args, **kwargs)
    FlexAttention._compiled_flex_attn = flex_attention


dist_utils.set_determinism = _set_determinism_eager_flex

# --- the recipe ---------------------------------------------------------------------------
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.train import main  # noqa: E402

from pipeoffload import build_schedule  # noqa: E402
from pipeoffload.torch import PipeOffloadSchedule  # noqa: E402


def pipeline_po(model, **kw):
    """torchtitan's own pipelining, then its schedule swapped for a pipeoffload one over the
    same stages, loss and microbatches."""
    torch_schedule, parts, has_first, has_last = pipeline_llm(model, **kw)
    name = os.environ.get("PO_SCHEDULE")
    if name:
        schedule = build_schedule(name, pp=kw["parallel_dims"].pp,
                                  microbatches=torch_schedule._n_microbatches, offload_ratio=0.5)
        torch_schedule = PipeOffloadSchedule.from_torch(torch_schedule, schedule)
        _report(torch_schedule)
    if os.environ.get("PO_GRADS"):
        _save_grads(torch_schedule, parts, os.environ["PO_GRADS"])
    return torch_schedule, parts, has_first, has_last


def llama3_po():
    """torchtitan's llama3 debug model with the pipelining hook above (``--config llama3_po``)."""
    config = llama3_debugmodel()
    config.model_spec = dataclasses.replace(config.model_spec, pipelining_fn=pipeline_po)
    if os.environ.get("PO_LOSS") == "cross_entropy":
        config.loss = CrossEntropyLoss.Config(global_vocab_size=config.model_spec.model.vocab_size)
    return config


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


def _full(tensor):
    """torchtitan's parameters are DTensors: their whole value (its mesh's collectives)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _save_grads(pipe, parts, path: str) -> None:
    """After the first step, save this rank's gradients by parameter name (None: no gradient)."""
    step = pipe.step
    rank = torch.distributed.get_rank()

    def saving_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if not os.path.exists(f"{path}.rank{rank}"):
            grads = {name: None if p.grad is None else _full(p.grad).detach().clone()
                     for part in parts for name, p in part.named_parameters()}
            torch.save(grads, f"{path}.rank{rank}")
        return out

    pipe.step = saving_step


if __name__ == "__main__":
    main()
