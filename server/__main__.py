"""`python -m radixlm.server [flags]` is `radixlm serve [flags]`."""

import sys

from radixlm.server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
