"""Engine profiles (deploy/profiles/*.toml): the format and its loader (schema), the least-squares
fit (fit), the generator from aiconfigurator's vLLM data (generate) and the cpu-small profile
fitted to this machine's real-vLLM measurements (cpu_small). See README.md here."""
