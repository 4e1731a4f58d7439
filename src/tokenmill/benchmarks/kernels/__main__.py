import sys

from tokenmill.benchmarks.kernels.command import main

sys.exit(main())
