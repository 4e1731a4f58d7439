from tokenmill.benchmarks.speculative.command import main

raise SystemExit(main())
