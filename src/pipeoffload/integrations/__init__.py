"""Adapters to what users already train with (design.md layer 6): torch.distributed.pipelining
(``pipeoffload.torch``) and Hugging Face causal LMs (``pipeoffload.hf``). The runtime never
imports them; each needs its optional extra and says so when it is missing."""
