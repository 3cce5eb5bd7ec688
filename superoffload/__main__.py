from superoffload.cli import main

raise SystemExit(main())
