"""Notebook plumbing the views share: where we run (`env`), output slots frozen into static
snapshots (`slots`), the run's state (`runstate`), training off the cell (`trainer`, one run per
engine: `owners`), a rate-limited refresher (`refresher`), latest-only planner calls
(`debounce`), the hardware profile a view predicts with (`profile`), calibration after the
warm-up (`calibration`), and the one-way live plotly widget (`liveplot`, `liveplot.js`,
`plotjson`)."""
