import sys

from tokenmill.benchmarks.seeds.command import main

sys.exit(main())
