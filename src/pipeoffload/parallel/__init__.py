"""Layer 7: the distributed library a training loop of your own needs around ``Pipeline``
(``pipeoffload.distributed`` and ``pipeoffload.hf`` expose it; `pipeoffload train` is built on
it). One concern per module: ``topology`` (the (pp, dp, tp) device mesh and joining a job),
``job`` (the job's environment and the ranks' meeting), ``gradients`` (data-parallel sync and
clipping, ties counted once), ``precision`` (float32 master weights of bf16 stages),
``optimizer`` (the optimizer of a process's stages as one component), ``checkpoint``,
``checkpoint_files`` and ``sharded_state`` (checkpoint folders), ``export`` (Hugging Face
model folders). Nothing here imports the training application or the command line."""
