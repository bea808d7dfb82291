"""megatron_bridge."""
