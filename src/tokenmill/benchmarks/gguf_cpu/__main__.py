import sys

from tokenmill.benchmarks.gguf_cpu.command import main

sys.exit(main())
