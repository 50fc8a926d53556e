"""Runtime configuration: frozen dataclasses passed to Pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeoffload.checks import check_instance, check_number, check_optional


@dataclass(frozen=True)
class OffloadConfig:
    """How the activation offloader treats saved tensors (docs/method.md section 5).

    - ``min_offload_elements``: saved tensors with at most this many elements stay on the device
      (the authors' code keeps tensors of <= 1024 elements; moving them costs more than it saves).
      Set 0 to offload everything that is not a parameter (what makes the measured peaks equal
      the simulator's, which moves the whole activation of an offloaded (stage, microbatch)).
    - ``pin_memory``: use pinned host buffers on CUDA (ignored on CPU).
    - ``stream``: start each saved tensor's copy to host as autograd saves it, during the forward
      (what the simulator assumes, see offloader.py Note: [streaming offload]); False starts the
      copies at the OFFLOAD action instead, after the forward.
    - ``max_pending_copy_bytes``: at most this many device bytes may wait for their copy to
      host; beyond it the compute stream (never the host) waits for the oldest copies and their
      memory is released in stream order (offloader.py Note: [release order]). None: released
      only once a poll between actions sees the copy done, which can be late when the host runs
      ahead of the GPU. Copies on CPU are synchronous and never wait.
    - ``pending_copy_activations``: with ``max_pending_copy_bytes`` None and asynchronous copies
      (CUDA), the cap is this many times the largest (stage, microbatch) activation seen so far:
      memory is released in stream order by default, so that a host far ahead of the GPU cannot
      keep offloaded activations on the device past the plan (one activation still copying, as
      the simulator's streaming copy allows). None: release only when a poll sees the copy done
      (host time). A reasoned default: its cost in GPU step time is unmeasured.
    - ``measure_classes``: tag saved tensors by tensor class (module hooks, runtime/classes.py)
      and record each scope's bytes per class (``ActivationOffloader.class_bytes``) even when
      the schedule chooses no classes; with class choices they are always tagged.
    """

    min_offload_elements: int = 1024
    pin_memory: bool = True
    stream: bool = True
    max_pending_copy_bytes: int | None = None
    pending_copy_activations: float | None = 1.0
    measure_classes: bool = False

    def __post_init__(self) -> None:
        check_number("OffloadConfig.min_offload_elements", self.min_offload_elements,
                     minimum=0, integer=True)
        check_optional("OffloadConfig.max_pending_copy_bytes", self.max_pending_copy_bytes,
                       minimum=0, integer=True)
        check_optional("OffloadConfig.pending_copy_activations", self.pending_copy_activations,
                       minimum=0)
        for name in ("pin_memory", "stream", "measure_classes"):
            check_instance(f"OffloadConfig.{name}", getattr(self, name), bool, "True or False")


@dataclass(frozen=True)
class RuntimeConfig:
    """Options of Pipeline.

    - ``p2p_timeout_s``: how long a rank waits for one message (or for a send to finish) before
      it raises PipelineRuntimeError naming the action; a dead or mismatched peer becomes an
      error on every rank instead of a hang.
    - ``offload``: see OffloadConfig.
    - ``clone_hand_off``: copy stage outputs handed to a stage in the same process (V placement,
      local mode) so that each (stage, microbatch) owns its activation storage, as it would after
      a real receive; the memory accounting (simulator and meter) assumes this.
    - ``recv_lookahead``: on gloo, each receive is posted this many compute actions before its
      place in the lowered schedule (lowering.early_receives), so that the peer's send can go
      out while this rank computes; gloo only sends once the receive is posted. A posted
      receive holds its buffer (one stage input or output gradient) from then on: at most the
      receives of the rank's next ``recv_lookahead`` compute actions are outstanding. 8
      measured faster than 2 (about as early as torch.distributed.pipelining's lowering posts)
      and 4 on 2 CPU ranks (docs/benchmarks.md); 0 posts each receive right before the compute
      that needs it. NCCL always posts in place (its posting order is the
      protocol, lowering.py Note: [NCCL channels]).
    """

    p2p_timeout_s: float = 300.0
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    clone_hand_off: bool = True
    recv_lookahead: int = 8

    def __post_init__(self) -> None:
        check_number("RuntimeConfig.p2p_timeout_s", self.p2p_timeout_s, above=0)
        check_number("RuntimeConfig.recv_lookahead", self.recv_lookahead, minimum=0,
                     integer=True)
        check_instance("RuntimeConfig.offload", self.offload, OffloadConfig, "an OffloadConfig")
        check_instance("RuntimeConfig.clone_hand_off", self.clone_hand_off, bool,
                       "True or False")
