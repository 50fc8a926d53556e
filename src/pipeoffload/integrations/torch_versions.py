"""The torch versions ``pipeoffload.torch`` runs on, and what each one's private pipelining API
needs from it: the one place where the adapter's version differences live.

    torch       what its private pipelining API does that the adapter meets
    2.12-2.13   lowering (``_prepare_schedule_with_comms``): UNSHARD / RESHARD, REDUCE_GRAD,
                SEND / RECV; sends waited at the end of the step; ``step()`` takes whole batches
    2.14        as 2.13; ``step()`` also takes ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs``
    2.15        lowering adds WAIT_REDUCE_GRAD after REDUCE_GRAD and a WAIT_SEND_F / WAIT_SEND_B
                that alone retires each send (``_PendingSendTracker``, empty at the end of the
                step, else it raises), then checks them with ``_validate_send_waits``; receive
                buffers are allocated per receive (``_recv_buffers._RecvInfo``) and cleared when
                F takes them; a stage's outputs are released at WAIT_SEND_F; ``step()`` also
                takes ``finalize_gradients``

Nothing the adapter calls was removed or renamed across these. Older torch is not served: 2.10
and 2.11 have everything the adapter calls, but torch's own ScheduleZBVZeroBubble fails at its
first step over gloo there ("Pair is not connected"), and so does every V-placed schedule through
the adapter; 2.9 and older have no ``_comp_type_to_function_map``, through which our transfer
actions run (2.6, 2.8 and 2.9 have ``_PipelineScheduleRuntime`` without it, 2.4 not even that).
What was run on which version: docs/runtime.md ("Tested torch versions").

Pure Python (no torch import), so that tests and tools can ask before importing the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.errors import IntegrationError


@dataclass(frozen=True)
class TorchPipelining:
    """What the adapter does differently on one torch minor version."""

    version: str  # "major.minor"
    send_waits: bool
    """torch lowers each SEND_F / SEND_B with a WAIT_SEND_F / WAIT_SEND_B that alone retires it,
    and checks the lowered lists with ``_validate_send_waits``; the adapter checks its spliced
    lists with the same function (our actions are spliced in after torch's check)."""


TESTED: tuple[TorchPipelining, ...] = (
    TorchPipelining("2.12", send_waits=False),
    TorchPipelining("2.13", send_waits=False),
    TorchPipelining("2.14", send_waits=False),
    TorchPipelining("2.15", send_waits=True),
)
"""One row per torch minor version the adapter's tests pass on, oldest first."""

SUPPORTED_TORCH: tuple[str, ...] = tuple(row.version for row in TESTED)
"""torch major.minor versions this adapter was tested on (it uses private pipelining APIs)."""


def torch_pipelining(version: str) -> TorchPipelining:
    """The row for ``version`` (a ``torch.__version__`` such as ``2.15.0+cu132``); raise
    IntegrationError naming the tested versions if it has none."""
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as torch.__version__, got "
                        f"{type(version).__name__} {version!r:.60}")
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    for row in TESTED:
        if row.version == major_minor:
            return row
    raise IntegrationError(
        f"pipeoffload.torch uses private torch.distributed.pipelining APIs and is tested on "
        f"torch {SUPPORTED_TORCH[0]} to {SUPPORTED_TORCH[-1]}; this is torch {version}. "
        f"Install a tested torch, or run the schedule with pipeoffload.Pipeline, which uses "
        "only public torch APIs")


def check_torch_version(version: str) -> None:
    """Raise IntegrationError unless ``version`` (a ``torch.__version__``) is a tested one."""
    torch_pipelining(version)
