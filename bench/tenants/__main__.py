from bench.tenants.run import main

raise SystemExit(main())
