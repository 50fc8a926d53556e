"""Minimal reproduction (torch only, one CPU process): torch.distributed.pipelining's split
backward (I then W, as in ScheduleInterleavedZeroBubble) gives no gradient to the weights of an
FSDP2 group that was resharded between the stage's forward and its backward; the full backward
(ScheduleInterleaved1F1B) gives them one. docs/torchtitan.md, "The final norm's gradient".

    python docs/torch_split_backward_fsdp.py

Two ways to reshard in between, each on its own: a loss that reshards a group (torchtitan 0.3.0's
chunked loss reshards its [norm, lm_head] group), and a nested unit built with FSDP2's default
reshard_after_forward=True. Printed on torch 2.15.0 (and 2.13.0):

    loss reshards [norm, out]           Interleaved1F1B: set   InterleavedZeroBubble: None
    nested reshard_after_forward=True   Interleaved1F1B: set   InterleavedZeroBubble: None

(the cells: last.norm.weight.grad after one step)
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

D, V, MICROBATCHES = 8, 16, 2


class Last(nn.Module):
    """The last stage: a final norm; its output layer ``out`` is applied by the loss."""

    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, h):
        return self.norm(h)


class GivenGrad(torch.autograd.Function):
    """The loss value, whose backward hands ``h`` the gradient the loss computed already."""

    @staticmethod
    def forward(ctx, h, grad, loss):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):
        return ctx.saved_tensors[0], None, None


def norm_grad(schedule_class, loss_reshards: bool):
    torch.manual_seed(0)
    body, last = nn.Linear(D, D), Last()
    if loss_reshards:
        fully_shard([last.norm, last.out])  # one group, as torchtitan groups norm + lm_head
    else:
        fully_shard(last.norm)  # reshard_after_forward=True, FSDP2's default
    fully_shard(last)

    def loss_fn(h, y):  # the output layer inside the loss, as torchtitan's chunked loss
        leaf = h.detach().requires_grad_(True)
        loss = nn.functional.cross_entropy(last.out(leaf).flatten(0, 1), y.flatten())
        loss.backward()
        if loss_reshards:
            last.out.reshard()  # reshards the whole group: last.norm.weight too
        return GivenGrad.apply(h, leaf.grad, loss.detach())

    stages = [PipelineStage(body, 0, 2, torch.device("cpu")),
              PipelineStage(last, 1, 2, torch.device("cpu"))]
    schedule = schedule_class(stages, MICROBATCHES, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    schedule.step(torch.randn(MICROBATCHES, 4, D, generator=g),
                  target=torch.randint(0, V, (MICROBATCHES, 4), generator=g))
    return last.norm.weight.grad


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for what, loss_reshards in (("loss reshards [norm, out]", True),
                                ("nested reshard_after_forward=True", False)):
        cells = []
        for cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
            grad = norm_grad(cls, loss_reshards)
            cells.append(f"{cls.__name__[8:]}: {'None' if grad is None else 'set'}")
        print(f"{what:36}{'   '.join(cells)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
