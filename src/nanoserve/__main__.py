from nanoserve.cli import main

raise SystemExit(main())
