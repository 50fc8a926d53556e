"""Train a Hugging Face Llama with PipeOffload's po-f schedule under torchrun, in your own loop:
AdamW, gradient clipping across stages (tied embeddings counted once), per-stage checkpoints
with resume, and an export that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 20 --out /tmp/llama-run
    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 40 --out /tmp/llama-run --resume

One process per pipeline rank (gloo on CPU, NCCL on GPUs). Tokens are the bytes of a Python
standard-library file, so nothing is downloaded. The last line, printed by the rank holding the
last stage, is the loss of a fixed batch after training (Pipeline.evaluate); the export gives
the same loss (tests/test_examples.py checks it).
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch
import transformers

import pipeoffload as po
from pipeoffload.hf import causal_lm_loss, check_causal_lm, export_pretrained, split_causal_lm

SEQ, BATCH = 32, 8


def batch(tokens: torch.Tensor, step: int) -> torch.Tensor:
    """Step ``step``'s BATCH windows of SEQ byte tokens (the same on every rank)."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(tokens) - SEQ, (BATCH,), generator=generator)
    return torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True, help="checkpoints and export")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True)
    check_causal_lm(config)  # before any process group: an unknown model fails once, not per rank
    pp = int(os.environ["WORLD_SIZE"])
    topology = po.init_distributed(pp=pp)  # process group, device mesh, P2P channel groups
    schedule = po.build_schedule("po-f", pp=pp, microbatches=2 * pp)

    torch.manual_seed(0)  # every rank builds the same model, then keeps its own stages
    model = transformers.LlamaForCausalLM(config)
    stages = split_causal_lm(model, schedule, rank=topology.pp_rank)
    pipe = po.Pipeline(stages, schedule, causal_lm_loss, **topology.pipeline_options())
    optimizers = {s: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
                  for s, m in stages.items()}

    info = {"model": json.loads(config.to_json_string()), "pp": pp}
    start = 0
    if args.resume:
        start = po.load_checkpoint(args.out / "checkpoints", stages, optimizers, topology,
                                   info=info)
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
    tokens = torch.tensor(list(stdlib.read_bytes()), dtype=torch.int64)
    last = schedule.rank_of(schedule.num_stages - 1) == topology.pp_rank
    for step in range(start, args.steps):
        ids = batch(tokens, step)
        loss = pipe.step(ids, target=ids)  # forward and backward; the loss on the last rank
        norm = po.clip_grad_norm_(stages, 1.0, topology)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if last:
            print(f"step {step + 1}: loss {loss.item():.4f}, gradient norm {norm:.3f}", flush=True)
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            po.save_checkpoint(args.out / "checkpoints", step + 1, stages, optimizers, topology,
                               info=info)
    export_pretrained(args.out / "hf", model, stages, topology)
    for module in stages.values():
        module.eval()
    held_out = batch(tokens, 10**6)
    loss = pipe.evaluate(held_out, target=held_out)
    if last:
        print(f"final: loss {loss.item():.6f} on the batch of step {10**6}; exported to "
              f"{args.out / 'hf'}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
