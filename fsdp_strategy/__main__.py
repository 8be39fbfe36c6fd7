from fsdp_strategy.tools.cli import main

raise SystemExit(main())
