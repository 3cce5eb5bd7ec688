"""The live dashboard (`dashboard.LiveDashboard`) and the HTML report that draws the same
figure (`report`): its state (`state`, `feed`, `whole_run`), its figure (`figure`, `traces`,
`plotdata`, `timeline`, `marks`, `layout`, `simulation`), its words (`status`, `expected`,
`link`), its controls (`toolbar`, `options`, `smoothing`, `compare`, `exports`) and its
widgets in the notebook (`box`)."""
