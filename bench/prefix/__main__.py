from bench.prefix.run import main

raise SystemExit(main())
