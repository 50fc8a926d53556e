"""The training application behind `pipeoffload train` (its torch-free configuration, the
trainer, the reference model, Hugging Face models, data, tensor parallelism, recomputation,
metrics) and `pipeoffload probe`'s measurements. It is built on the distributed library
(pipeoffload.parallel) and never imports the command line (pipeoffload.cli)."""
