import sys

from tokenmill.benchmarks.ladder.command import main

sys.exit(main())
