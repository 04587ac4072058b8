"""``python -m gpuserve`` is the ``gpuserve`` command."""

import sys

from gpuserve.cli.main import main

sys.exit(main())
