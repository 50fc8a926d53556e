"""Tensor parallelism for the reference transformer, with torch's DTensor styles.

Megatron's layout with sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022)
through ``torch.distributed.tensor.parallel``, as torchtitan applies it to Llama:
- the residual stream is a sequence shard: hidden states are plain local tensors
  [batch, seq / tp, dim] between layers and between stages, so the pipeline's point-to-point
  path (runtime/p2p.py) sends ordinary tensors, each tensor-parallel rank to the rank of the
  same tensor-parallel index in the next stage;
- norms run on the shard (``SequenceParallel``); their output is all-gathered once into a
  replicated DTensor that Q, K, V (or the MLP's gate and up projections) read, column-parallel
  (each rank its heads / its slice of the inner width);
- the attention output and MLP down projections are row-parallel with their partial sums
  reduce-scattered back into sequence shards;
- the embedding is row-parallel over the vocabulary (its output reduce-scattered into shards),
  the head column-parallel over the vocabulary with its input gathered and its logits
  gathered, so the loss is the plain one.
What a layer saves is then this rank's shard, except the gathered norm outputs, which the
projections save whole (``--recompute lgd`` and ``full`` recompute them instead).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeoffload.training.model import Transformer
from pipeoffload.training.model_config import check_tensor_parallel


def apply_tensor_parallel(module: Transformer, mesh: Any) -> Transformer:
    """Shard ``module``'s weights and sequence over the 1-D device mesh ``mesh`` (in place;
    returns it). Its inputs must then be sequence shards (token ids stay whole)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tensor_parallel(module.config, mesh.size())
    plan: dict[str, Any] = {}
    gathered: list[nn.Module] = []
    if module.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1))
    if module.output is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for name, block in module.layers.items():
        layer = f"layers.{name}"
        for norm_name in ("attention_norm", "ffn_norm"):
            plan[f"{layer}.{norm_name}"] = SequenceParallel(use_local_output=False)
            gathered.append(getattr(block, norm_name))
        for proj in ("attention.wq", "attention.wk", "attention.wv",
                     "feed_forward.w1", "feed_forward.w3"):
            plan[f"{layer}.{proj}"] = ColwiseParallel()
        for proj in ("attention.wo", "feed_forward.w2"):
            plan[f"{layer}.{proj}"] = RowwiseParallel(output_layouts=Shard(1))
    parallelize_module(module, mesh, plan)
    # One all-gather per norm output, read by all the projections after it.
    gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                 use_local_output=False)
    for norm in gathered:
        parallelize_module(norm, mesh, gather)
    module.sequence_shards = mesh.size()
    return module
