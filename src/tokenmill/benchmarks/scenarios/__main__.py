import sys

from tokenmill.benchmarks.scenarios.command import main

sys.exit(main())
