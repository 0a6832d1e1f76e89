"""CUDA's behaviour checked on the CPU: autocast's per-op dtype rules (table, tier) and kernel contracts."""
