"""Context parallel: one GRPO group on the R ranks of a process group, in lockstep, prompt state split across them."""
