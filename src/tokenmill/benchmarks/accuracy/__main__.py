import sys

from tokenmill.benchmarks.accuracy.command import main

sys.exit(main())
