"""`python -m pipeoffload.cli ...`: the `pipeoffload` command, the module torchrun starts
(`torchrun ... -m pipeoffload.cli train ...`) and the one `train`'s own launcher starts."""

import sys

from pipeoffload.cli.main import main

sys.exit(main())
