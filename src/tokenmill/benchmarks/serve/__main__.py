import sys

from tokenmill.benchmarks.serve.command import main

sys.exit(main())
