"""The offload tuner (`tuner.OffloadTuner`): its pure core (`core`: settings in, the planner's
prediction out), what each setting changes (`changes`), its controls (`controls`), what it
does with a live engine (`live`: Apply measured as an A/B, calibration) and its static page
(`page`)."""
