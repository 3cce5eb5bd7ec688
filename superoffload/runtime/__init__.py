"""The offload engine (weight-stationary SuperOffload): hooks, lanes, STV, checkpoints.

Entry point: ``superoffload.initialize`` (``runtime.initialize``). See docs/engine.md.
"""
