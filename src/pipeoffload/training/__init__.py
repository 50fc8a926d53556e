"""The training application behind `pipeoffload train` (reference model, data, launch,
precision, tensor parallelism, recomputation, checkpoints) and `pipeoffload probe`'s
measurements; it never imports the command line (pipeoffload.cli)."""
