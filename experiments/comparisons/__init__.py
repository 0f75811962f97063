"""Named comparisons (grids of engines, worker and server counts on one experiment) and the
runner that executes a grid and hands its run directories to analysis/."""
