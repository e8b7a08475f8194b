"""`python -m verl_longstraw.configs` prints the folder of the shipped Hydra configs (for `--config-path`)."""

from verl_longstraw.configs import config_dir

print(config_dir())
