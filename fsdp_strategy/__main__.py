from fsdp_strategy.cli import main

raise SystemExit(main())
