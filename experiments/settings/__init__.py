"""What a run is: the config dataclasses (with the emulated network's and the injected
faults'), strict `--set` overrides, the named experiments (presets), users' scripts as
configs, which settings an engine reads, and the check that every process of a run agrees on
them."""
