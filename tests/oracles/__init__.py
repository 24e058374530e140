"""Independent oracles (exhaustive search, brute force) that share only the simulators with the solvers."""
