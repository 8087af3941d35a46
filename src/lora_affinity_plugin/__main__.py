"""`python -m lora_affinity_plugin ARGS` is `lora-affinity ARGS`: a module path that stays while the package's
folders move."""

import sys

from .ops.cli import main

sys.exit(main())
