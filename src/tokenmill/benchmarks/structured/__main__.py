import sys

from tokenmill.benchmarks.structured.command import main

sys.exit(main())
