"""The attention passes: tiles and plans, the launchers, the custom ops and the one autograd definition."""
