"""`python -m deltafind.config` prints the example config (etc/deltafind.toml)."""

import sys

from deltafind.config.example import render_example_toml

sys.stdout.write(render_example_toml())
