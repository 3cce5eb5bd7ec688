"""``python -m superoffload``: the CLI owns its process, so it chooses the OpenMP wait
policy before anything imports torch (superoffload/process_env.py)."""

from superoffload.process_env import claim_wait_policy

claim_wait_policy()

from superoffload.cli import main  # noqa: E402

raise SystemExit(main())
