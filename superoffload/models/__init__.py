"""Models the engine trains in the main job, the benchmarks and the tests."""

from superoffload.models.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    gpt2_124m,
    gpt_medium,
    gpt_small,
    gpt_tiny,
)

__all__ = ["GPT", "PRESETS", "GPTConfig", "gpt2_124m", "gpt_medium", "gpt_small", "gpt_tiny"]
