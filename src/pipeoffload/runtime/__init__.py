"""Layer 5: the PyTorch runtime that executes any schedule (offload included) on real modules.

Modules, one concern each: ``pipeline`` (the user-facing Pipeline), ``executor`` (one handler per
action kind), ``stage`` (a module's forward and its backward parts), ``backward`` (the I/W split),
``p2p`` (transports: local mailbox and torch.distributed), ``lowering`` (explicit SEND / RECV),
``offloader`` and ``pool`` (activation offload), ``meter`` (resident activation bytes),
``microbatch`` (splitting and checking the batch), ``config``.
Only this package touches torch.distributed.
"""
